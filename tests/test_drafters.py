"""The drafter seam: prompt lookup (a drafter in one file), a drafter written in a test, the
shared round's contract, and an import graph without cycles."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch
from conftest import ARCHS
from phrase_sampling import second_token_pvalue

from draftverify import Engine
from draftverify.drafters.base import Drafter, Proposal
from draftverify.drafters.prompt_lookup import PromptLookup, PromptLookupConfig
from draftverify.round import decode
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping

REPEATS = ["one two three one two three one two", "def f(x):\n    return x\ndef g(x):\n    return"]


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(PromptLookupConfig(k=3, max_ngram=2))
    s = Session([1], Sampling(), Stopping())
    assert lookup.propose(s, [5, 6, 7, 8, 5, 6, 9, 5, 6], room=10).paths == [
        [9, 5, 6]
    ]  # latest "5 6", then its follow-up
    assert lookup.propose(s, [5, 6, 7, 8, 5, 6, 9, 5, 6], room=2).paths == [[9, 5]]
    assert lookup.propose(s, [1, 2, 3, 4], room=10).paths == []  # no earlier occurrence of any suffix
    # falls back to a 1-gram, a weak match: its follow-up is k1 (2 by default) tokens
    assert lookup.propose(s, [4, 1, 2, 3, 4], room=10).paths == [[1, 2]]
    assert PromptLookup(PromptLookupConfig(k=3, k1=3)).propose(s, [4, 1, 2, 3, 4], room=10).paths == [[1, 2, 3]]
    # a repeat that runs into the end of the text goes on with its period (an overlapping copy), not cut short
    assert lookup.propose(s, [7, 1, 2, 1, 2], room=10).paths == [[1, 2, 1]]  # "1 2" at 1, then period 2
    assert lookup.propose(s, [7, 5, 5, 5], room=10).paths == [[5, 5, 5]]  # "5 5" at 1: period 1
    # each offer says how long its match was: `auto` prices the kinds apart
    assert lookup.propose(s, [5, 6, 7, 8, 5, 6, 9, 5, 6], room=10).kind == "match 2"
    assert lookup.propose(s, [4, 1, 2, 3, 4], room=10).kind == "match 1"


def test_prompt_lookup_offers_more_where_the_text_copies_itself_at_length():
    """A 3-token match whose occurrence's text goes on matching back to `long` tokens offers `k_long` tokens (its
    own kind); one that matches 3 or 4 back offers k."""
    lookup = PromptLookup(PromptLookupConfig(k=3, long=5, k_long=6))
    s = Session([1], Sampling(), Stopping())
    text = [9, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    offer = lookup.propose(s, [0, *text, 1, 2, 3, 4, 5], room=10)  # "1 2 3 4 5" matched back 5 tokens
    assert offer.paths == [[6, 7, 8, 9, 1, 2]] and offer.kind == "match 5+"
    offer = PromptLookup(PromptLookupConfig(k=3, long=5, k_long=6)).propose(s, [0, *text, 7, 3, 4, 5], room=10)
    assert offer.paths == [[6, 7, 8]] and offer.kind == "match 3"  # "3 4 5" matched, "7" before it differs
    offer = PromptLookup(PromptLookupConfig(k=3, long=5, k_long=6)).propose(s, [0, *text, 1, 2, 3, 4, 5], room=4)
    assert offer.paths == [[6, 7, 8, 9]]  # no more than the room
    offer = PromptLookup(PromptLookupConfig(k=8, long=5, k_long=6)).propose(s, [0, *text, 1, 2, 3, 4, 5], room=10)
    assert len(offer.paths[0]) == 8  # never fewer than k (the `hf` preset's 10 stay 10)


def test_prompt_lookup_grows_its_index_as_a_scan_would_find():
    """Round after round of one growing sequence, the index proposes what a scan for the latest earlier occurrence
    of the longest suffix (3, 2, then 1 tokens) finds."""

    def scan(seq, k):
        for n in range(min(3, len(seq) - 1), 0, -1):
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == seq[-n:]:
                    out, period = seq[start + n : start + n + k], len(seq) - start - n
                    return [out + [out[i % period] for i in range(len(out), k)]]
        return []

    rng = random.Random(0)
    s = Session([1], Sampling(), Stopping())
    for trial in range(20):
        lookup, seq = (
            PromptLookup(PromptLookupConfig(k=4, k1=4, k_long=0)),
            [rng.randrange(6) for _ in range(rng.randrange(1, 30))],
        )
        for _ in range(40):
            assert lookup.propose(s, seq, room=10).paths == scan(seq, 4), seq
            seq = seq + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup_greedy_equals_autoregressive(tiny, arch):
    engine = Engine(tiny(arch))
    for backend in ("eager", "static") if arch in ("llama", "qwen2") else ("eager",):
        engine = Engine(tiny(arch), backend=backend)
        drafted = 0
        for prompt in REPEATS:
            ids = engine.encode(prompt)
            ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
            for options in ({}, {"preset": "hf"}, {"k": 1, "max_ngram": 1}):
                r = engine.generate(ids, method="prompt-lookup", max_new_tokens=30, eos_token_id=[], **options)
                assert r.tokens == ar.tokens, (arch, backend, prompt, options)
                drafted += r.stats.drafted
        assert drafted > 0


def test_prompt_lookup_sampling_matches_the_target(tiny, monkeypatch):
    """The second token is verified against a looked-up guess: it follows the target's exact distribution,
    and the classic wrong rule (resample from p after a rejection) is caught."""
    target = tiny("llama", seed=0, layers=2, hidden=32)
    engine = Engine(target)
    sampling, n = Sampling(temperature=0.1, top_k=4), 1500
    prompt = guessable_prompt(target.model, sampling)

    def pvalue():
        counts: dict[int, int] = {}
        for seed in range(n):
            r = engine.generate(
                prompt, method="prompt-lookup", max_new_tokens=3, temperature=0.1, top_k=4, seed=seed, eos_token_id=[]
            )
            counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
        return second_token_pvalue(target.model, prompt, sampling, counts)

    assert pvalue() > 1e-3
    import draftverify.verify

    monkeypatch.setattr(draftverify.verify, "_normalise", lambda dist, fallback: fallback)
    assert pvalue() < 1e-6


def guessable_prompt(model, sampling: Sampling) -> list[int]:
    """A prompt x y B whose likeliest next token is x (p >= 0.5) and whose next token after that is
    y with 0.3 <= p <= 0.8, x occurring nowhere else: lookup then guesses y, which the target
    rejects often enough for the wrong rule to show."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():

        def probs(ids):
            return sampling.probs(model(torch.tensor([ids])).logits[0, -1])

        for _ in range(2000):
            base = torch.randint(0, 100, (5,), generator=gen).tolist()
            x = int(probs(base).argmax())
            prompt = [x, int(probs(base + [x]).argmax())] + base
            p1 = probs(prompt)
            if x in prompt[1:] or p1[x] < 0.5:
                continue
            if 0.3 <= probs(prompt + [x])[prompt[1]] <= 0.8:
                return prompt
    raise AssertionError("no guessable prompt for this model")


