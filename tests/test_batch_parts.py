"""A long prompt beside decoding requests, fed in parts sized by a gap budget (`batch.Batch(max_gap_s=...)`): each
part has the most rows whose stacked forward, beside the rows the others feed that step (their drafts included), the
target's cost curve prices within the budget, at least `LEAST_PART`; outputs stay the single-request ones. On the tiny
GGUF file of test_gguf_direct (its rows do not depend on the rows beside them), with a made-up curve."""

from __future__ import annotations

import pytest
import torch
from conftest import give_curve
from test_gguf_direct import LAYER_TYPES, config_for, write_file

from draftverify import Engine, constraints
from draftverify import batch as batch_module
from draftverify.batch import FIXED_PART, LEAST_PART, Batch
from draftverify.costs import forward_time, kept_curve, rows_within
from draftverify.drafters.feature import TREE_WIDTHS
from draftverify.errors import DraftVerifyError
from draftverify.loading import Loaded
from draftverify.loading.gguf_model import GGUFModel
from draftverify.loading.gguf_weights import GGUFWeights
from draftverify.prefix_cache import common_length
from draftverify.serve import ServeConfig, create_app, parse_methods
from draftverify.serve.metrics import Metrics
from draftverify.serve.scheduler import Scheduler

COSTS = {w: 0.02 + 0.01 * w for w in TREE_WIDTHS}  # made up: a fixed part and a part per row
BUDGET = 0.205  # 18 rows alone: 0.02 + 0.18 s


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    from transformers import GenerationConfig

    path, _ = write_file(tmp_path_factory.mktemp("gguf") / "tiny.gguf", LAYER_TYPES, len(tokenizer))
    config = config_for(tokenizer)
    model = GGUFModel(GGUFWeights(path, config, tokenizer), GenerationConfig.from_model_config(config))
    engine = Engine(Loaded(model, tokenizer, name="tiny.gguf", source=path), backend="static")
    assert engine.target_runner.rows_alone
    return engine


@pytest.fixture
def fed(monkeypatch):
    """Per stacked forward, {runner: the rows it fed}, in member order."""
    found, spied = [], batch_module.forward_many
    monkeypatch.setattr(
        batch_module,
        "forward_many",
        lambda runners, feeds: found.append({r: f.size for r, f in zip(runners, feeds)}) or spied(runners, feeds),
    )
    return found


def decode_together(engine: Engine, batch: Batch, requests: list, *longs: list[int]) -> list:
    """Start `requests` ((prompt, method, new tokens[, request settings])), one step for their prefills, then add
    the long prompts (2 new tokens each) and step to the end; returns every request's output, the long prompts'
    last."""
    sessions = []

    def join(prompt, method, n, settings=None):
        m, s = engine.request(prompt, method, slot=len(sessions), max_new_tokens=n, eos_token_id=[], **(settings or {}))
        s.stats.start()
        batch.add(s, m.target, m.rounds(s))
        sessions.append(s)

    for request in requests:
        join(*request)
    batch.step()
    for long in longs:
        join(long, "autoregressive", 2)
    while batch.members:
        assert all(m.error is None for m in batch.step())
    return [s.output for s in sessions]


def alone(engine: Engine, requests: list, *longs: list[int]) -> list:
    """What `decode_together` gives, each request decoded alone."""
    outputs = [
        engine.generate(p, method=m, max_new_tokens=n, eos_token_id=[], **(settings[0] if settings else {})).tokens
        for p, m, n, *settings in requests
    ]
    return outputs + [engine.generate(long, method="autoregressive", max_new_tokens=2).tokens for long in longs]


def prompt_steps(fed: list[dict], runner, length: int) -> list[tuple[int, int]]:
    """(rows of `runner`'s prompt, the others' rows) of each step that fed some of that prompt, `length` rows."""
    steps, done = [], 0
    for row in fed:
        if runner in row and done < length:
            done += row[runner]
            steps.append((row[runner], sum(row.values()) - row[runner]))
    assert done == length
    return steps


def test_rows_within_prices_the_whole_forward():
    assert rows_within(COSTS, 0, BUDGET, 512) == 18
    assert rows_within(COSTS, 6, BUDGET, 512) == 12  # beside 6 rows: 18 in all
    assert rows_within(COSTS, 18, BUDGET, 512) == 0
    assert rows_within(COSTS, 0, BUDGET, 10) == 10
    assert rows_within(COSTS, 0, 100.0, 512) == 512  # beyond the widest width the table goes on linearly


