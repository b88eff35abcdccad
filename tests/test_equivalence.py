"""Greedy output of every draft-model method equals autoregressive decoding and transformers' own
`generate(do_sample=False)` on tiny random models of several architectures."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS

from draftverify import Engine

PROMPTS = ["Hello there, how", "def f(x):\n    return", "1, 2, 3, 4,"]


def hf_greedy(model, ids, n):
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft_kind", ["random", "self", "truncated"])
def test_speculative_greedy_equals_autoregressive(tiny, arch, draft_kind):
    target = tiny(arch, seed=0)
    if draft_kind == "random":
        draft = tiny(arch, seed=1, layers=2)
    elif draft_kind == "self":
        draft = target
    else:
        from draftverify.loading import truncated_copy

        draft = truncated_copy(target, 2)
    engine = Engine(target, draft)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[])
        assert ar.tokens == hf_greedy(target.model, ids, 40)
        for options in (
            {"k": 1},
            {"policy": "constant", "k": 4},
            {"k": 4},
            {"policy": "heuristic"},
            {"policy": "confidence", "threshold": 0.3},
        ):
            spec = engine.generate(ids, method="speculative", max_new_tokens=40, eos_token_id=[], **options)
            assert spec.tokens == ar.tokens, (arch, draft_kind, prompt, options)
    if draft_kind == "self":
        assert spec.stats.acceptance_rate == 1.0


def test_stats_are_consistent(tiny):
    target = tiny("llama")
    engine = Engine(target, tiny("llama", seed=1, layers=2))
    r = engine.generate("Hello", method="speculative", max_new_tokens=30, eos_token_id=[], policy="constant", k=3)
    s = r.stats
    assert s.new_tokens == len(r.tokens) == 30
    assert sum(s.steps) + 1 >= s.new_tokens  # the first token comes from the prefill
    assert s.accepted <= s.drafted
    assert s.target_forwards == len(s.steps) + 1
    assert s.draft_s > 0 and s.verify_s > 0 and s.wall_s >= s.draft_s + s.verify_s
    ar = engine.generate("Hello", method="autoregressive", max_new_tokens=30, eos_token_id=[]).stats
    assert ar.target_forwards == 30 and ar.accepted_per_forward == 1.0 and ar.acceptance_rate is None
