"""Exact block-quantized copies of fp32 weights, for the static path's quantized product
(csrc/products_q4q8.cpp).

A GGUF model such as the default SmolLM2 Q4_1 is loaded as fp32 weights that are the quantized
blocks dequantized: every 32 consecutive weights of a row are `d * q + m` (Q4_1: q in 0..15, d
and m fp16) or `d * q` (Q8_0: q in -128..127, d fp16). Streaming those fp32 weights (540 MB for
SmolLM2) is what one decoding step costs on a CPU; the blocks themselves are 5 or 8.5 bits a
weight. `exact_blocks` recovers them from the fp32 weight and keeps them only if rebuilding
every weight gives back the same fp32 bits (q*d is exact, so fma(q, d, m) rounds as `d * q + m`
does); a weight that is not so quantized (a trained draft, a model loaded from safetensors in
fp32) stays on oneDNN. No GGUF parsing: any weight that happens to be exactly such blocks
qualifies, whatever file it came from.

`q8_blocks` is the lossy conversion, for drafts only (the draft model, the feature head), whose precision
changes what is proposed, never what verification accepts: Q8_0 blocks of any weight (d kept in fp32), which
the q8 products multiply in their tiles where the CPU has AVX-512 VNNI (backend/linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class Blocks:
    """A weight [N, K] as exact blocks of 32: `q` uint8 [N, K/2] (Q4_1, two per byte: byte j of a
    block holds q_j | q_{j+16} << 4) or int8 [N, K] (Q8_0); `d` [N, K/32]; `m` [N, K/32] or empty (Q8_0)."""

    kind: str  # "q4_1" or "q8_0"
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the blocks stand for (what the kernel rebuilds, for tests)."""
        n, blocks = self.d.shape
        if self.kind == "q8_0":
            return (self.q.view(n, blocks, BLOCK).float() * self.d[..., None]).view(n, blocks * BLOCK)
        packed = self.q.view(n, blocks, BLOCK // 2)
        q = torch.cat([packed & 15, packed >> 4], dim=-1).float()
        return torch.addcmul(self.m[..., None], q, self.d[..., None]).view(n, blocks * BLOCK)


def _fp16_exact(t: torch.Tensor) -> bool:
    return bool((t.half().float() == t).all())


def _in_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] (fp32, CPU, K a multiple of 32) viewed as [N, K/32, 32] blocks, else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    n, k = weight.shape
    return weight.detach().reshape(n, k // BLOCK, BLOCK)


def exact_blocks(weight: torch.Tensor) -> Blocks | None:
    """`weight` [N, K] (fp32, CPU) as exact Q4_1 or Q8_0 blocks, or None if it is neither bit for bit."""
    w = _in_blocks(weight)
    return None if w is None else _q4_1(w) or _q8_0(w)


def _q4_1(w: torch.Tensor) -> Blocks | None:
    m = w.amin(-1)
    d = (w.amax(-1) - m) / 15  # the block's largest weight has q = 15 (llama.cpp's rounding)
    q = torch.round((w - m[..., None]) / torch.where(d > 0, d, 1.0)[..., None])
    if not (q.amax() <= 15 and q.amin() >= 0 and _fp16_exact(d) and _fp16_exact(m)):
        return None
    if not torch.equal(torch.addcmul(m[..., None], q, d[..., None]), w):
        return None
    q = q.to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    n, blocks, _ = w.shape
    return Blocks("q4_1", packed.reshape(n, blocks * BLOCK // 2).contiguous(), d.contiguous(), m.contiguous())


def _q8_rounding(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [N, B, 32] -> q [N, B, 32] (whole numbers in -127..127) and d [N, B]: the block's largest
    magnitude has |q| = 127."""
    d = w.abs().amax(-1) / 127
    return torch.round(w / torch.where(d > 0, d, 1.0)[..., None]).clamp(-127, 127), d


def _q8_0_blocks(q: torch.Tensor, d: torch.Tensor) -> Blocks:
    n, blocks, _ = q.shape
    return Blocks("q8_0", q.to(torch.int8).reshape(n, blocks * BLOCK).contiguous(), d.contiguous(), torch.empty(0))


def _q8_0(w: torch.Tensor) -> Blocks | None:
    q, d = _q8_rounding(w)
    if not (_fp16_exact(d) and torch.equal(q * d[..., None], w)):
        return None
    return _q8_0_blocks(q, d)


def q8_blocks(weight: torch.Tensor) -> Blocks | None:
    """`weight` [N, K] (fp32, CPU) rounded to Q8_0 blocks (d = the block's largest magnitude / 127, in fp32):
    NOT the same weight. For drafts, whose outputs are only proposals."""
    w = _in_blocks(weight)
    return None if w is None else _q8_0_blocks(*_q8_rounding(w))