def test_a_long_prompt_takes_what_the_budget_leaves_beside_the_others_rows(engine, fed):
    give_curve(engine, COSTS)
    loop = [5, 6, 7, 8] * 4
    requests = [([9, 4, 9], "autoregressive", 4), ([3, 4, 5], "autoregressive", 8)]
    requests += [(loop, "prompt-lookup", 40), (loop[1:], "prompt-lookup", 40), ([11, 12], "autoregressive", 40)]
    long = [(7 * i + 3) % 60 + 2 for i in range(150)]
    assert decode_together(engine, Batch(prompt_part=512, max_gap_s=BUDGET), requests, long) == alone(
        engine, requests, long
    )
    steps = prompt_steps(fed, engine.slot(len(requests))[0], len(long))
    rest = len(long)
    for part, others in steps:
        room = max(LEAST_PART, rows_within(COSTS, others, BUDGET, 512))
        assert part == (rest if room >= rest else min(room, rest - 1))
        assert part == LEAST_PART or forward_time(COSTS, part + others) <= BUDGET
        rest -= part
    assert any(others > 5 for _, others in steps)  # drafted rows beside the others' one each: priced as fed
    assert len({part for part, _ in steps}) > 2  # the parts grow as the others leave


def test_a_prompt_that_runs_whole_alone_is_parted_beside_decoding_requests(engine, fed):
    give_curve(engine, COSTS)
    requests = [([9, 4, 9], "autoregressive", 12), ([3, 4, 5], "autoregressive", 12)] * 2
    short = [(7 * i + 3) % 60 + 2 for i in range(17)]  # under the 18 rows a part may have alone
    assert decode_together(engine, Batch(prompt_part=512, max_gap_s=BUDGET), requests, short) == alone(
        engine, requests, short
    )
    assert prompt_steps(fed, engine.slot(len(requests))[0], len(short)) == [(14, 4), (3, 4)]


def test_prompts_waiting_together_take_turns_the_shortest_first_within_the_budget(engine, fed):
    """The prompt with the fewest rows left gets the step's room; the other waits (is in no forward) until that
    prompt is done, then gets the room beside its decoding."""
    give_curve(engine, COSTS)
    requests = [([9, 4, 9], "autoregressive", 30), ([3, 4, 5], "autoregressive", 30)]
    longer, shorter = [(7 * i + 3) % 60 + 2 for i in range(100)], [(5 * i + 1) % 60 + 2 for i in range(84)]
    batch = Batch(prompt_part=512, max_gap_s=BUDGET)
    assert decode_together(engine, batch, requests, longer, shorter) == alone(engine, requests, longer, shorter)
    one, two = (engine.slot(len(requests) + i)[0] for i in (1, 0))  # the shorter's runner, the longer's
    ones, twos = prompt_steps(fed, one, len(shorter)), prompt_steps(fed, two, len(longer))
    waited = [row for row in fed if one in row and two not in row]
    assert len(waited) == len(ones) - 1 and ones[:-1] == [(16, 2)] * len(waited)  # 18 rows in all: the budget's
    assert ones[-1] == (len(shorter) - 16 * len(waited), 2 + twos[0][0])  # its rest (it fits): whole
    assert twos[0][0] == 16 - ones[-1][0] and twos[1] == (15, 3)  # 15: beside three decoding
    assert all(forward_time(COSTS, sum(row.values())) <= BUDGET for row in fed[1:])


def test_a_short_prompt_beside_a_long_one_runs_first_when_nobody_decodes(engine, fed):
    give_curve(engine, COSTS)
    longer, short = [(7 * i + 3) % 60 + 2 for i in range(100)], [9, 4, 9, 4]
    batch = Batch(prompt_part=512, max_gap_s=BUDGET)
    assert decode_together(engine, batch, [], longer, short) == alone(engine, [], longer, short)
    assert fed[0] == {engine.slot(0)[0]: 14, engine.slot(1)[0]: 4}  # the short whole, the long's part: 18 rows
    fed.clear()
    assert decode_together(engine, batch, [], longer, longer[:50]) == alone(engine, [], longer, longer[:50])
    assert list(fed[0].values()) == [100, 50]  # both longer than a part alone: whole, nobody waits