class Stubborn(Drafter):
    """Always proposes the same two branches; records what the round tells it."""

    def __init__(self):
        self.seen: list[tuple[int, int, int]] = []  # (sequence length, drafted, accepted)
        self.finished = False

    def propose(self, s, seq, room):
        return Proposal([[seq[-1], 3][:room], [7, 7, 7][:room]])

    def observe(self, s, seq, proposal, step):
        self.seen.append((len(seq), step.drafted, step.accepted))

    def finish(self, s):
        self.finished = True


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_any_drafter_plugs_into_the_round_and_stays_exact(tiny, backend):
    engine = Engine(tiny("llama"), backend=backend)
    ids = engine.encode(REPEATS[0])
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=20, eos_token_id=[])
    s = Session(ids, Sampling(), Stopping(max_new_tokens=20))
    drafter = Stubborn()
    decode(s, engine.target_runner, drafter)
    assert s.output == ar.tokens and drafter.finished
    lengths = [n for n, _, _ in drafter.seen]
    assert lengths[0] == len(ids) + 1 and all(b > a for a, b in zip(lengths, lengths[1:]))
    assert all(drafted <= 5 and accepted <= 3 for _, drafted, accepted in drafter.seen)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_lengthened_drafter_stays_exact_and_uses_its_suffixes(tiny, arch):
    """The combinator around prompt lookup: pool phrases lengthen each looked-up chain; output = AR."""
    from draftverify.drafters.lengthened import Lengthened
    from draftverify.drafters.lookahead import ngrams
    from draftverify.drafters.pool import PhrasePool

    engine = Engine(tiny(arch))
    ids = engine.encode(REPEATS[0])
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
    pool = PhrasePool(3, 2)
    pool.insert_all(ngrams(ids + ar.tokens, 3))  # phrases the target will confirm
    s = Session(ids, Sampling(), Stopping(max_new_tokens=30))
    decode(s, engine.target_runner, Lengthened(PromptLookup(PromptLookupConfig(k=2)), pool, K=2))
    assert s.output == ar.tokens
    assert max(s.stats.steps) > 3  # a round accepted more than the 2-token chain: a suffix ran on


LAYERS = [  # docs/architecture.md, lowest first: a module imports from its own layer and those before it
    {"util", "errors", "cli_options", "prompt_files", "machine"},
    {"session", "detokenize", "stats", "sampling", "logits", "constraints", "prefix_cache"},
    {"kernels", "backend", "loading", "models", "costs", "feature_head", "feature_head_cache", "arithmetic"},
    {"verify", "tree", "step"},
    {"drafters", "policies"},  # drafters/ holds the per-method helpers: pool, skipsets, head
    {"round", "batch", "methods", "engine"},
    {"bench", "serve"},
    {"tools"},  # the offline tools: make_draft, search_layers, train_head, pareto
    {"cli", "demo", "__main__", ""},
]


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    found = [i for i, names in enumerate(LAYERS) if top in names]
    assert found, f"{module} is in no layer of docs/architecture.md: add it there and to LAYERS"
    return found[0]


def test_the_package_has_no_import_cycle_and_no_upward_import():
    root = Path(__import__("draftverify").__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftverify"):
                deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("draftverify")}
        graph[name] = deps
    edges = {m: {d for d in deps if d in graph and d != m and not m.startswith(d + ".")} for m, deps in graph.items()}
    upward = [(m, d) for m, deps in edges.items() for d in deps if layer_of(d) > layer_of(m)]
    assert not upward, f"imports against the layers of docs/architecture.md: {upward}"
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for d in edges[m]:
            assert state.get(d) != 1, "import cycle: " + " -> ".join(stack + [m, d])
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [])
