"""FR-Spec draft vocabularies (`Method.draft_vocab`) for a draft model and a layer-skip draft: drafts stay inside
the vocabulary, greedy output is autoregressive decoding's, and sampling keeps the target's law."""

from __future__ import annotations

import pytest
import torch
from acceptance_heads import (
    random_head,
)
from phrase_sampling import broken_rule

from draftverify import Engine
from draftverify.sampling import Sampling


@pytest.mark.parametrize("method", ["specdec-pp", "speculative", "self-speculative"])
def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_exact(tiny, tmp_path, monkeypatch, method):
    """FR-Spec for a draft model and a layer-skip draft (`Method.draft_vocab`): every drafted token is one of the
    vocabulary's, and the output is still autoregressive decoding's, greedy."""
    from draftverify.drafters.draft_model import DraftModel
    from draftverify.methods.base import Method

    target, draft = tiny("llama", seed=0), tiny("llama", seed=0, layers=2)
    vocab = torch.arange(0, target.model.config.vocab_size, 2)  # every even token id
    monkeypatch.setattr(Method, "draft_vocab", lambda self, n: vocab[:n] if n else None)
    drafted, chain = [], DraftModel.chain

    def spy(self, s, feed, k):
        out = chain(self, s, feed, k)
        drafted.extend(out[0])
        return out

    monkeypatch.setattr(DraftModel, "chain", spy)
    path = random_head(tmp_path / "head.safetensors", target, draft)
    engine = Engine(target, draft, backend="static")
    options = {
        "specdec-pp": {"head": str(path), "h": 0.9},
        "speculative": {"policy": "constant", "k": 4},
        "self-speculative": {"strategy": "heuristic", "vocab": 16},  # its default drafts from the whole head
    }[method]
    for prompt in ["Hello there, how", "def f(x):\n    return"]:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=24, eos_token_id=[])
        out = engine.generate(ids, method=method, max_new_tokens=24, eos_token_id=[], **options)
        assert out.tokens == ar.tokens, (method, prompt)
    assert drafted and all(t % 2 == 0 for t in drafted), method


def test_drafting_from_a_vocabulary_samples_the_target_distribution(tiny, monkeypatch):
    """Sampling from a draft vocabulary (q is zero outside it) stays exact: the second token, the first verified,
    follows the target's law; the classic wrong rule (resample from p after a rejection) is caught."""
    from phrase_sampling import second_token_pvalue as law_pvalue

    from draftverify.methods.base import Method

    target = tiny("llama", seed=0, layers=2, hidden=32)
    draft = tiny("llama", seed=3, layers=1, hidden=32)
    vocab = torch.arange(0, target.model.config.vocab_size, 2)  # every even token id
    monkeypatch.setattr(Method, "draft_vocab", lambda self, n: vocab[:n] if n else None)
    engine, prompt, sampling = Engine(target, draft), [5, 6, 7], Sampling(temperature=1.0, top_k=8)

    def pvalue(n: int) -> float:
        counts: dict[int, int] = {}
        for seed in range(n):
            out = engine.generate(
                prompt, method="speculative", max_new_tokens=3, temperature=1.0, top_k=8, seed=seed,
                eos_token_id=[], policy="constant", k=2,
            )  # fmt: skip
            counts[out.tokens[1]] = counts.get(out.tokens[1], 0) + 1
        return law_pvalue(target.model, prompt, sampling, counts)

    assert pvalue(2000) > 1e-3
    broken_rule(monkeypatch)
    assert pvalue(2000) < 1e-4
