"""The cost-aware draft length: it reads the measured cost curve and the acceptance seen so far."""

from __future__ import annotations

import pytest
import torch

from draftverify import Engine
from draftverify.policies import CostAware

FLAT = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.6}  # a static-path-like curve: verifying 8 costs 1.2 forwards
STEEP = {1: 1.0, 2: 1.8, 4: 3.4, 8: 6.6, 16: 13.0}  # verification costs as much as decoding


def rounds(policy: CostAware, drafted: int, accepted: int, n: int = 20) -> None:
    for _ in range(n):
        policy.observe(drafted, accepted)


def test_a_good_cheap_draft_drafts_long():
    policy = CostAware(FLAT, {1: 0.02}, max_k=8)
    rounds(policy, 8, 8)
    assert policy.alpha > 0.9 and policy.max_length() == 8


def test_nothing_pays_then_no_draft_but_a_probe_every_few_rounds():
    policy = CostAware(STEEP, {1: 0.4}, max_k=8, probe=4)
    rounds(policy, 2, 0)
    lengths = [policy.max_length() for _ in range(8)]
    assert lengths == [0, 0, 0, 1, 0, 0, 0, 1]
    assert policy.max_length() == 0 and not policy.keep_drafting(0, torch.zeros(3), None)


def test_the_length_follows_the_acceptance():
    policy = CostAware(FLAT, {1: 0.1}, max_k=8)
    rounds(policy, 4, 1)
    low = policy.max_length()
    rounds(policy, 4, 4, n=40)
    assert 1 <= low < policy.max_length()


def test_a_steeper_curve_drafts_less():
    assert (
        CostAware(STEEP, {1: 0.1}, accepted=3, rejections=1).best()
        < CostAware(FLAT, {1: 0.1}, accepted=3, rejections=1).best()
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_default_cost_policy_is_lossless(tiny, arch):
    engine = Engine(tiny(arch), tiny(arch, seed=1, layers=2))
    ids = engine.encode("Hello there, how are")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=40, eos_token_id=[]).tokens
    out = engine.generate(ids, method="speculative", max_new_tokens=40, eos_token_id=[])
    assert out.tokens == ar and engine.method("speculative").config.policy == "cost"


def test_the_cost_curve_grows_with_the_context_wider_forwards_the_more():
    from draftverify.costs import Curve, at_context, context_slope, forward_time

    near = {1: 1.0, 4: 1.1, 16: 1.6}
    far = {1: 1.05, 4: 1.5, 16: 3.0}  # measured 1,000 tokens later
    slope = context_slope(near, far, 1000)
    assert all(s >= 0 for s in slope.values()) and slope[1] < slope[4] < slope[16]
    curve = Curve(near, 64, slope)
    assert at_context(curve, 64) == near and at_context(curve, 10) == near  # no shorter than measured
    long = at_context(curve, 1064)
    assert forward_time(long, 16) / forward_time(long, 1) > forward_time(near, 16) / forward_time(near, 1)
    assert abs(long[16] - far[16]) < 0.2 and at_context(FLAT, 5000) is FLAT  # a plain table has no context
    assert context_slope(near, {1: 0.9, 4: 1.0, 16: 1.5}, 1000) == {1: 0.0, 4: 0.0, 16: 0.0}  # never negative
    # a policy priced at a long context drafts shorter than at a short one
    policy = CostAware(Curve(FLAT, 64, context_slope(FLAT, STEEP, 1000)), {1: 0.05}, accepted=3, rejections=1)
    short = policy.best()
    policy.start_round(2064)
    assert policy.best() < short


def test_a_drafting_runners_cost_curve_is_timed_on_a_drafting_runner(tiny, monkeypatch):
    """A separate draft model's runner (`draft=True`) forwards on rounded copies of its weights: its curve, the one its
    cost-aware policy prices drafts with, is timed on such a runner too (timed on the target's kind, a draft model's
    curve read about twice its real cost on the default model), and kept apart from the same model's target curve."""
    from draftverify import costs
    from draftverify.models import Runner

    made, fork = [], Runner.fork
    monkeypatch.setattr(Runner, "fork", lambda self: made.append((timed := fork(self)).draft) or timed)
    model = tiny("llama").model
    drafting = costs.curve(Runner(model, "static", draft=True), all_logits=False, widths=(1, 2))
    assert made and all(made)
    made.clear()
    assert (
        costs.curve(Runner(model, "static"), all_logits=False, widths=(1, 2)) is not drafting and made and not any(made)
    )


@pytest.mark.parametrize("others", [0, 3])
def test_marginal_times_reads_a_table_as_marginal_time_does(others):
    from draftverify.costs import Curve, Table, at_context, marginal_time, marginal_times

    plain = {16: 1.6, 1: 1.0, 4: 1.1, 2: 1.0}  # any order; a dip that the batch floor catches
    curve = Curve(plain, 64, {1: 0.001, 2: 0.001, 4: 0.002, 16: 0.004})
    for table in (plain, Table(plain), curve, at_context(curve, 500)):
        assert marginal_times(table, 40, others) == [
            marginal_time(plain if table is plain else dict(table), w, others) for w in range(1, 41)
        ]
    assert isinstance(at_context(curve, 500), Table) and at_context(curve, 500).points == sorted(
        at_context(curve, 500).items()
    )
