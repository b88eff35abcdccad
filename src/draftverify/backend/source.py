"""A decoder layer read from a weight source by logical names, rather than from a stock module.

A weight source (`loading.gguf_weights.GGUFWeights`) gives, by the stock module's names ("layers.3.self_attn.q_proj"),
`linear(name)` a `kernels.blocks.PackedWeight`, `fused(names)` those of several fused along out (q|k|v, gate|up: packed
once, no second copy of the parts), `shape(name)`, `bias(name)` / `vector(name)` fp32 tensors, `has(name)` and
`release()` (a layer is packed: the file's pages read so far may leave resident memory) and `packed()` (the decoder
has every weight: released, and the packs kept in the source's cache, loading/tile_cache.py).
`source_layer` builds the same per-layer fields `decoder.LayerWeights` reads from a stock module, with the products
`BlockLinear`s (backend/linear.py), so the decoder's forward runs unchanged on either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.backend.linear import BlockLinear, layer_weights
from draftverify.backend.recipe import Recipe, activation


@dataclass
class SourceLayer:
    """One layer's weights as `decoder.LayerWeights` holds them (`fused`: the products as the kernels' one-call `layer`
    takes them, for a plain pre-norm SiLU layer; else None)."""

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
    fused: list | None = None
    norm_attn_out: tuple | None = None  # Gemma's sandwich norms (weight, eps), on the sub-layers' outputs
    norm_mlp_out: tuple | None = None
    softcap: float | None = None
    activation: str = "silu"


def source_norm(source, name: str, offset: float) -> torch.Tensor:
    """A norm's scale as `ops.rms_norm` takes it: the stock module's weight, or Gemma's offset + weight in fp32
    (what `decoder.norm_weight` forms from the stock module)."""
    weight = source.vector(name)
    return weight if not offset else offset + weight


def source_layer(source, i: int, recipe: Recipe, config, eps: float, arithmetic: str = "fp32") -> SourceLayer:
    """Layer i of `source` as its recipe names it (recipe names under "self_attn." / "mlp.")."""
    at = lambda part, name: f"layers.{i}.{part}.{name}"  # noqa: E731
    qkv_names = [at("self_attn", n) for n in recipe.qkv]
    shapes = [source.shape(n) for n in qkv_names]
    biases = [source.bias(n) for n in qkv_names]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(shape[0]) for b, shape in zip(biases, shapes)])
    heads, offset = config.num_attention_heads, recipe.norm_offset
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    norm = lambda name: source_norm(source, name, offset)  # noqa: E731
    q_norm = k_norm = None  # per-head norms (Qwen3, Gemma 3), (weight, eps)
    if recipe.qk_norm and source.has(at("self_attn", "q_norm")):
        q_norm, k_norm = (norm(at("self_attn", "q_norm")), eps), (norm(at("self_attn", "k_norm")), eps)
    attn_out, mlp_out = (
        None if name is None else (norm(f"layers.{i}.{name}"), eps)
        for name in (recipe.norm_attn_out, recipe.norm_mlp_out)
    )
    scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim  # Gemma scales scores by its own scalar
    qkv = BlockLinear(source.fused(qkv_names, arithmetic), bias, arithmetic)
    o = BlockLinear([source.linear(at("self_attn", recipe.out), arithmetic)], arithmetic=arithmetic)
    gate_up = BlockLinear(source.fused([at("mlp", n) for n in recipe.gate_up], arithmetic), arithmetic=arithmetic)
    down = BlockLinear([source.linear(at("mlp", recipe.down), arithmetic)], arithmetic=arithmetic)
    return SourceLayer(
        qkv=qkv,
        o=o,
        gate_up=gate_up,
        down=down,
        fused=layer_weights(qkv, o, gate_up, down) if recipe.one_call(config) else None,
        q_size=heads * head_dim,
        kv_size=kv_heads * head_dim,
        norm_in=norm(f"layers.{i}.{recipe.norm_in}"),
        norm_mlp=norm(f"layers.{i}.{recipe.norm_mlp}"),
        eps=eps,
        q_norm=q_norm,
        k_norm=k_norm,
        scaling=float(scalar**-0.5),
        norm_attn_out=attn_out,
        norm_mlp_out=mlp_out,
        softcap=getattr(config, "attn_logit_softcapping", None) if recipe.attn_softcap else None,
        activation=activation(config),
    )
