"""The feature head's training data and loss: batched replies match `model.generate` (feature t gives token
t + 1), sampled replies join each shard and an older plan still fits, and bf16 training computes the fp32 loss."""

from __future__ import annotations

import json

import pytest
import torch
from test_feature_head import WORDS, quiet, random_head

from draftverify.errors import DraftVerifyError
from draftverify.models import Runner
from draftverify.tools.make_draft.feature_head import HeadTraining
from draftverify.tools.make_draft.feature_losses import head_losses
from draftverify.tools.make_draft.features import FeatureCache, FeaturePlan, generate


def test_bf16_training_computes_the_fp32_loss_and_gradients_closely(tiny):
    """`--train-dtype bf16` runs the matmuls in bf16 and keeps the norms, weights and loss in fp32: the same
    loss and gradient direction as fp32 to bf16's precision (not a different objective)."""
    target = tiny("llama", layers=2)
    head = random_head(target).train()
    torch.manual_seed(1)
    ids = torch.randint(0, target.model.config.vocab_size, (3, 20))
    feats = 4 * torch.randn(3, 19, target.model.config.hidden_size)
    args = (ids, feats, torch.tensor([20, 17, 12]), torch.tensor([4, 6, 2]), 3, 0.1)
    grads, losses = [], []
    for bf16 in (False, True):
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = head_losses(head, *args)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0) > 0.999
    with pytest.raises(DraftVerifyError, match="--train-dtype"):
        HeadTraining(train_dtype="fp16")


def test_batched_replies_match_model_generate_and_feature_t_gives_token_t_plus_1(tiny):
    target = tiny("llama", layers=2)
    prompts = [[1, 5, 9, 13], [2, 7], [3, 3, 8, 21, 4, 6]]
    runners = [Runner(target.model) for _ in prompts]
    assert runners[0].static is not None
    ours = generate(target, prompts, 12, runners=runners)
    stock = generate(target, prompts, 12)
    for a, b, p in zip(ours, stock, prompts):
        assert a.ids.tolist() == b.ids.tolist() and a.start == b.start == len(p)
        assert a.features.shape == (len(a.ids) - 1, target.model.config.hidden_size)
        assert torch.allclose(a.features.float(), b.features.float(), atol=2e-2)
        greedy = (a.features.float() @ target.model.get_output_embeddings().weight.T).argmax(-1)
        assert greedy[a.start - 1 :].tolist() == a.ids[a.start :].tolist()  # feature t: what produced token t + 1
    sampled = generate(target, prompts, 12, seeds=[7, 8, 9], runners=runners)
    again = generate(target, prompts, 12, seeds=[7, 8, 9], runners=runners)
    assert [s.ids.tolist() for s in sampled] == [s.ids.tolist() for s in again]
    assert [s.ids.tolist() for s in sampled] != [s.ids.tolist() for s in ours]
    by_generate = [
        generate(target, prompts, 12, seeds=[7, 8, 9]) for _ in range(2)
    ]  # model.generate samples too, seeded
    assert [s.ids.tolist() for s in by_generate[0]] == [s.ids.tolist() for s in by_generate[1]]


def test_sampled_replies_join_each_shard_and_an_older_plan_still_fits(tiny, tmp_path):
    target = tiny("llama", layers=2)
    plan = dict(target=target.identity, prompts="p:12", seed=0, heldout=2, max_prompt_tokens=64, max_new_tokens=6)
    texts = [f"{WORDS[i % 8]} {WORDS[i * 5 % 8]}" for i in range(12)]
    cache = FeatureCache(tmp_path, FeaturePlan(**plan, sampled=2))
    cache.fill(target, texts, 5, deadline=float("inf"), log=quiet)
    shards = [cache.load(p) for p in cache.shards()]
    assert [len(s) for s in shards] == [
        15,
        15,
    ]  # 10 training prompts in batches of 5, a greedy and 2 sampled replies each
    assert all(
        s[i].ids[: s[i].start].tolist() == s[i + 5].ids[: s[i + 5].start].tolist() for s in shards for i in range(5)
    )
    assert len(cache.heldout()) == 2  # held out: greedy only
    old = tmp_path / "old"
    FeatureCache(old, FeaturePlan(**plan))
    stored = json.loads((old / "features" / "plan.json").read_text())
    del stored["sampled"]  # a cache made before the setting existed
    (old / "features" / "plan.json").write_text(json.dumps(stored))
    FeatureCache(old, FeaturePlan(**plan))
    with pytest.raises(DraftVerifyError, match="another target or settings"):
        FeatureCache(old, FeaturePlan(**plan, sampled=1))
