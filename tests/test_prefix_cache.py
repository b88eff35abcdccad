"""The prefix cache (draftverify.prefix_cache): a chat's second turn reuses the first turn's keys and values, bit for
bit what a full prefill computes, with outputs identical to decoding without it."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from draftverify.batch import Batch
from draftverify.engine import Engine
from draftverify.loading import default_feature_head
from draftverify.serve.metrics import Metrics

BUDGET = 256 << 20
TURN1 = [{"role": "user", "content": "Write a short poem about the sea and the wind."}]


def turn2(first_text: str) -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": first_text}, {"role": "user", "content": "Now one about rain."}]


@pytest.fixture(scope="module")
def engines(smollm):
    head = default_feature_head(smollm)
    return {arith: Engine(smollm, feature_head=head, arithmetic=arith) for arith in ("q8", "fp32")}


@pytest.fixture
def engine(engines):
    engine = engines["q8"]  # the default model's default arithmetic
    yield engine
    engine.use_prefix_cache(0)


def chat(engine: Engine, cache: bool, method: str, **settings):
    """Two turns of one chat, the second sending the first's reply back; from a fresh cache and calibration."""
    engine.use_prefix_cache(0)
    engine.use_prefix_cache(BUDGET if cache else 0)
    engine.shared.calibration.clear()  # the feature head's calibration learns across requests: start each run alike
    first = engine.generate(TURN1, method=method, chat=True, max_new_tokens=12, **settings)
    second = engine.generate(turn2(first.text), method=method, chat=True, max_new_tokens=12, **settings)
    return first, second


@pytest.mark.parametrize(
    "method, settings",
    [
        ("autoregressive", {}),
        ("auto", {}),
        ("speculative", {}),
        ("autoregressive", {"temperature": 0.8, "seed": 3}),
        ("prompt-lookup", {"temperature": 0.8, "seed": 3}),  # drafts that depend on the tokens alone
    ],
)
def test_outputs_are_identical_with_and_without_the_cache(engine, method, settings):
    plain = chat(engine, False, method, **settings)
    cached = chat(engine, True, method, **settings)
    assert [r.tokens for r in cached] == [r.tokens for r in plain]
    assert plain[1].stats.cached_tokens == 0
    assert cached[1].stats.cached_tokens >= cached[0].stats.prompt_tokens  # the first turn's prompt at least
    assert engine.prefix_cache.hits == 1 and engine.prefix_cache.misses == 1


def test_the_second_turn_prefills_only_its_new_part(engine, monkeypatch):
    engine.use_prefix_cache(BUDGET)
    first = engine.generate(TURN1, method="autoregressive", chat=True, max_new_tokens=12)
    assert first.stats.finish_reason == "length"
    fed = []
    run = engine.target_runner.run
    monkeypatch.setattr(engine.target_runner, "run", lambda feed: fed.append(feed.size) or run(feed))
    second = engine.generate(turn2(first.text), method="autoregressive", chat=True, max_new_tokens=4)
    held = first.stats.prompt_tokens + len(first.tokens) - 1  # the last token never entered the cache
    assert second.stats.cached_tokens == held == engine.prefix_cache.tokens_reused
    assert fed[0] == second.stats.prompt_tokens - held  # the prefill: the new part only


@pytest.mark.parametrize("arith", ["q8", "fp32"])
def test_first_logits_after_a_reused_prefix_are_a_full_prefills_bits(engines, arith):
    engine = engines[arith]
    assert engine.arithmetic == arith and engine.target_runner.rows_alone
    engine.use_prefix_cache(BUDGET)
    try:
        first = engine.generate(TURN1, method="speculative", chat=True, max_new_tokens=12)  # reply rows: verified
        prompt = engine.encode(turn2(first.text), chat=True)
        whole = engine.target_runner.fork()
        full = whole.forward(prompt, last=1, hidden="all")
        for need_hidden in (True, False):  # hidden states: the prompt's rows; without: the reply's rows too
            runner = engine.target_runner.fork()
            n, states = engine.prefix_cache.restore(runner, prompt, need_hidden)
            assert n >= first.stats.prompt_tokens + (0 if need_hidden else len(first.tokens) - 1)
            out = runner.forward(prompt[n:], last=1, hidden="all")
            assert torch.equal(out.logits, full.logits)
            if need_hidden:
                assert torch.equal(torch.cat([states, out.hidden]), full.hidden)
    finally:
        engine.use_prefix_cache(0)


