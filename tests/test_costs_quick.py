"""A model this machine has not seen: its first request measures a quick cost curve within a fixed budget of
forwards (costs.curves.quick_curve), never the full measurement; engines that ask for full curves (a server's
start, the bench) measure and keep those instead. The curves' files: a damaged one is ignored, never trusted, and
two processes writing one at once leave one whole file."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

from draftverify import Engine, costs
from draftverify.models import Runner


@pytest.fixture
def curves_home(tmp_path, monkeypatch):
    """A folder of this test's own, and engines as they are made outside the tests (conftest.py has the tests'
    engines measure full curves)."""
    from draftverify import engine
    from draftverify.models import Shared

    folder = tmp_path / "curves"
    monkeypatch.setattr(costs, "cache_folder", lambda: folder)
    monkeypatch.setattr(engine, "Shared", Shared)
    return folder


def _count_forwards(monkeypatch) -> dict:
    """Counts every runner's forwards (`Runner.run`) and, apart, those run inside a quick measurement; a full
    measurement fails the test."""
    counts = {"all": 0, "quick": [], "inside": False}
    run, quick = Runner.run, costs.curves.quick_curve

    def counted_run(self, feed):
        counts["all"] += 1
        return run(self, feed)

    def counted_quick(runner, all_logits, widths):
        before = counts["all"]
        measured = quick(runner, all_logits, widths)
        counts["quick"].append((counts["all"] - before, tuple(widths)))
        return measured

    def refuse(*args):
        raise AssertionError("a first request measured a full curve")

    monkeypatch.setattr(Runner, "run", counted_run)
    monkeypatch.setattr(costs.curves, "quick_curve", counted_quick)
    monkeypatch.setattr(costs.curves, "measure_curve", refuse)
    return counts


def test_a_first_auto_request_on_an_unseen_model_runs_a_bounded_number_of_forwards(tiny, curves_home, monkeypatch):
    from test_feature_head import random_head

    from draftverify.loading import truncated_copy

    target = tiny("llama", layers=2)
    draft, head = truncated_copy(target, 1), random_head(target, seed=2)
    counts = _count_forwards(monkeypatch)
    Engine(target, draft, feature_head=head).generate("ab", method="auto", max_new_tokens=12, temperature=0)
    assert counts["quick"], "auto read no cost curve"
    for forwards, widths in counts["quick"]:  # a prefill, then three forwards a width (at least 1, 2, 4): no more
        assert 1 + 3 * 3 <= forwards <= costs.quick_forwards(widths) == 1 + 3 * len(widths)
    (saved,) = curves_home.glob("*.json")
    assert json.loads(saved.read_text())["quick"] is True


def test_quick_curves_on_disk_serve_quick_engines_and_full_engines_replace_them(tiny, curves_home, monkeypatch):
    target = tiny("llama")
    quick = costs.curve(Engine(target, backend="static").target_runner, widths=(1, 2, 4))
    assert quick.quick and not quick.slope and quick.context == costs.QUICK_CONTEXT
    engine = Engine(target, backend="static")
    engine.shared.full_curves = True
    full = costs.curve(engine.target_runner, widths=(1, 2, 4))  # measured in full, the quick file replaced
    assert not full.quick and full.context == costs.POLICY_CONTEXT
    assert costs.curve(engine.target_runner, widths=(1, 2, 4)) is full
    (saved,) = curves_home.glob("*.json")
    assert json.loads(saved.read_text())["quick"] is False
    costs.save_curve(curves_home, json.loads(saved.read_text())["key"], quick)  # a quick one never replaces it
    assert json.loads(saved.read_text())["quick"] is False
    monkeypatch.setattr(costs.timing, "forward_times", lambda *a, **k: pytest.fail("measured again"))
    again = costs.curve(Engine(target, backend="static").target_runner, widths=(1, 2, 4))  # a quick engine reads it
    assert not again.quick and dict(again) == dict(full)


def test_the_key_names_the_arithmetic_and_the_kernel_build(tiny):
    runner = Engine(tiny("llama"), backend="static").target_runner
    key = costs.curve_key(runner, True, (1, 2))
    assert key["arithmetic"] == "fp32 torch.float32" and key["kernels"] == costs.kernel_build()
    assert costs.kernel_build().startswith(__import__("draftverify.kernels").kernels.source_tag())


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # a partial write
        lambda text: text.replace('"times": {', '"times": {"64": 1.0, '),  # a width the key does not name
        lambda text: json.dumps({**json.loads(text), "times": {"1": -1.0, "2": 1.0}}),
        lambda text: json.dumps({**json.loads(text), "times": {"1": 0.0, "2": 0.0}}),
        lambda text: json.dumps({**json.loads(text), "slope": {"1": "fast", "2": 0.1}}),
        lambda text: json.dumps([1, 2]),
    ],
)
def test_a_damaged_file_is_ignored_and_replaced(tiny, curves_home, damage):
    target = tiny("llama")
    runner = Engine(target, backend="static").target_runner
    costs.curve(runner, widths=(1, 2))
    (saved,) = curves_home.glob("*.json")
    saved.write_text(damage(saved.read_text()))
    key = costs.curve_key(runner, True, (1, 2))
    assert costs.load_curve(curves_home, key) is None
    costs.curve(Engine(target, backend="static").target_runner, widths=(1, 2))  # measured again, and written
    assert costs.load_curve(curves_home, key) is not None


def _write_many(folder: str, key: dict, value: float, start) -> None:
    costs.disk.load_curve = lambda folder, key: None  # (this process only) every save writes, none defers
    start.wait()
    for _ in range(200):
        costs.save_curve(folder, key, costs.Curve({1: value, 2: 2 * value}, 16, full_slope(value)))


def full_slope(value: float) -> dict[int, float]:
    return {1: value / 100, 2: value / 50}


def test_two_processes_writing_at_once_leave_one_whole_file(tmp_path):
    key = {"model": "m", "widths": [1, 2]}
    fork = multiprocessing.get_context("fork")
    start = fork.Event()
    writers = [fork.Process(target=_write_many, args=(str(tmp_path), key, v, start)) for v in (0.5, 0.25)]
    for writer in writers:
        writer.start()
    start.set()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    (saved,) = tmp_path.iterdir()  # no temporary left behind
    kept = costs.load_curve(tmp_path, key)
    assert kept is not None and dict(kept) in ({1: 0.5, 2: 1.0}, {1: 0.25, 2: 0.5})
    assert kept.slope == full_slope(kept[1])  # one writer's curve, whole


def test_time_once_runs_three_forwards_a_width_and_keeps_the_faster_timed_one(monkeypatch):
    """Up the widths, three runs of each in a row, the first untimed: the faster of its two timed runs counts (a
    hiccup on one of them is dropped), and a wider forward is never taken as cheaper than a narrower one."""
    import types

    clock, calls = [0.0], []
    cost = {1: 1.0, 2: 0.9, 4: 1.5}  # 2 rows read cheaper than 1: noise

    def forward(tokens):
        calls.append(len(tokens))
        clock[0] += cost[len(tokens)] + (5.0 if len(calls) == 8 else 0.0)  # a hiccup on the first timed 4 rows

    monkeypatch.setattr(costs.timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    times = costs.time_once(forward, lambda: None, [5, 6, 7], widths=(1, 2, 4))
    assert calls == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    assert times == pytest.approx({1: 1.0, 2: 1.0, 4: 1.5})


def test_time_once_stops_where_the_cost_turns_linear_and_extends_the_wider_widths_along_it(monkeypatch):
    """A compute-bound forward (8 rows cost nearly twice 4): 16 and 32 rows, most of a measurement's time, are not
    run but extended along the slope of 4 to 8 rows; where the cost stays flat every width is measured."""
    import types

    clock, calls = [0.0], []
    steep = {1: 1.0, 2: 1.1, 4: 1.4, 8: 2.7, 16: 5.4, 32: 10.8}
    flat = {1: 1.0, 2: 1.0, 4: 1.1, 8: 1.2, 16: 1.5, 32: 2.2}

    def timer(cost):
        def forward(tokens):
            calls.append(len(tokens))
            clock[0] += cost[len(tokens)]

        return forward

    monkeypatch.setattr(costs.timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    widths = (1, 2, 4, 8, 16, 32)
    times = costs.time_once(timer(steep), lambda: None, [5, 6, 7], widths=widths)
    assert max(calls) == 8 and len(calls) == 3 * 4
    assert times == pytest.approx({1: 1.0, 2: 1.1, 4: 1.4, 8: 2.7, 16: 2.7 + 8 * 1.3 / 4, 32: 2.7 + 24 * 1.3 / 4})
    calls.clear()
    assert costs.time_once(timer(flat), lambda: None, [5, 6, 7], widths=widths) == pytest.approx(flat)
    assert len(calls) == 3 * len(widths)


@pytest.fixture
def gguf_engine(tmp_path, tokenizer, curves_home):
    """A fresh engine (no curve held) on the tiny GGUF file of test_gguf_direct, whose rows do not depend on the
    rows beside them: a prompt may be fed in parts, bit for bit."""
    from test_gguf_direct import LAYER_TYPES, config_for, write_file
    from transformers import GenerationConfig

    from draftverify.loading import Loaded
    from draftverify.loading.gguf_model import GGUFModel
    from draftverify.loading.gguf_weights import GGUFWeights

    path, _ = write_file(tmp_path / "tiny.gguf", LAYER_TYPES, len(tokenizer))
    config = config_for(tokenizer)
    model = GGUFModel(GGUFWeights(path, config, tokenizer), GenerationConfig.from_model_config(config))
    loaded = Loaded(model, tokenizer, name="tiny.gguf", source=path)

    def make() -> Engine:
        engine = Engine(loaded, backend="static")
        assert engine.target_runner.rows_alone and not engine.shared.full_curves
        return engine

    return make


def _fed(monkeypatch) -> list[int]:
    """The rows of every forward any runner runs, in order."""
    fed, run = [], Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, feed: fed.append(feed.size) or run(self, feed))
    return fed


PROMPT = "The quick brown fox jumps over the lazy dog, then naps under a tree by the river bank at noon."


@pytest.mark.parametrize(
    "linear_from, parts",
    [(None, [1, 2, 4, 8, 16, 32]), (4, [1, 2, 4, 8 + 16 + 32])],  # flat: every width; linear from 4: the rest in one
)
def test_a_first_request_times_the_curve_in_its_prompts_parts_and_runs_no_forward_for_it(
    gguf_engine, curves_home, monkeypatch, linear_from, parts
):
    """A model this machine has not timed: `auto`'s first request feeds its prompt's first rows (untimed), then 1,
    2, 4, ... rows timed, and the curve is those times; no forward runs apart for it, the file is written, and the
    reply is plain decoding's token for token."""
    plain = gguf_engine().generate(PROMPT, method="autoregressive", max_new_tokens=16, temperature=0)
    engine = gguf_engine()
    fed = _fed(monkeypatch)
    monkeypatch.setattr(costs.timing, "forward_times", lambda *a, **k: pytest.fail("a forward apart for the curve"))
    turned = lambda times: linear_from is not None and max(times, default=0) >= linear_from  # noqa: E731
    monkeypatch.setattr(costs.timing, "linear", turned)  # a tiny model's cost is flat: turned linear as the test says
    prompt = len(engine.encode(PROMPT))
    out = engine.generate(PROMPT, method="auto", max_new_tokens=16, temperature=0)
    assert out.tokens == plain.tokens
    assert fed[: 1 + len(parts)] == [prompt - 63, *parts]  # then the rounds
    (saved,) = curves_home.glob("*.json")
    data = json.loads(saved.read_text())
    assert data["quick"] is True and sorted(map(int, data["times"])) == [1, 2, 4, 8, 16, 32]
    again = gguf_engine()  # a later process reads the file: its prompt goes in one forward
    fed.clear()
    assert again.generate(PROMPT, method="auto", max_new_tokens=16, temperature=0).tokens == plain.tokens
    assert fed[0] == prompt


