"""A decoder layer read from a weight source by logical names, rather than from a stock module.

A weight source (`loading.gguf_weights.GGUFWeights`) gives, by the stock module's names ("layers.3.self_attn.q_proj"),
`linear(name)` a `kernels.blocks.PackedWeight`, `fused(names)` those of several fused along out (q|k|v, gate|up: packed
once, no second copy of the parts), `shape(name)`, `bias(name)` / `vector(name)` fp32 tensors, `has(name)` and
`release()` (the packing is done: the file's pages may leave resident memory).
`source_layer` builds the same per-layer fields `decoder._Layer` reads from a stock module, with the products
`BlockLinear`s (backend/linear.py), so the decoder's forward runs unchanged on either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.backend.linear import BlockLinear
from draftverify.backend.recipe import Recipe


@dataclass
class SourceLayer:
    """One layer's weights as `decoder._Layer` holds them (`fused`: None, the one-call layer takes q4q8 only)."""

    qkv: BlockLinear
    o: BlockLinear
    gate_up: BlockLinear
    down: BlockLinear
    q_size: int
    kv_size: int
    norm_in: torch.Tensor
    norm_mlp: torch.Tensor
    eps: float
    q_norm: tuple | None
    k_norm: tuple | None
    scaling: float
    fused: None = None
    norm_attn_out: torch.Tensor | None = None  # the sandwich norms of Gemma: not read from files yet
    norm_mlp_out: torch.Tensor | None = None
    softcap: float | None = None
    activation: str = "silu"


def source_layer(source, i: int, recipe: Recipe, config, eps: float, arithmetic: str = "fp32") -> SourceLayer:
    """Layer i of `source` as its recipe names it (recipe names under "self_attn." / "mlp.")."""
    at = lambda part, name: f"layers.{i}.{part}.{name}"  # noqa: E731
    qkv_names = [at("self_attn", n) for n in recipe.qkv]
    shapes = [source.shape(n) for n in qkv_names]
    biases = [source.bias(n) for n in qkv_names]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(shape[0]) for b, shape in zip(biases, shapes)])
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    norms = [at("self_attn", "q_norm"), at("self_attn", "k_norm")]
    q_norm, k_norm = (
        [(source.vector(n), eps) if source.has(n) else None for n in norms] if recipe.qk_norm else [None, None]
    )
    return SourceLayer(
        qkv=BlockLinear(source.fused(qkv_names), bias, arithmetic),
        o=BlockLinear([source.linear(at("self_attn", recipe.out))], arithmetic=arithmetic),
        gate_up=BlockLinear(source.fused([at("mlp", n) for n in recipe.gate_up]), arithmetic=arithmetic),
        down=BlockLinear([source.linear(at("mlp", recipe.down))], arithmetic=arithmetic),
        q_size=shapes[0][0],
        kv_size=shapes[1][0],
        norm_in=source.vector(f"layers.{i}.{recipe.norm_in}"),
        norm_mlp=source.vector(f"layers.{i}.{recipe.norm_mlp}"),
        eps=eps,
        q_norm=q_norm,
        k_norm=k_norm,
        scaling=float(head_dim**-0.5),
    )
