"""The model runner: tree masks with explicit positions, crop and select, bad settings."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import ARCHS, SLIDING_ARCHS, make_model

from draftverify import DraftVerifyError, Runner


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_matches_each_branch_run_alone(tiny, arch):
    model = tiny(arch).model
    prefix = [5, 6, 7, 8]
    # tree: root r=9 with two branches [10, 11] and [12]
    tokens = [9, 10, 11, 12]
    parents = [-1, 0, 1, 0]
    depth = [0, 1, 2, 1]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    for i in range(4):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    run = Runner(model)
    run.forward(prefix)
    tree = run.forward(tokens, positions=torch.tensor(depth) + len(prefix), tree_mask=mask).logits
    for branch in ([9, 10, 11], [9, 12]):
        ref = Runner(model)
        ref.forward(prefix)
        chain = ref.forward(branch).logits
        rows = [tokens.index(t) for t in branch]
        torch.testing.assert_close(tree[rows], chain, atol=1e-4, rtol=1e-4)
    # keep the [9, 12] path and continue: same as a cache built along that path alone
    run.select(len(prefix), [len(prefix) + 0, len(prefix) + 3])
    assert run.length == 6
    after = run.forward([13]).logits
    ref = Runner(model)
    ref.forward(prefix + [9, 12])
    torch.testing.assert_close(after, ref.forward([13]).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS + ("qwen3",) + SLIDING_ARCHS)
def test_the_stock_forward_takes_no_argument_transformers_deprecates(tiny, arch):
    """The eager backend passes the stock model only what its installed transformers takes without a
    FutureWarning (a deprecated argument, such as `past_key_values` for the cache, is removed later)."""
    run = Runner(tiny(arch).model, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        run.forward([5, 6, 7, 8])
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
        run.forward([9, 10, 11], positions=torch.tensor([4, 5, 5]), tree_mask=mask, hidden=True)
        run.select(4, [4, 6])
        run.forward([12], last=1)


def test_crop_and_last(tiny):
    run = Runner(tiny("llama").model)
    full = run.forward([1, 2, 3, 4, 5]).logits
    assert full.shape[0] == 5
    run.crop(3)
    assert run.length == 3
    again = run.forward([4, 5], last=1).logits
    assert again.shape[0] == 1
    torch.testing.assert_close(again[0], full[-1], atol=1e-4, rtol=1e-4)


def test_hidden_state_returned(tiny):
    out = Runner(tiny("llama").model).forward([1, 2, 3], last=2, hidden=True)
    assert out.logits.shape[0] == 2 and out.hidden.shape == (2, 64)


def test_attention_without_custom_masks_is_refused():
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(DraftVerifyError, match="cannot take a custom 4-D mask"):
        Runner(model)


@pytest.mark.parametrize("backend", ["static", "eager"])
def test_a_draft_vocabulary_gives_the_logits_of_its_tokens_and_minus_infinity_elsewhere(tiny, backend):
    """FR-Spec (`Feed.vocab`): a draft runner's logits for a vocabulary's tokens are bit for bit its logits over the
    whole vocabulary (each row of the head is multiplied alone), every other token -inf; on the target's runner
    (self-speculative drafting) the rows are the draft's rounded copy, so close, and the same argmax here."""
    model = tiny("llama", seed=1, layers=2).model
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    vocab = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40]
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[vocab] = False
    for draft in (True, False):
        runner = Runner(model, backend, draft=draft)
        full = runner.forward(ids, last=3).logits
        runner.reset()
        sub = runner.forward(ids, last=3, vocab=vocab).logits
        assert sub.shape == full.shape and torch.isneginf(sub[:, outside]).all()
        if draft or backend == "eager":
            assert torch.equal(sub[:, vocab], full[:, vocab]), (backend, draft)
        else:
            assert torch.allclose(sub[:, vocab], full[:, vocab], atol=0.05, rtol=0.05)
            assert torch.equal(sub.argmax(-1), vocab[full[:, vocab].argmax(-1)])
