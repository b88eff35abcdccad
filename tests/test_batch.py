"""Batched decoding: one stacked forward for several requests, each exactly what it gives alone."""

from __future__ import annotations

import pytest
import torch
from test_feature_head import random_head

from draftverify import Engine
from draftverify.backend import Feed
from draftverify.batch import Batch
from draftverify.loading import truncated_copy
from draftverify.models import Runner, forward_many

PROMPTS = ["abc abc abc abc", "hello world, hello", "x", "the cat sat on the mat, the cat"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stacked_forward_equals_separate_forwards(tiny, arch):
    model = tiny(arch).model
    alone, stacked = [Runner(model, "static") for _ in range(3)], [Runner(model, "static") for _ in range(3)]
    prompts = [[5, 9, 14, 22, 7], [3, 4], [8, 8, 8, 8, 8, 8, 8, 8, 8]]
    for group in (alone, stacked):
        for r, p in zip(group, prompts):
            r.forward(p)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    feeds = [
        {"tokens": [11], "hidden": True},
        {
            "tokens": [12, 13, 14, 15],
            "positions": torch.tensor([2, 3, 3, 4]),
            "tree_mask": tree,
            "last": 3,
            "hidden": "all",
        },
        {"tokens": [16, 17, 18]},
    ]
    want = [r.forward(**f) for r, f in zip(alone, feeds)]
    got = forward_many(stacked, [Feed(**f) for f in feeds])
    for w, g, a, b in zip(want, got, alone, stacked):
        assert torch.allclose(w.logits, g.logits, atol=1e-4) and a.length == b.length
        assert (w.hidden is None) == (g.hidden is None) and (
            w.hidden is None or torch.allclose(w.hidden, g.hidden, atol=1e-4)
        )
        for (ka, va), (kb, vb) in zip(a.cached_kv(), b.cached_kv()):
            assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)


@pytest.mark.parametrize("backend", ["static", "eager"])
def test_batched_generation_equals_each_request_alone(tiny, backend):
    target = tiny("llama", layers=2)
    engine = Engine(target, truncated_copy(target, 1), backend=backend, feature_head=random_head(target, seed=2))
    for method, options in [
        ("autoregressive", {}),
        ("auto", {"use": "head+draft+context+lookup", "probe": 1}),
        ("speculative", {}),
        ("lookahead", {"preset": "context"}),
        ("self-speculative", {"strategy": "heuristic"}),
    ]:
        alone = [
            engine.generate(p, method=method, max_new_tokens=24, eos_token_id=[], chat=True, **options) for p in PROMPTS
        ]
        together = engine.generate_batch(
            PROMPTS, method=method, max_new_tokens=24, eos_token_id=[], chat=True, **options
        )
        assert [r.tokens for r in together] == [r.tokens for r in alone], (backend, method)
        assert all(r.stats.new_tokens == 24 and r.stats.wall_s > 0 for r in together)


def test_sampled_requests_keep_their_own_seeds(tiny):
    engine = Engine(tiny("llama", layers=2))
    kwargs = {"method": "autoregressive", "max_new_tokens": 16, "eos_token_id": [], "temperature": 1.0, "seed": 7}
    alone = [engine.generate(p, **kwargs).tokens for p in PROMPTS]
    assert [r.tokens for r in engine.generate_batch(PROMPTS, **kwargs)] == alone


def test_requests_join_and_leave_between_steps(tiny):
    """Continuous batching: a request that joins mid-way, one that stops early and one dropped by its client."""
    target = tiny("llama", layers=2)
    engine = Engine(target, feature_head=random_head(target, seed=2))
    want = [
        engine.generate(p, method="auto", max_new_tokens=n, eos_token_id=[]).tokens
        for p, n in zip(PROMPTS, (30, 5, 30, 30))
    ]
    batch, members = Batch(), {}

    def join(i: int, n: int):
        m, session = engine.request(PROMPTS[i], "auto", max_new_tokens=n, eos_token_id=[], slot=i)
        session.stats.start()
        members[i] = batch.add(session, m.target, m.rounds(session))

    join(0, 30)
    join(1, 5)
    for _ in range(3):
        batch.step()
    join(2, 30)
    join(3, 30)
    batch.step()
    batch.drop(members[3])
    while len(batch):
        batch.step()
    assert [members[i].session.output for i in range(3)] == want[:3]
    assert (
        members[3].session.output == want[3][: len(members[3].session.output)] and len(members[3].session.output) < 30
    )