def test_a_short_prompt_times_what_it_can_and_the_rest_is_timed_apart(gguf_engine, curves_home, monkeypatch):
    """A prompt too short for every width: its parts time the narrow widths, a quick measurement times only the
    widths they left out (given the parts' times), and the reply is plain decoding's."""
    plain = gguf_engine().generate("Hi there!", method="autoregressive", max_new_tokens=12, temperature=0)
    engine = gguf_engine()
    given, time_once = [], costs.timing.time_once

    def spied(forward, rollback, context, widths, known=None):
        given.append(dict(known or {}))
        return time_once(forward, rollback, context, widths, known)

    monkeypatch.setattr(costs.timing, "time_once", spied)
    monkeypatch.setattr(costs.timing, "linear", lambda times: False)  # every width is timed
    fed = _fed(monkeypatch)
    out = engine.generate("Hi there!", method="auto", max_new_tokens=12, temperature=0)
    assert out.tokens == plain.tokens
    prompt = len(engine.encode("Hi there!"))
    assert fed[:4] == [prompt - 7, 1, 2, 4] and sorted(given[0]) == [1, 2, 4]  # the rest apart, on a fork:
    assert sorted(fed[4 : 4 + 1 + 3 * 3]) == sorted([costs.QUICK_CONTEXT] + [8, 16, 32] * 3)


