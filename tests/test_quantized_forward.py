"""The static path over quantized weights (a tiny GGUF-style Llama): sampling through the quantized product and
kernels keeps the target's law, a stacked forward gives each sequence its own bits, the one-call layer gives the
op-by-op layers' bits, and every method stays token-identical."""

from __future__ import annotations

import phrase_sampling as ps
import pytest
import torch
from quantized_models import assert_stacked_is_alone, gguf_style_llama
from test_backends import METHODS, PROMPTS

from draftverify import Engine, Loaded, Runner
from draftverify.drafters.skipsets import SkipSet
from draftverify.sampling import Sampling


def test_sampling_through_the_quantized_product_and_kernels_matches_the_target(tokenizer, monkeypatch):
    """Sampled speculative decoding on a GGUF-style model (the quantized product and the rope/attention kernels
    for every forward; a Q8_0 draft) draws the second token from the target's exact law; the classic wrong
    rule is caught."""
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    target, sharper = Loaded(gguf_style_llama(), tokenizer, "tiny-q4"), gguf_style_llama()
    with (
        torch.no_grad()
    ):  # a draft close to the target but not it: q = p at a lower temperature, so guesses hit and miss
        sharper.model.norm.weight.mul_(3.0)
    engine = Engine(target, Loaded(sharper, tokenizer, "tiny-q4-sharper"), backend="static")
    assert (
        engine.target_runner.static.layers[0].qkv.blocks is not None
        and engine.target_runner.static.rope_attention is not None
    )
    sampling, prompt = Sampling(temperature=1.0, top_k=6), [5, 9, 14]

    def pvalue():
        counts: dict[int, int] = {}
        for seed in range(2500):
            r = engine.generate(
                prompt,
                method="speculative",
                max_new_tokens=3,
                temperature=1.0,
                top_k=6,
                seed=seed,
                eos_token_id=[],
                k=1,
                policy="constant",
            )
            counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
        return ps.second_token_pvalue(target.model, prompt, sampling, counts)

    assert pvalue() > 1e-3
    ps.broken_rule(monkeypatch)
    assert pvalue() < 1e-4


def test_a_stacked_forward_gives_each_sequence_of_a_quantized_model_its_own_bits():
    """Batched serving stacks one request's prefill (oneDNN) with others' decoding steps and trees (the
    quantized product): every sequence's logits and cache are bit for bit what its forward alone gives."""
    from draftverify.backend.linear import QUANT_ROWS
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    model = gguf_style_llama()
    prompts = [list(range(3, 3 + QUANT_ROWS + 9)), [5, 9, 14], [8] * 7]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [
        [{"tokens": p} for p in prompts],  # three prefills, one long
        [
            {"tokens": [11]},
            {"tokens": list(range(20, 20 + QUANT_ROWS + 3))},
            {"tokens": [12, 13, 14], "tree_mask": tree, "positions": torch.tensor([7, 8, 8])},
        ],  # a decoding step, a long chunk, a tree
        [{"tokens": [30 + i for i in range(QUANT_ROWS - 1)]}, {"tokens": [40, 41]}, {"tokens": [42]}],
    ]  # short, over 32 together
    alone, stacked = [Runner(model, "static") for _ in prompts], [Runner(model, "static") for _ in prompts]
    assert_stacked_is_alone(alone, stacked, steps)


def test_the_one_call_layer_gives_the_op_by_op_layers_bits(monkeypatch):
    """A short forward of one sequence runs each layer in one kernel call (`layer`); its logits and cache are
    bit for bit those of the op-by-op layers (prefill, decoding step, tree, a step with sub-layers skipped)."""
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    model = gguf_style_llama()
    fused, plain = Runner(model, "static"), Runner(model, "static")
    calls = []
    monkeypatch.setattr(fused.static, "layer_kernel", lambda *a: calls.append(1) or cpu().layer(*a))
    for layer in plain.static.layers:
        layer.fused = None
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for feed in (
        {"tokens": [3, 17, 5, 9, 14, 2]},
        {"tokens": [11]},
        {"tokens": [12, 13, 14], "tree_mask": tree, "positions": torch.tensor([7, 8, 8])},
    ):
        assert torch.equal(fused.forward(**feed).logits, plain.forward(**feed).logits), feed
    assert len(calls) == 3 * len(model.model.layers)
    skip = SkipSet(attention=(0,), mlp=(1,))  # self-speculative drafting: the layers it leaves whole take the one call
    assert torch.equal(fused.forward([21], skip=skip).logits, plain.forward([21], skip=skip).logits)
    assert len(calls) == 4 * len(model.model.layers) - 2
    for (ka, va), (kb, vb) in zip(fused.cached_kv(), plain.cached_kv()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_gguf_style_quantized_model_runs_its_few_row_forwards_on_the_quantized_product(tiny, tokenizer):
    """A tiny Llama whose weights are exact Q4_1 (layers) and Q8_0 (embeddings, tied head) blocks, as a GGUF
    model loads: the static path multiplies few rows with the blocks and every method stays token-identical."""
    from draftverify.backend.linear import QUANT_ROWS
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    model = gguf_style_llama()
    target = Loaded(model, tokenizer, "tiny-q4")
    static = Runner(model, "static").static
    assert static.layers[0].gate_up.blocks.kind == "q4_1" and static.head.blocks.kind == "q8_0"
    draft = tiny("llama", seed=1, layers=2)  # plain fp32: on oneDNN
    reference = Engine(target, draft, backend="eager")
    engine = Engine(target, draft, backend="static")
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        ar = reference.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[]).tokens
        for method, preset in METHODS + [("autoregressive", None)]:
            assert engine.generate(ids, method=method, preset=preset, max_new_tokens=30, eos_token_id=[]).tokens == ar
    runner = Runner(model, "static")
    ids = (reference.encode(" ".join(PROMPTS)) * 3)[: 2 * QUANT_ROWS + 5]
    logits = runner.forward(ids).logits  # many rows: oneDNN
    runner.crop(0)
    runner.forward(ids[:-QUANT_ROWS])
    few = runner.forward(ids[-QUANT_ROWS:]).logits  # the last rows again, on the quantized product
    torch.testing.assert_close(few, logits[-QUANT_ROWS:], atol=1e-4, rtol=1e-4)