def test_a_batch_reuses_the_cache_with_identical_outputs(engine):
    first = engine.generate(TURN1, method="speculative", chat=True, max_new_tokens=12)
    prompts = [turn2(first.text), [{"role": "user", "content": "Name three rivers."}]]
    plain = [engine.generate(p, method="speculative", chat=True, max_new_tokens=8).tokens for p in prompts]
    engine.use_prefix_cache(BUDGET)
    engine.generate(TURN1, method="speculative", chat=True, max_new_tokens=12)  # its entry holds hidden states
    batch, sessions = Batch(prompt_part=8), []  # the server's path: the rest of a prompt fed 8 rows a step
    for i, prompt in enumerate(prompts):
        m, s = engine.request(prompt, "speculative", slot=i, chat=True, max_new_tokens=8)
        s.stats.start()
        batch.add(s, m.target, m.rounds(s))
        sessions.append(s)
    while batch.members:
        assert all(m.error is None for m in batch.step())
    assert [s.output for s in sessions] == plain
    assert sessions[0].stats.cached_tokens >= first.stats.prompt_tokens
    assert 0 < sessions[1].stats.cached_tokens < first.stats.prompt_tokens  # the chat template's system turn only


def test_least_recently_used_entries_go_past_the_budget(engine):
    engine.use_prefix_cache(BUDGET)
    engine.generate("The sea is", method="autoregressive", max_new_tokens=4)
    size = engine.prefix_cache.nbytes
    engine.use_prefix_cache(0)
    engine.use_prefix_cache(size * 3 // 2)  # room for one such entry, not two
    cache = engine.prefix_cache
    engine.generate("The sea is", method="autoregressive", max_new_tokens=4)
    engine.generate("A river runs", method="autoregressive", max_new_tokens=4)
    assert (len(cache.entries), cache.evictions) == (1, 1) and cache.nbytes <= cache.budget
    again = engine.generate("The sea is blue", method="autoregressive", max_new_tokens=4)
    assert again.stats.cached_tokens == 0  # the older entry went
    engine.use_prefix_cache(size // 2)  # smaller than any entry: nothing is kept
    assert not cache.entries and cache.nbytes == 0
    engine.generate("The sea is", method="autoregressive", max_new_tokens=4)
    assert not cache.entries


def test_a_reused_prefix_that_the_next_turn_extends_is_replaced(engine):
    engine.use_prefix_cache(BUDGET)
    first = engine.generate(TURN1, method="autoregressive", chat=True, max_new_tokens=6)
    engine.generate(turn2(first.text), method="autoregressive", chat=True, max_new_tokens=6)
    assert len(engine.prefix_cache.entries) == 1  # the first turn's entry is a prefix of the second's


def test_metrics_serve_the_counters(engine):
    engine.use_prefix_cache(BUDGET)
    metrics = Metrics(prefix_cache=lambda: engine.prefix_cache)
    first = engine.generate(TURN1, method="autoregressive", chat=True, max_new_tokens=6)
    second = engine.generate(turn2(first.text), method="autoregressive", chat=True, max_new_tokens=6)
    got = {s.name: s.value for f in text_string_to_metric_families(metrics.render(0, 1, False)) for s in f.samples}
    assert got["draftverify_prefix_cache_hits_total"] == 1 and got["draftverify_prefix_cache_misses_total"] == 1
    assert got["draftverify_prefix_cache_reused_tokens_total"] == second.stats.cached_tokens > 0
    assert got["draftverify_prefix_cache_bytes"] == engine.prefix_cache.nbytes > 0
    assert got["draftverify_prefix_cache_entries"] == 1 and got["draftverify_prefix_cache_evictions_total"] == 0
    assert got["draftverify_prefix_cache_budget_bytes"] == BUDGET
    assert not any(
        "prefix" in s.name for f in text_string_to_metric_families(Metrics().render(0, 1, False)) for s in f.samples
    )


def test_the_cache_is_off_on_the_eager_backend(tiny):
    engine = Engine(tiny("llama"), backend="eager", prefix_cache_bytes=BUDGET)  # batched sums differ by row count
    first = engine.generate([5, 6, 7, 8, 9], method="autoregressive", max_new_tokens=4)
    second = engine.generate(first.prompt_tokens + first.tokens + [3], method="autoregressive", max_new_tokens=4)
    assert second.stats.cached_tokens == 0 and not engine.prefix_cache.entries
    assert engine.prefix_cache.hits == engine.prefix_cache.misses == 0
