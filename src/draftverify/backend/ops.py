"""Small shared operations of the static path: the compiled kernels, RMSNorm, the gated MLP's act(gate) * up,
soft-capping, rotary halves, the attention masks every path (static, eager, feature head) builds alike, and the
decoder layer op by op (`run_layer`), which the static and the graphed decoders both run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftverify.kernels import cpu as cpu_kernels  # compiled once per process (functools.cache); None if it cannot be

__all__ = [
    "argmax_rows",
    "cpu_kernels",
    "gated",
    "layer_windows",
    "post_norm",
    "rms_norm",
    "run_layer",
    "rotate_half",
    "silu_mul",
    "softcap",
    "window_masks",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype (one fused op in fp32,
    where both orders of rounding agree; our one-pass kernel on a CPU). An fp32 `weight` for a lower-precision
    `x` is Gemma's order: scale in fp32, then round (`decoder.norm_weight` makes Gemma's 1 + w in fp32)."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        kernels = cpu_kernels() if x.device.type == "cpu" and x.is_contiguous() else None
        if kernels is not None:
            return kernels.rms_norm(x, weight, eps)
        return torch.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (x32 * weight).to(dtype)
    return weight * x32.to(dtype)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of logits [n, V] (of a [V] row: a list of one), as torch.argmax gives it (the first largest;
    a row with a NaN: its first NaN): our one-pass kernel for fp32 on a CPU (ATen's reads a verified row of a large
    vocabulary at about a byte a nanosecond), else ATen's."""
    rows = logits.view(1, -1) if logits.dim() == 1 else logits
    kernels = cpu_kernels() if rows.dtype == torch.float32 and rows.device.type == "cpu" else None
    if kernels is not None:
        return kernels.argmax_rows(rows.contiguous())
    return rows.argmax(-1).tolist()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a gated MLP's [m, 2 I] gate | up product: our kernel on a CPU in fp32 (which the fused
    layer uses too, so every path forms each element alike), else ATen's."""
    kernels = cpu_kernels() if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" else None
    if kernels is not None:
        return kernels.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a gated MLP's [m, 2 I] gate | up product (transformers' ACT2FN of the config's name)."""
    if activation == "silu":
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation {activation!r} is not implemented by the static path")


def vocab_logits(logits: torch.Tensor, vocab: torch.Tensor, size: int) -> torch.Tensor:
    """Logits [m, N] of a draft vocabulary's tokens `vocab` [N] (`Feed.vocab`) as [m, size], every other token -inf:
    what both backends return for a forward that drafts from a vocabulary."""
    return logits.new_full((logits.shape[0], size), float("-inf")).index_copy_(1, vocab.to(logits.device), logits)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's logit soft-capping, in transformers' order of ops); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def post_norm(x: torch.Tensor, norm: tuple | None) -> torch.Tensor:
    """A sub-layer's output before its residual add: normed by Gemma's sandwich norm (weight, eps), else itself."""
    return x if norm is None else rms_norm(x, *norm)


def run_layer(layer, h: torch.Tensor, attention, product=None, skip_attention=False, skip_mlp=False) -> torch.Tensor:
    """One decoder layer op by op: h [rows, H] -> [rows, H]. `layer`: its weights (`decoder.LayerWeights`);
    `attention(qkv)`: the attention of the fused projection's rows [rows, q + k + v] -> [rows, heads * d] (it
    writes the cache); `product(linear, x)`: how a linear takes the rows (`Spans`; None: `linear(x)`). A skipped
    sub-layer (a layer-skipping draft's) leaves h as it is."""
    product = product or (lambda linear, x: linear(x))
    if not skip_attention:
        qkv = product(layer.qkv, rms_norm(h, layer.norm_in, layer.eps))
        h = h + post_norm(product(layer.o, attention(qkv)), layer.norm_attn_out)
    if not skip_mlp:
        up = gated(product(layer.gate_up, rms_norm(h, layer.norm_mlp, layer.eps)), layer.activation)
        h = h + post_norm(product(layer.down, up), layer.norm_mlp_out)
    return h


def layer_windows(config) -> list[int | None]:
    """The sliding window of each decoder layer (None = full attention), as transformers reads the config."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)):
        return [window if t == "sliding_attention" else None for t in types[:n]]
    return [window] * n  # e.g. Mistral: one window for every layer, or None


def window_masks(positions: torch.Tensor, tree_mask: torch.Tensor | None, past: int, windows) -> dict:
    """Boolean [n, past + n] masks (True = may attend), one per distinct window in `windows` (None =
    full attention). New token i at `positions[i]` attends the cached prefix (slot j holds position j)
    and the new tokens `tree_mask` [n, n] allows (causal when None), and only keys less than the
    window behind it. The static path and the eager one both mask with these."""
    n, device = positions.shape[0], positions.device
    allowed = torch.ones(n, past + n, dtype=torch.bool, device=device)
    if tree_mask is not None:
        allowed[:, past:] = tree_mask.to(device, torch.bool)
    elif n > 1:
        allowed[:, past:] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    key_pos = torch.cat([torch.arange(past, device=device), positions])  # [past + n]
    return {
        w: allowed if w is None else allowed & (positions.view(n, 1) - key_pos.view(1, -1) < w) for w in set(windows)
    }
