"""Shared by the lookahead and Ouroboros sampling tests: the exact law of the first three new
tokens of a tiny model with a 4-token vocabulary, a pool of guesses for every token, and a
chi-square check.

The 1st token comes from the prefill; the 2nd and 3rd are the first to go through
verification, as drafted or guessed candidates, corrections or bonus tokens. Their joint law
(64 cells) shows both whether guesses are accepted too often and whether what follows them is
right.
"""

from __future__ import annotations

from collections import Counter
from itertools import product

import numpy as np
import torch
from scipy.stats import chisquare

from draftverify.drafters.pool import PhrasePool
from draftverify.sampling import Sampling

VOCAB = 4
PROMPT = [1, 2, 3]
SAMPLING = Sampling(temperature=1.0)
SAMPLES = 800


def exact_first_three(model) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) = p(t1) p(t2 | t1) p(t3 | t1, t2) after PROMPT."""
    law = {}
    with torch.no_grad():
        for t1, t2, t3 in product(range(VOCAB), repeat=3):
            logits = model(torch.tensor([PROMPT + [t1, t2]])).logits[0, -3:]  # after PROMPT, t1, t2
            p = SAMPLING.probs(logits).double()
            law[t1, t2, t3] = (p[0, t1] * p[1, t2] * p[2, t3]).item()
    return law


def guess_pool(n: int, cap: int) -> PhrasePool:
    """For every token v, `cap` guesses of n - 1 tokens starting with distinct tokens other than v."""
    pool = PhrasePool(n, cap)
    for v in range(VOCAB):
        for g in range(cap):
            pool.insert([v] + [(v + g + 1) % VOCAB] + [(v + 2 * g + j) % VOCAB for j in range(n - 2)])
    return pool


def sample_first_three(engine, method: str, pool: PhrasePool, samples: int = SAMPLES, **options) -> Counter:
    engine.method(method, **options).pool = pool  # reuse=True keeps it (and it keeps learning)
    counts = Counter()
    for seed in range(samples):
        out = engine.generate(
            PROMPT, method=method, max_new_tokens=4, temperature=1.0, seed=seed, eos_token_id=[], **options
        )
        counts[tuple(out.tokens[:3])] += 1
    return counts


def pvalue(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of the observed triples against the exact law (cells expecting < 5 lumped)."""
    n = sum(counts.values())
    big = [cell for cell, prob in exact.items() if prob * n >= 5]
    observed = [counts[cell] for cell in big] + [n - sum(counts[cell] for cell in big)]
    expected = [exact[cell] * n for cell in big] + [n * (1 - sum(exact[cell] for cell in big))]
    return chisquare(np.array(observed), np.array(expected) / sum(expected) * n).pvalue


def second_token_law(model, prompt: list[int], sampling: Sampling) -> torch.Tensor:
    """The exact law of the second new token after `prompt` (fp64 [V]): sum over x1 of p(x1) p(x2 | x1)."""
    with torch.inference_mode():
        p1 = sampling.probs(model(torch.tensor([prompt])).logits[0, -1]).double()
        p2 = torch.zeros_like(p1)
        for x1 in p1.nonzero().flatten().tolist():
            p2 += p1[x1] * sampling.probs(model(torch.tensor([prompt + [x1]])).logits[0, -1]).double()
    return p2


def second_token_pvalue(model, prompt: list[int], sampling: Sampling, counts: dict[int, int]) -> float:
    """Chi-square p-value of observed second new tokens against their exact law after `prompt`
    (`second_token_law`), the first token coming from the prefill."""
    p2 = second_token_law(model, prompt, sampling)
    support = (p2 > 0).nonzero().flatten().tolist()
    assert set(counts) <= set(support), "a token the target cannot produce was produced"
    n = sum(counts.values())
    expected = p2[support].numpy() / p2[support].sum().item() * n
    return chisquare(np.array([counts.get(t, 0) for t in support]), expected).pvalue


def broken_rule(monkeypatch) -> None:
    """The classic bug: after a rejection keep drawing from p (guess not removed, no residual)."""
    import draftverify.verify

    monkeypatch.setattr(draftverify.verify, "_normalise", lambda dist, fallback: fallback)
