"""Self-speculative decoding (Draft & Verify): greedy equivalence, exact sampling, the cache
invariant during decoding, the adaptive draft-exit rule, options and presets."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS
from phrase_sampling import broken_rule, second_token_pvalue

from draftverify import Engine
from draftverify.drafters.skipsets import SkipSet, save_skip_set
from draftverify.errors import DraftVerifyError
from draftverify.models import Runner
from draftverify.policies import POLICIES, AdaptiveThreshold, make_policy
from draftverify.sampling import Sampling

PROMPTS = ["Hello there, how", "def f(x):\n    return", "1, 2, 3, 4,"]
SKIPS = [SkipSet((0,), (1,)), SkipSet((1, 2), ()), SkipSet((), (0, 3)), SkipSet((0, 1, 2, 3), (0, 1, 2, 3)), SkipSet()]
OPTIONS = [{}, {"policy": "constant", "k": 3}, {"policy": "confidence", "gamma": 0.3, "k": 6}, {"k": 1}]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_autoregressive(tiny, arch):
    engine = Engine(tiny(arch))
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[])
        for skip in SKIPS:
            for options in OPTIONS:
                r = engine.generate(
                    ids, method="self-speculative", skip=skip, max_new_tokens=30, eos_token_id=[], **options
                )
                assert r.tokens == ar.tokens, (arch, prompt, skip, options)
                s = r.stats
                assert (
                    s.draft_forwards == s.drafted and s.accepted <= s.drafted and s.target_forwards == len(s.steps) + 1
                )
    none = engine.generate(ids, method="self-speculative", strategy="none", max_new_tokens=30, eos_token_id=[])
    assert none.stats.acceptance_rate == 1.0  # skipping nothing drafts the target's own tokens


@pytest.mark.parametrize("arch,backend", [("llama", "eager"), ("llama", "static"), ("gpt_neox", "eager")])
def test_cache_matches_a_plain_forward_at_every_step(tiny, arch, backend):
    """Whenever tokens are emitted, every layer holds K/V for exactly prompt + output[:-1], equal to a
    plain forward of those tokens, although drafting skipped layer 0's attention."""
    target = tiny(arch)
    engine = Engine(target, backend=backend)
    ids = engine.encode(PROMPTS[0])
    skip = SkipSet((0, 2), (1,))
    method = engine.method("self-speculative", skip=skip, k=4)
    emitted: list[int] = []

    def check(chunk):
        emitted.extend(chunk)
        plain = Runner(target.model, backend)
        plain.forward((ids + emitted)[:-1])
        for (keys, values), (ref_keys, ref_values) in zip(method.target.cached_kv(), plain.cached_kv(), strict=True):
            assert keys.shape == ref_keys.shape
            assert torch.allclose(keys, ref_keys, atol=1e-4) and torch.allclose(values, ref_values, atol=1e-4)

    r = engine.generate(
        ids, method="self-speculative", skip=skip, k=4, max_new_tokens=20, eos_token_id=[], on_tokens=check
    )
    assert emitted == r.tokens and len(r.stats.steps) >= 3 and r.stats.drafted > 0


def second_token_counts(engine, prompt, sampling, n, **options):
    counts: dict[int, int] = {}
    for seed in range(n):
        # 3 tokens: the prefill gives the 1st, one draft is verified for the 2nd (with 2 the round could draft nothing)
        r = engine.generate(
            prompt,
            method="self-speculative",
            max_new_tokens=3,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            seed=seed,
            eos_token_id=[],
            **options,
        )
        counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
    return counts


def test_sampling_matches_the_target_distribution_and_a_wrong_rule_fails(tiny, monkeypatch):
    """The second token (the first that goes through verification) follows the target's exact
    marginal sum_x1 p(x1) p(x2 | x1); the same harness rejects a broken acceptance rule."""
    target = tiny("llama", seed=0, layers=2, hidden=32)
    engine = Engine(target)
    prompt, sampling, n = [5, 6, 7], Sampling(temperature=1.0, top_k=8), 1500
    options = {"skip": SkipSet((0,), (1,)), "policy": "constant", "k": 1}

    def pvalue(counts):
        return second_token_pvalue(target.model, prompt, sampling, counts)

    exact = second_token_counts(engine, prompt, sampling, n, **options)
    assert pvalue(exact) > 1e-3
    broken_rule(monkeypatch)  # on rejection, resample from p instead of the residual norm(max(p - q, 0))
    wrong = second_token_counts(engine, prompt, sampling, n, **options)
    assert pvalue(wrong) < 1e-6


