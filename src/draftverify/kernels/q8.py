"""The q8 arithmetic: a block weight's codes times activations rounded to int8 (csrc/products_q8.cpp).

Each row of x is rounded per block of 32 activations as llama.cpp rounds them for its Q8_0 dot products
(dx = max|x| / 127, qx = round-to-nearest-even(x * (1 / dx)), |qx| <= 127); per sub-block s of the weight (16 or 32
weights, `blocks.PackedWeight`'s "u4" / "u8" layouts, w = D q + M) the integer sums I_s = sum q qx and X_s = sum qx
are exact, and y = sum_s D_s dx_s I_s + M_s dx_s X_s in fp32 in one fixed order (the C++ file's header). Each row is
rounded and summed alone, so a row's result never depends on the other rows of a forward: a verified token's logits
are bit for bit those of a one-token step in this arithmetic, as they are in fp32.

`reference` is the same arithmetic in numpy (the integer parts exact, the fp32 combination in the same order, each
fma rounded once), which the tests compare with the kernel bit for bit. F16 / BF16 / F32 weights have no codes: they
keep their fp32 products under q8 (the arithmetic applies to block weights only).
"""

from __future__ import annotations

import numpy as np
import torch

from draftverify.kernels.blocks import LAYOUTS, PackedWeight

CODE_LAYOUTS = ("u4", "u8")


def supports(w: PackedWeight) -> bool:
    """Whether `w` has codes the q8 product multiplies (u4 / u8 layouts, in-features a multiple of 32)."""
    return w.layout in CODE_LAYOUTS and w.shape[1] % 32 == 0


def instruction_set() -> str:
    """The integer dot product the compiled kernel uses on this CPU (the arithmetic is the same on each)."""
    from draftverify.kernels import has_vnni

    return "avx512-vnni" if has_vnni() else "avx2-maddubs"


def from_blocks(blocks) -> PackedWeight:
    """An exact Q4_1 / Q8_0 `kernels.quant.Blocks` as the same weight in the "u4" / "u8" layout: Q4_1's nibbles are
    already u4 codes; Q8_0's signed q becomes q + 128 with M = -128 d (exact: a power of two times d)."""
    n, k = blocks.d.shape[0], blocks.d.shape[1] * 32
    if blocks.kind == "q4_1":
        return PackedWeight("Q4_1", (n, k), "u4", 32, blocks.q, blocks.d, blocks.m)
    if blocks.kind == "q8_0":
        codes = (blocks.q.to(torch.int16) + 128).to(torch.uint8).contiguous()
        return PackedWeight("Q8_0", (n, k), "u8", 32, codes, blocks.d, (blocks.d * -128.0).contiguous())
    raise ValueError(f"from_blocks: {blocks.kind} blocks have no q8 product (only exact q4_1 / q8_0)")


def matmul(w: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W^T (+ bias) in the q8 arithmetic; without the compiled kernels, `reference`."""
    from draftverify.kernels import cpu

    if not supports(w):
        raise ValueError(f"q8 matmul: {w.type_name} in layout {w.layout} has no codes: use PackedWeight.matmul")
    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.float32:
        raise ValueError(f"q8 matmul: x must be float32 [M, {w.shape[1]}], got {tuple(x.shape)} {x.dtype}")
    kernels = cpu()
    if kernels is None:
        b = None if bias is None else bias.numpy()
        return torch.from_numpy(reference(x.numpy(), w, b))
    empty = torch.empty(0)
    return kernels.q8_linear(
        x.contiguous(), LAYOUTS[w.layout], w.sub, w.codes, w.d, w.m, empty if bias is None else bias.contiguous()
    )


def round_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] -> qx [M, K] (whole numbers in -127..127, as float32) and dx float32 [M, K / 32]."""
    m, k = x.shape
    b = np.asarray(x, np.float32).reshape(m, k // 32, 32)
    amax = np.abs(b).max(-1)
    dx = amax / np.float32(127)
    inv = np.float32(1) / np.where(amax > 0, dx, np.float32(1))
    inv = np.where(amax > 0, inv, np.float32(0)).astype(np.float32)
    qx = np.clip(np.rint(b * inv[..., None]), -127, 127)
    return qx.reshape(m, k).astype(np.float32), dx.astype(np.float32)


def codes(w: PackedWeight) -> np.ndarray:
    """The weight's codes, one per weight: int64 [out, in]."""
    out, k = w.shape
    c = w.codes.numpy()
    if w.layout == "u4":
        c = c.reshape(out, k // 32, 16)
        return np.concatenate([c & 15, c >> 4], axis=-1).reshape(out, k).astype(np.int64)
    return c.reshape(out, k).astype(np.int64)


def fma32(a, b, c) -> np.ndarray:
    """float32 fma: a * b + c rounded once. a * b is exact in float64 (24 + 24 bits); the float64 sum's error (TwoSum)
    decides the one case where rounding that sum to float32 again would differ: a float64 sum exactly halfway."""
    a, b, c = (np.asarray(t, np.float32).astype(np.float64) for t in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # s + e == p + c exactly
    r = s.astype(np.float32)
    other = np.nextafter(r, np.where(s > r, np.float32(np.inf), np.float32(-np.inf))).astype(np.float32)
    tie = (s != r) & (s == (r.astype(np.float64) + other.astype(np.float64)) / 2) & (e != 0)
    toward = np.sign(e) == np.sign(other.astype(np.float64) - r.astype(np.float64))
    return np.where(tie & toward, other, r).astype(np.float32)


def reference(x: np.ndarray, w: PackedWeight, bias: np.ndarray | None = None) -> np.ndarray:
    """The q8 product in numpy, bit for bit the kernel's: y float32 [M, out]."""
    qx, dx = round_activations(x)
    m, k = qx.shape
    out, sub = w.shape[0], w.sub
    subs, groups = k // sub, -(-(k // sub) // 8)
    q = codes(w).reshape(out, subs, sub)
    xs = qx.astype(np.int64).reshape(m, subs, sub)
    sums = np.einsum("osj,msj->mos", q, xs)  # I [M, out, subs], exact
    pad = lambda t: np.concatenate([t, np.zeros((*t.shape[:-1], groups * 8 - subs), t.dtype)], -1)  # noqa: E731
    big_i = pad(sums.astype(np.float32))
    big_x = pad(xs.sum(-1).astype(np.float32))[:, None, :]  # X [M, 1, G*8]
    dxs = pad(np.repeat(dx, 32 // sub, axis=1))[:, None, :]
    a = pad(w.d.numpy().reshape(out, subs))[None] * dxs  # float32 products, rounded once
    c = pad(w.m.numpy().reshape(out, subs))[None] * dxs
    acc = np.zeros((m, out, 8), np.float32)
    for g in range(groups):
        lanes = slice(8 * g, 8 * g + 8)
        acc = fma32(a[..., lanes], big_i[..., lanes], acc)
        acc = fma32(c[..., lanes], np.broadcast_to(big_x[..., lanes], acc.shape), acc)
    t = acc[..., :4] + acc[..., 4:]
    y = (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])
    return (y if bias is None else y + np.asarray(bias, np.float32)).astype(np.float32)
