"""Speculative sampling reproduces the target's distribution (chi-square), and a wrong rule does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftverify.sampling import Sampling
from draftverify.verify import verify_chain, verify_tree

V = 6
P0 = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])  # target after the root
Q0 = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.05, 0.10])  # a draft that disagrees a lot
P1 = torch.tensor([0.10, 0.10, 0.50, 0.10, 0.10, 0.10])  # target after any first token (bonus position)


def first_tokens(n: int, rule, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V)
    p = torch.stack([P0, P1])
    q = Q0.unsqueeze(0)
    for _ in range(n):
        x = int(torch.multinomial(Q0, 1, generator=g).item())
        counts[rule(torch.tensor([x]), p, q, g)] += 1
    return counts


def exact_rule(draft, p, q, g):
    return verify_chain(9, draft, p, q, g, greedy=False).tokens[0]


def wrong_rule(draft, p, q, g):
    """A common bug: on rejection, resample from p instead of the residual max(p - q, 0)."""
    x = int(draft[0])
    if torch.rand((), generator=g) * q[0, x] <= p[0, x]:
        return x
    return int(torch.multinomial(p[0], 1, generator=g).item())


N = 20000


def test_speculative_sampling_matches_target():
    counts = first_tokens(N, exact_rule)
    assert chisquare(counts, P0.double().numpy() / P0.double().sum().item() * counts.sum()).pvalue > 1e-3


def test_wrong_rule_is_detected():
    counts = first_tokens(N, wrong_rule)
    assert chisquare(counts, P0.double().numpy() / P0.double().sum().item() * counts.sum()).pvalue < 1e-6


def test_multi_draft_deterministic_candidates_match_target():
    # root with three deterministic guesses (1, 3, 1 again) and one sampled child: first token ~ P0
    g = torch.Generator().manual_seed(1)
    counts = np.zeros(V)
    for _ in range(N):
        x = int(torch.multinomial(Q0, 1, generator=g).item())
        tokens = torch.tensor([9, 1, 3, x, 1])
        p = torch.stack([P0, P1, P1, P1, P1])
        q = torch.stack([Q0, Q0, Q0, Q0, Q0])
        sampled = [False, False, False, True, False]
        counts[verify_tree(tokens, [-1, 0, 0, 0, 0], p, q, sampled, g, greedy=False).tokens[0]] += 1
    assert chisquare(counts, P0.double().numpy() / P0.double().sum().item() * counts.sum()).pvalue > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_engine_sampling_matches_target_distribution(tiny, arch):
    """End to end on a tiny model: the second token (the first one that goes through verification)
    of speculative sampling follows the target's exact marginal sum_x1 p(x1) p(x2 | x1)."""
    from draftverify import Engine

    target = tiny(arch, seed=0, layers=2, hidden=32)
    engine = Engine(target, tiny(arch, seed=3, layers=1, hidden=32))
    prompt = [5, 6, 7]
    sampling = Sampling(temperature=1.0, top_k=8)
    p1 = sampling.probs(target.model(torch.tensor([prompt])).logits[0, -1]).double()
    p2 = torch.zeros_like(p1)
    for x1 in p1.nonzero().flatten().tolist():
        p2 += p1[x1] * sampling.probs(target.model(torch.tensor([prompt + [x1]])).logits[0, -1]).double()
    support = (p2 > 0).nonzero().flatten().tolist()
    n = 2000
    counts = dict.fromkeys(support, 0)
    for seed in range(n):
        r = engine.generate(
            prompt,
            method="speculative",
            max_new_tokens=3,
            temperature=1.0,
            top_k=8,
            seed=seed,
            eos_token_id=[],
            policy="constant",
            k=3,
        )
        counts[r.tokens[1]] += 1
    observed = np.array([counts[t] for t in support])
    expected = p2[support].numpy()
    assert chisquare(observed, expected / expected.sum() * n).pvalue > 1e-3


def test_sampling_processing():
    s = Sampling(temperature=1.0, top_k=2)
    probs = s.probs(torch.tensor([1.0, 3.0, 2.0, 0.0]))
    assert (probs > 0).tolist() == [False, True, True, False]
    s = Sampling(temperature=1.0, top_p=0.5)
    probs = s.probs(torch.tensor([0.0, 5.0, 0.0, 0.0]))
    assert (probs > 0).tolist() == [False, True, False, False]
    assert torch.allclose(Sampling(temperature=0.0).probs(torch.tensor([0.0, 1.0])), torch.tensor([0.0, 1.0]))


def test_top_p_keeps_the_smallest_likeliest_set_reaching_p_however_far_it_reaches():
    torch.manual_seed(0)
    # rows needing a few, hundreds and most of a 20k vocabulary in one call (the set is read from the top k, k growing)
    logits = torch.randn(3, 20000) * torch.tensor([[12.0], [2.5], [0.3]])
    for top_p in (0.3, 0.9, 0.999):
        probs = Sampling(temperature=1.0, top_p=top_p).probs(logits)
        p = logits.softmax(-1)
        for row, kept in zip(p, probs > 0):
            ranked = row.sort(descending=True).values
            n = int((ranked.cumsum(0) - ranked < top_p).sum())  # the smallest likeliest set with mass >= top_p
            assert int(kept.sum()) == n and bool((row[kept].min() >= row[~kept].max()) if n < len(row) else True)
        assert torch.allclose(probs.sum(-1), torch.ones(3))


def test_tiny_temperature_is_the_greedy_limit_not_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0, float("-inf")]])
    probs = Sampling(temperature=1e-40).probs(logits)
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