def test_seeded_sampling_is_reproducible(tiny):
    engine = Engine(tiny("qwen2"))
    runs = [
        engine.generate(
            "Hello",
            method="self-speculative",
            skip=SkipSet((1,), (2,)),
            max_new_tokens=25,
            temperature=0.8,
            top_p=0.9,
            seed=7,
            eos_token_id=[],
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_adaptive_threshold_follows_the_paper_update_rule():
    """Eqs. 2-4 by hand: alpha = 0.8, gamma_0 = 0.6, epsilon = 0.01, beta1 = 0.5, beta2 = 0.9."""
    policy = AdaptiveThreshold(gamma=0.6, alpha=0.8, epsilon=0.01, beta1=0.5, beta2=0.9, max_k=12)
    script = [  # (drafted, accepted) -> (AR, gamma) after the update
        ((5, 4), (0.8, 0.9 * 0.6 + 0.1 * 0.61)),  # e = 1: AR = AR_1 = 0.8 <= alpha -> gamma~ = gamma + eps
        ((2, 2), (0.9, None)),  # AR = 0.5 * 0.8 + 0.5 * 1.0 = 0.9 > alpha -> gamma~ = gamma - eps
        ((4, 0), (0.45, None)),  # AR = 0.45 -> up
        ((0, 0), (0.45, None)),  # nothing drafted: no update
        ((3, 3), (0.725, None)),  # AR = 0.725 -> up
    ]
    gamma = 0.6
    for (drafted, accepted), (ar, expected_gamma) in script:
        if drafted:
            gamma_tilde = gamma + 0.01 if ar <= 0.8 else gamma - 0.01
            gamma = 0.9 * gamma + 0.1 * gamma_tilde
        policy.observe(drafted, accepted)
        assert policy.ar == pytest.approx(ar)
        assert policy.gamma == pytest.approx(gamma)
        if expected_gamma is not None:
            assert policy.gamma == pytest.approx(expected_gamma)
    assert policy.gamma == pytest.approx(0.6 + 0.001 - 0.001 + 0.001 + 0.001)


def test_adaptive_threshold_stops_on_low_confidence_and_at_k():
    policy = AdaptiveThreshold(gamma=0.5, max_k=3)
    sure, unsure = torch.tensor([10.0, 0.0, 0.0]), torch.tensor([0.1, 0.0, 0.0])
    assert policy.keep_drafting(1, sure, None) and not policy.keep_drafting(1, unsure, None)
    assert not policy.keep_drafting(3, sure, None)
    assert POLICIES["adaptive"] is AdaptiveThreshold
    assert make_policy("adaptive", 7, 0.4) == AdaptiveThreshold(gamma=0.4, max_k=7)
    with pytest.raises(DraftVerifyError, match="alpha"):
        AdaptiveThreshold(alpha=1.5)


def test_fixed_k_and_static_threshold_variants(tiny):
    engine = Engine(tiny("llama"))
    ids = engine.encode(PROMPTS[1])
    skip = SkipSet((), (3,))
    fixed = engine.generate(
        ids, method="self-speculative", preset="k4", skip=skip, max_new_tokens=41, eos_token_id=[]
    ).stats
    rounds = len(fixed.steps)
    assert 4 * (rounds - 1) <= fixed.drafted <= 4 * rounds  # every round drafts K = 4 but the last one (as many as fit)
    never = engine.generate(
        ids, method="self-speculative", policy="confidence", gamma=1.0, skip=skip, max_new_tokens=20, eos_token_id=[]
    ).stats
    assert (
        len(never.steps) - 1 <= never.drafted <= len(never.steps)
    )  # a threshold of 1 stops after every first draft token (the last round may have no room)
    adaptive = engine.generate(ids, method="self-speculative", skip=skip, max_new_tokens=20, eos_token_id=[]).stats
    assert 0 < adaptive.extra["final_gamma"] < 1 and adaptive.extra["skipped_mlp"] == 1


def test_skip_file_option_and_refusal_on_another_model(tiny, tmp_path):
    a, b = tiny("llama", seed=0), tiny("llama", seed=1)
    path = save_skip_set(tmp_path / "skip.json", SkipSet((1,), (2,)), a.identity)
    method = Engine(a).method("self-speculative", skip_file=str(path))
    assert method.skip == SkipSet((1,), (2,))
    assert Engine(a).method("self-speculative", preset="first", skip_file=str(path)).skip == SkipSet((0,), (0,))
    with pytest.raises(DraftVerifyError, match="made for another model"):
        Engine(b).method("self-speculative", skip_file=str(path))
    with pytest.raises(DraftVerifyError, match="no skip set for .*build-drafts"):
        Engine(a).method("self-speculative")
    with pytest.raises(DraftVerifyError, match="unknown skip strategy"):
        Engine(a).method("self-speculative", strategy="best")
    with pytest.raises(DraftVerifyError, match="unknown draft policy"):
        Engine(a).method("self-speculative", policy="never")


@pytest.mark.slow
def test_default_model_uses_the_shipped_skip_set(smollm):
    engine = Engine(smollm)
    method = engine.method("self-speculative")
    assert method.skip.size > 0
    ids = engine.encode("Name three colours.", chat=True)
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=16)
    r = engine.generate(ids, method="self-speculative", max_new_tokens=16)
    assert r.tokens == ar.tokens and r.stats.drafted > 0