def test_the_prompts_parts_give_one_forwards_bits_and_a_curve_read_first_measures_itself(gguf_engine, curves_home):
    """The parts' logits, hidden states and cache are the one forward's, bit for bit; a waiting curve read before
    any prefill is measured then (a quick curve), and a batch sizing its parts never reads a waiting one."""
    from draftverify.backend.feed import Feed
    from draftverify.costs import prefill

    engine = gguf_engine()
    tokens = engine.encode(PROMPT)
    waiting = costs.curve(engine.target_runner, widths=(1, 2, 4, 8))
    assert waiting.pending is not None and costs.kept_curve(engine.target_runner) is None
    whole, parted = engine.target_runner.fork(), engine.target_runner.fork()
    one = whole.run(Feed(tokens, last=1, hidden="all"))
    parts = prefill.forward(parted, Feed(tokens, last=1, hidden="all"))
    assert waiting.pending is None and sorted(waiting) == [1, 2, 4, 8] and waiting.quick
    assert torch.equal(one.logits, parts.logits) and torch.equal(one.hidden, parts.hidden)
    assert torch.equal(whole.run(Feed([5, 6, 7])).logits, parted.run(Feed([5, 6, 7])).logits)
    assert costs.kept_curve(engine.target_runner) is waiting
    other = gguf_engine()
    other.shared.curve_folder = None  # nothing on disk: a curve read first is measured there and then
    early = costs.curve(other.target_runner, widths=(1, 2, 4, 8))
    assert early.pending is not None
    table = early.at(40)
    assert early.pending is None and sorted(table) == [1, 2, 4, 8] and early.context == costs.QUICK_CONTEXT