def test_without_a_curve_parts_are_fixed_and_without_a_budget_the_cap(engine, fed):
    give_curve(engine, None)
    long = [(5 * i + 1) % 60 + 2 for i in range(300)]
    decode_together(engine, Batch(prompt_part=512, max_gap_s=BUDGET), [([9, 4, 9], "autoregressive", 12)], long)
    parts = [part for part, _ in prompt_steps(fed, engine.slot(1)[0], len(long))]
    assert parts == [FIXED_PART, FIXED_PART, 300 - 2 * FIXED_PART]
    fed.clear()
    decode_together(engine, Batch(prompt_part=100, max_gap_s=0.0), [([9, 4, 9], "autoregressive", 12)], long)
    assert [part for part, _ in prompt_steps(fed, engine.slot(1)[0], len(long))] == [100, 100, 100]


def test_the_server_measures_the_curve_and_builds_the_grammars_tokenizer_view_before_serving(engine):
    with pytest.raises(DraftVerifyError, match="max_gap_ms=-1"):
        ServeConfig(max_gap_ms=-1)
    give_curve(engine, None)
    Scheduler(engine, 4, Metrics(), prompt_part=512, max_gap_s=0.0)
    assert kept_curve(engine.target_runner) is None  # no budget: no curve needed
    constraints._TOKENIZERS.pop((id(engine.target.tokenizer), engine.eos_ids()), None)
    service = create_app(engine, ServeConfig(methods=parse_methods("autoregressive"), max_gap_ms=100)).state.service
    assert kept_curve(engine.target_runner) is not None
    assert (service.scheduler._batch.prompt_part, service.scheduler._batch.max_gap_s) == (512, 0.1)
    assert (
        id(engine.target.tokenizer),
        engine.eos_ids(),
    ) in constraints._TOKENIZERS  # structured output's view: built before serving
    engine.use_prefix_cache(0)  # the service turned it on; the module's engine goes on without


def test_the_warm_up_caches_what_every_chat_begins_with(engine):
    """The server's warm-up goes through the chat template, so with the prefix cache on the template's opening (here
    a system prompt) is cached before the first client asks, and the first chat request prefills only what follows
    it; the cache's counters start at zero (they are the clients'). With the cache off nothing is kept."""
    template = (
        "<system>You are a careful assistant who answers briefly and well.\n"
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    )

    def chat(text):
        return engine.encode([{"role": "user", "content": text}], chat=True, chat_template=template)

    opening = common_length(torch.tensor(chat("What is a prime?")), torch.tensor(chat("Name a colour.")))
    assert opening >= 8
    create_app(engine, ServeConfig(methods=parse_methods("autoregressive"), chat_template=template))
    cache = engine.prefix_cache
    assert cache.entries and (cache.hits, cache.misses, cache.tokens_reused) == (0, 0, 0)
    out = engine.generate(chat("What is a prime?"), method="autoregressive", max_new_tokens=2)
    assert out.stats.cached_tokens >= opening
    engine.use_prefix_cache(0)
    create_app(engine, ServeConfig(methods=parse_methods("autoregressive"), chat_template=template, prefix_cache_mb=0))
    assert engine.prefix_cache is None
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') }}{% endif %}" + (
        template
    )  # renders the service's check (system, user), not a lone user turn: the warm-up goes on without it
    create_app(engine, ServeConfig(methods=parse_methods("autoregressive"), chat_template=strict))
    assert all(len(entry.tokens) <= 3 for entry in engine.prefix_cache.entries.values())
    engine.use_prefix_cache(0)


def test_decoders_drafts_share_the_budget_and_a_request_alone_drafts_freely(engine, fed):
    """Beside other decoders a request's forward has at most an even share of the rows the budget prices (its
    drafts shortened to fit, never below one row), so the step stays within it; alone, its drafts are its own
    drafter's (they delay no other stream). Outputs stay the single-request ones."""
    give_curve(engine, COSTS)
    loop, HF = [5, 6, 7, 8] * 4, {"preset": "hf"}  # prompt lookup (preset hf) copies it 10 tokens a round
    requests = [
        (loop, "prompt-lookup", 40, HF),
        (loop[1:], "prompt-lookup", 40, HF),
        (loop[2:], "prompt-lookup", 40, HF),
    ]
    assert decode_together(engine, Batch(prompt_part=512, max_gap_s=BUDGET), requests) == alone(engine, requests)
    decoding = [rows for rows in (list(row.values()) for row in fed) if len(rows) == 3 and max(rows) <= 11]
    assert max(max(rows) for rows in decoding) == 6  # a third each of the 18 rows the budget prices
    fed.clear()
    assert decode_together(engine, Batch(prompt_part=512, max_gap_s=BUDGET), requests[:1]) == alone(
        engine, requests[:1]
    )
    assert max(max(row.values()) for row in fed[1:]) == 11  # the root and 10 drafted tokens
