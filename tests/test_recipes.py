"""The static path's recipes beyond the Llama family: Gemma 2 (soft-capped attention and logits, alternating
sliding layers), Gemma 3 (q/k norms, local and global rope bases, the sliding pattern) and Phi-3 (fused qkv and
gate/up) against the stock transformers model, alone and stacked with tree masks over sliding layers; and the
one-line refusals of what the static path does not run."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from draftverify import DraftVerifyError, Engine, Loaded, Runner
from draftverify.backend import Feed
from draftverify.backend.decoder import norm_weight
from draftverify.backend.ops import rms_norm
from draftverify.models import forward_many

RECIPE_ARCHS = ("gemma2", "gemma3", "phi3")
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


def biting(arch: str, seed: int = 0):
    """A tiny model whose every difference from Llama changes the logits: caps small enough that tanh bends
    (Gemma 2's attention, Gemma's final logits), a query_pre_attn_scalar other than the head size, norms off
    their init (conftest)."""
    model = make_model(arch, seed, layers=3)
    cfg = model.config
    if arch.startswith("gemma"):
        cfg.final_logit_softcapping = 1.5
        for layer in model.model.layers:
            layer.self_attn.scaling = 24**-0.5
        cfg.query_pre_attn_scalar = 24
    if arch == "gemma2":
        cfg.attn_logit_softcapping = 2.0
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 2.0
    return model


def stock(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0]


@pytest.mark.parametrize("arch", RECIPE_ARCHS)
def test_static_logits_match_the_stock_model_and_the_caps_matter(arch):
    """A prefill, single steps past the window and a tree: every logit the static path gives equals the stock
    model's full-sequence forward; with Gemma's caps removed the stock logits move, so ignoring them would fail."""
    model = biting(arch)
    runner = Runner(model)
    assert runner.backend == "static", runner.fallback_reason
    seq = [(7 * i) % 90 + 3 for i in range(30)]
    got = [runner.forward(seq[:12]).logits] + [runner.forward([t]).logits for t in seq[12:]]
    want = stock(model, seq)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)
    tokens = [5, 9, 11, 13]
    depth = torch.tensor([0, 1, 1, 2]) + runner.length
    tree = runner.forward(tokens, positions=depth, tree_mask=TREE).logits
    torch.testing.assert_close(tree[3], stock(model, seq + [5, 11, 13])[-1], atol=1e-4, rtol=1e-4)
    if arch.startswith("gemma"):
        model.config.final_logit_softcapping = None
        assert not torch.allclose(stock(model, seq), want, atol=1e-3)


@pytest.mark.parametrize("arch", RECIPE_ARCHS)
def test_static_greedy_equals_the_stock_generate(arch, tokenizer):
    """Greedy decoding on the static path, plain and speculative, gives the stock model's own greedy tokens."""
    model = biting(arch)
    target = Loaded(model, tokenizer, f"tiny-{arch}")
    draft = Loaded(biting(arch, seed=1), tokenizer, f"tiny-{arch}-draft")
    prompt = [(5 * i) % 90 + 3 for i in range(9)]
    seq = list(prompt)
    for _ in range(40):  # the stock model's greedy decoding, each step a full-sequence forward
        seq.append(int(stock(model, seq)[-1].argmax()))
    want = seq[len(prompt) :]
    engine = Engine(target, draft, backend="static")
    for method in ("autoregressive", "speculative", "lookahead"):
        assert engine.generate(prompt, method=method, max_new_tokens=40, eos_token_id=[]).tokens == want, method


@pytest.mark.parametrize("arch", RECIPE_ARCHS)
def test_stacked_forwards_with_trees_over_sliding_layers_match_each_alone(arch):
    """forward_many over three requests (a decoding step, a tree past the window, a chunk): each request's
    logits match its own runner's forward and the stock model, and rollback (select) keeps them matching."""
    model = biting(arch)
    prompts = [[(3 * i) % 90 + 3 for i in range(10)], [(11 * i) % 90 + 3 for i in range(14)], [4, 8, 15]]
    alone, stacked = [Runner(model, "static") for _ in prompts], [Runner(model, "static") for _ in prompts]
    forward_many(stacked, [Feed(p) for p in prompts])
    for runner, p in zip(alone, prompts):
        runner.forward(p)
    feeds = [
        {"tokens": [21]},
        {"tokens": [5, 9, 11, 13], "tree_mask": TREE, "positions": torch.tensor([0, 1, 1, 2]) + 14},
        {"tokens": [30, 31, 32, 33, 34]},
    ]
    got = forward_many(stacked, [Feed(**f) for f in feeds])
    for r, (runner, f) in enumerate(zip(alone, feeds)):
        torch.testing.assert_close(got[r].logits, runner.forward(**f).logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].logits[3], stock(model, prompts[1] + [5, 11, 13])[-1], atol=1e-4, rtol=1e-4)
    stacked[1].select(14, [14, 16, 17])  # keep the tree's path 5, 11, 13
    after = forward_many(stacked, [Feed([22]), Feed([40]), Feed([35])])
    torch.testing.assert_close(after[1].logits[0], stock(model, prompts[1] + [5, 11, 13, 40])[-1], atol=1e-4, rtol=1e-4)


def test_gemma_rms_norm_scales_in_fp32_before_rounding():
    """Gemma's RMSNorm is (x * (1 + w)) rounded, Llama's w * (x rounded): in bf16 the two differ, and each path
    gives its own module's bits."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(6, 64).bfloat16()
    gemma, llama = Gemma3RMSNorm(64).bfloat16(), LlamaRMSNorm(64).bfloat16()
    with torch.no_grad():
        gemma.weight.copy_(torch.randn(64) * 0.5)
        llama.weight.copy_(1 + gemma.weight.float())
        assert torch.equal(rms_norm(x, norm_weight(gemma, 1.0), gemma.eps), gemma(x))
        assert torch.equal(rms_norm(x, llama.weight, llama.variance_epsilon), llama(x))
        assert not torch.equal(gemma(x), llama(x))


def test_what_the_static_path_does_not_run_is_refused_in_one_line():
    from transformers import AutoModelForCausalLM, Phi3Config

    half = 8  # head_dim 16: longrope's factors are per rotary pair
    rope = {"rope_type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    cfg = Phi3Config(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=64, rope_scaling=rope,
        pad_token_id=0, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    longrope = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    runner = Runner(longrope)
    assert runner.backend == "eager" and "longrope" in runner.fallback_reason and "\n" not in runner.fallback_reason
    with pytest.raises(DraftVerifyError, match="longrope.*use --backend eager"):
        Runner(longrope, "static")
    bidirectional = make_model("gemma3", layers=2)
    bidirectional.config.use_bidirectional_attention = True
    assert "bidirectional" in Runner(bidirectional).fallback_reason
    gelu = make_model("gemma3", layers=2)
    gelu.config.hidden_activation = "gelu"
    assert "activation 'gelu'" in Runner(gelu).fallback_reason
