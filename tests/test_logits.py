"""Penalties, logit_bias, min_p and logprobs: exact under every method.

Greedy output with each knob equals a hand-written autoregressive loop over the full model (the
reference) and every method's output; sampled output follows the processed target distribution
(chi-square), and the unprocessed distribution is rejected (the negative control)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftverify import Engine
from draftverify.errors import DraftVerifyError
from draftverify.logits import Penalties, Processor

METHODS = [
    ("speculative", {"k": 3}),
    ("lookahead", {}),
    ("ouroboros", {}),
    ("prompt-lookup", {}),
    ("self-speculative", {"strategy": "heuristic"}),
    ("auto", {}),
]
KNOBS = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7},
    {"logit_bias": {"5": 8.0, "7": -100}},
    {"presence_penalty": -1.0, "frequency_penalty": 1.0, "logit_bias": {"12": 3.0}},
]
PROMPT = "1, 2, 3, 1, 2, 3, 1, 2,"


def reference(model, ids: list[int], n: int, knobs: dict) -> list[int]:
    """Autoregressive decoding, the whole sequence re-run per token, the knobs applied by hand."""
    out: list[int] = []
    bias = {int(k): v for k, v in (knobs.get("logit_bias") or {}).items()}
    for _ in range(n):
        logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
        logits = logits - knobs.get("frequency_penalty", 0) * counts - knobs.get("presence_penalty", 0) * (counts > 0)
        for token, value in bias.items():
            logits[token] += value
        out.append(int(logits.argmax()))
    return out


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny("llama"), tiny("llama", seed=1, layers=2))


@pytest.mark.parametrize("knobs", KNOBS)
def test_greedy_knobs_equal_reference_under_every_method(engine, knobs):
    ids = engine.encode(PROMPT)
    ref = reference(engine.target.model, ids, 24, knobs)
    plain = engine.generate(ids, method="autoregressive", max_new_tokens=24, eos_token_id=[])
    assert plain.tokens != ref, "the knob changes nothing here: the test could not fail"
    for method, options in METHODS:
        out = engine.generate(ids, method=method, max_new_tokens=24, eos_token_id=[], **knobs, **options)
        assert out.tokens == ref, (method, knobs)


def test_min_p_is_off_when_greedy_and_cuts_when_sampling(engine):
    ids = engine.encode(PROMPT)
    plain = engine.generate(ids, method="autoregressive", max_new_tokens=12, eos_token_id=[])
    assert engine.generate(ids, method="speculative", max_new_tokens=12, eos_token_id=[], min_p=0.5).tokens == (
        plain.tokens
    )
    from draftverify.sampling import Sampling

    logits = torch.tensor([0.0, -0.1, -3.0, -5.0])
    probs = Sampling(temperature=1.0, min_p=0.5).probs(logits)
    assert probs[2] == 0 and probs[3] == 0 and probs[0] > probs[1] > 0


@pytest.mark.parametrize("method,options", METHODS)
def test_logprobs_equal_autoregressive(engine, method, options):
    ids = engine.encode(PROMPT)
    knobs = {"top_logprobs": 5, "presence_penalty": 0.5}
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=20, eos_token_id=[], **knobs)
    out = engine.generate(ids, method=method, max_new_tokens=20, eos_token_id=[], **knobs, **options)
    assert out.tokens == ar.tokens and len(out.logprobs) == len(out.tokens) == 20
    for a, b in zip(ar.logprobs, out.logprobs):
        assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert (
            abs(a.logprob - b.logprob) < 1e-4 and a.top[0][1] >= a.logprob
        )  # plain fp32 weights: oneDNN rounds by row count
    # the greedy token is the likeliest of its processed distribution
    assert all(lp.top[0][0] == lp.token for lp in ar.logprobs)


def test_logprobs_are_the_processed_distribution(engine):
    ids = engine.encode(PROMPT)
    out = engine.generate(ids, method="autoregressive", max_new_tokens=1, top_logprobs=3, logit_bias={"9": 100})
    assert out.tokens == [9] and out.logprobs[0].token == 9 and out.logprobs[0].logprob > -1e-3


def test_bad_knobs_are_one_line_errors(engine):
    with pytest.raises(DraftVerifyError, match="presence_penalty=3"):
        engine.generate("Hi", presence_penalty=3)
    with pytest.raises(DraftVerifyError, match="logit_bias"):
        engine.generate("Hi", logit_bias={"x": 1})
    with pytest.raises(DraftVerifyError, match="min_p"):
        engine.generate("Hi", min_p=2)
    with pytest.raises(DraftVerifyError, match="top_logprobs"):
        engine.generate("Hi", top_logprobs=50)


def test_tree_rows_count_each_nodes_own_path():
    proc = Processor(Penalties(presence=1.0, frequency=0.5))
    logits = torch.zeros(4, 6)
    # trie: root(3) -> 4 -> 4 ; root -> 5
    out = proc.tree([3], [3, 4, 4, 5], [-1, 0, 1, 0], logits)
    assert out[0].tolist() == [0, 0, 0, -1.5, 0, 0]
    assert out[2].tolist() == [0, 0, 0, -1.5, -2.0, 0]
    assert out[3].tolist() == [0, 0, 0, -1.5, 0, -1.5]


N = 2000


def test_sampling_follows_processed_distribution(engine):
    """The second token (the first one verified) over N seeded requests, against its exact marginal
    sum_f P(f) p(x | f) under the processed distributions; the negative control processes the first
    token only, as a verifier that ignored the processing would."""
    ids = engine.encode("ab")
    proc = Processor(Penalties(2.0, 0.0, ((40, 2.0),)))
    counts = np.zeros(engine.target.model.config.vocab_size)
    for seed in range(N):
        out = engine.generate(
            ids, method="speculative", k=3, max_new_tokens=2, eos_token_id=[], temperature=1.0, seed=seed,
            presence_penalty=2.0, logit_bias={"40": 2.0},
        )  # fmt: skip
        counts[out.tokens[1]] += 1
    v = counts.shape[0]
    with torch.no_grad():
        first = proc.rows([], [[]], engine.target.model(torch.tensor([ids])).logits[0, -1:])[0].softmax(-1)  # [V]
        seqs = torch.tensor([ids + [f] for f in range(v)])
        raw = engine.target.model(seqs).logits[:, -1].float()  # [V, V]: row f after the first token f
    processed = torch.stack([proc.rows([f], [[]], raw[f : f + 1])[0] for f in range(v)])
    exact = (first[:, None] * processed.softmax(-1)).sum(0).double().numpy()
    ignored = (first[:, None] * raw.softmax(-1)).sum(0).double().numpy()
    for dist, right in ((exact, True), (ignored, False)):
        keep = dist * N >= 5  # chi-square wants at least 5 expected a cell: the rest pooled
        obs, exp = counts[keep], dist[keep] * N
        if not keep.all():
            obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, dist[~keep].sum() * N)
        pvalue = chisquare(obs, exp / exp.sum() * obs.sum()).pvalue
        assert (pvalue > 1e-3) if right else (pvalue < 1e-6), (right, pvalue)