def test_a_draft_models_curve_is_timed_in_the_drafts_own_prefill(gguf_engine, curves_home, monkeypatch):
    """`speculative`'s cost policy reads the draft's curve too: the draft takes the prompt in timed parts of its own
    (the last row's logits each, as it proposes) before its first proposal, and nothing runs apart."""
    from draftverify.loading import truncated_copy

    plain = gguf_engine().generate(PROMPT, method="autoregressive", max_new_tokens=16, temperature=0)
    target = gguf_engine()
    engine = Engine(target.target, truncated_copy(target.target, 1), backend="static")
    assert engine.draft_runner.rows_alone
    lasts, run = [], Runner.run
    monkeypatch.setattr(
        Runner, "run", lambda self, feed: lasts.append((self.draft, feed.size, feed.last)) or run(self, feed)
    )
    monkeypatch.setattr(costs.timing, "forward_times", lambda *a, **k: pytest.fail("a forward apart for the curve"))
    monkeypatch.setattr(costs.timing, "linear", lambda times: False)
    out = engine.generate(PROMPT, method="speculative", max_new_tokens=16, temperature=0)
    assert out.tokens == plain.tokens
    prompt = len(engine.encode(PROMPT))
    drafts = [(size, last) for draft, size, last in lasts if draft]
    assert drafts[:6] == [(prompt - 31, 1), (1, 1), (2, 1), (4, 1), (8, 1), (16, 1)]  # then the first proposal
    saved = [json.loads(f.read_text()) for f in curves_home.glob("*.json")]
    assert sorted((d["key"]["all_logits"], d["quick"]) for d in saved) == [(False, True), (True, True)]
