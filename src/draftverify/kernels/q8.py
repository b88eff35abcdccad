"""The q8 arithmetic: a block weight's codes times activations rounded to int8 (csrc/products_q8.cpp).

Each row of x is rounded per block of 32 activations as llama.cpp rounds them for its Q8_0 dot products
(dx = max|x| / 127, qx = round-to-nearest-even(x * (1 / dx)), |qx| <= 127); per sub-block s of the weight (16 or 32
weights, `blocks.PackedWeight`'s "u4" / "u8" layouts, w = D q + M) the integer sums I_s = sum q qx and X_s = sum qx
are exact, and y = sum over blocks b of dx_b (sum_s D_s I_s + M_s X_s) in fp32 in one fixed order (the C++ file's
header; a weight with M = -c D folds c X_s into I_s exactly). Each row is rounded and summed alone, so a row's result
never depends on the other rows of a forward: a verified token's logits are bit for bit those of a one-token step in
this arithmetic, as they are in fp32.

`prepare` repacks a PackedWeight once into the kernel's tiles of 16 outputs (`Q8Weight`: one 64-byte load holds 4
codes of 16 outputs, so one int8 dot-product instruction adds 16 outputs x 4 k and no sum is reduced across lanes).
`reference` is the same arithmetic in numpy (the integer parts exact, the fp32 combination in the same order, each
fma rounded once), which the tests compare with the kernel bit for bit. F16 / BF16 / F32 weights have no codes: they
keep their fp32 products under q8 (the arithmetic applies to block weights only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftverify.kernels.blocks import PackedWeight

CODE_LAYOUTS = ("u4", "u8")
# csrc/products_q8.cpp's `Layout` (u5: u8 codes below 32, in 5 bits; u6: u8 codes below 64, Q6_K's, in bytes, which
# AVX2 multiplies without splitting them into nibbles)
TILE_LAYOUTS = {"u4": 0, "u8": 1, "u5": 2, "u6": 3}


def supports(w: PackedWeight) -> bool:
    """Whether `w` has codes the q8 product multiplies (u4 / u8 layouts, in-features a multiple of 32)."""
    return w.layout in CODE_LAYOUTS and w.shape[1] % 32 == 0


def instruction_set() -> str:
    """The integer dot product the compiled kernel uses on this CPU (the arithmetic is the same on each)."""
    from draftverify.kernels import has_avx_vnni, has_vnni

    return "avx512-vnni" if has_vnni() else "avx-vnni" if has_avx_vnni() else "avx2-maddubs"


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


TILE = 16  # outputs a tile: one int8 dot-product instruction's int32 lanes on AVX-512


@dataclass(frozen=True)
class Q8Weight:
    """A PackedWeight's codes and scales in the q8 kernel's tiles (csrc/products_q8.cpp's header): `layout` "u4", "u8",
    "u5" (u8 codes all below 32: nibbles and a bit plane, 5 bits a weight) or "u6" (u8 codes below 64, as bytes);
    `codes` uint8 [tiles, tile bytes]; `d` (and `m`) [tiles, in / sub, 16], fp16 where every scale is exact in fp16
    (the Q4_0..Q8_0 types: their scales are the file's fp16 values), else fp32; `centre` c >= 0 when M = -c D
    everywhere (then `m` is empty), else -1. `type_name`, `shape` and `sub` are the PackedWeight's."""

    type_name: str
    shape: tuple[int, int]
    layout: str
    sub: int
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    centre: int


def centre(w: PackedWeight) -> int:
    """c >= 0 when the weight's M is -c D in every sub-block (the types with signed codes: Q4_0, Q5_0, Q8_0, Q3_K,
    Q6_K), so c X folds into the integer sum exactly; -1 otherwise. c is read at the first sub-block with D != 0."""
    d, m = w.d.reshape(-1), w.m.reshape(-1)
    nonzero = d != 0
    if not bool(nonzero.any()):
        return 0 if bool((m == 0).all()) else -1
    first = int(nonzero.to(torch.uint8).argmax())
    c = -float(m[first] / d[first])
    if c < 0 or c != round(c) or c > 255:
        return -1
    return int(c) if bool(torch.equal(m, d * -c)) else -1


# bytes of 32 k of a tile (csrc/products_q8.cpp `block_bytes`)
BLOCK_BYTES = {"u4": 256, "u8": 512, "u5": 320, "u6": 512}
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


class TileArena:
    """Room for many weights' tiles (and whatever else a decoding step streams) in a few large buffers on 2 MB pages:
    a step streams every weight once, and takes one TLB entry per 2 MB rather than per 4 KB. Each buffer is aligned
    to 2 MB and advised MADV_HUGEPAGE before it is written, so the kernel faults it in as huge pages where
    transparent huge pages are on "madvise" or "always" (elsewhere the advice changes nothing). Owned by what packs
    a model's weights (`GGUFWeights`); a weight's tiles are views of a buffer, which lives as long as any of them.
    Untouched pages at a buffer's end are never resident."""

    CHUNK = 64 << 20

    def __init__(self):
        self._buffer: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 [nbytes] view, 64-byte aligned, of the current buffer (a new one when it has no room)."""
        start = -(-self._used // 64) * 64
        if self._buffer is None or start + nbytes > self._buffer.numel():
            self._buffer, start = _huge_buffer(max(self.CHUNK, nbytes)), 0
        self._used = start + nbytes
        return self._buffer[start : start + nbytes]

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (contiguous, same dtype and shape) in the arena; an empty `t` as it is."""
        if not t.numel():
            return t
        return self.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape).copy_(t)


def _huge_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] starting on a 2 MB boundary, advised MADV_HUGEPAGE (linux; elsewhere a plain buffer)."""
    import ctypes
    import sys

    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(size), MADV_HUGEPAGE)
    return raw[offset : offset + nbytes]


def prepare(w: PackedWeight, arena: TileArena | None = None) -> Q8Weight:
    """`w` (u4 / u8 codes) in the kernel's tiles of 16 outputs (csrc/products_q8.cpp `q8_repack`), the last tile
    padded with zero codes and scales; the tiles in `arena` when given, else in a buffer of their own. Needs the
    compiled kernels (without them `matmul` takes the PackedWeight)."""
    from draftverify.kernels import cpu

    if not supports(w):
        raise ValueError(f"q8: {w.type_name} in layout {w.layout} has no codes: use PackedWeight.matmul")
    kernels = cpu()
    if kernels is None:
        raise ValueError("q8.prepare needs the compiled kernels: multiply the PackedWeight with q8.matmul instead")
    out, k = w.shape
    tiles = -(-out // TILE)
    layout = w.layout
    if w.layout == "u8":  # Q5_0 / Q5_1 / Q5_K: 5 bits; Q6_K: 6
        top = int(w.codes.max())
        layout = "u5" if top < 32 else "u6" if top < 64 else "u8"
    nbytes = tiles * (k // 32) * BLOCK_BYTES[layout]
    flat = (arena.take(nbytes) if arena is not None else torch.empty(nbytes, dtype=torch.uint8)).view(tiles, -1)
    kernels.q8_repack(w.codes.contiguous(), TILE_LAYOUTS[w.layout], TILE_LAYOUTS[layout], out, k, flat)
    c = centre(w)

    def scales(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t.reshape(out, -1), torch.zeros(tiles * TILE - out, k // w.sub)])
        return t.reshape(tiles, TILE, k // w.sub).transpose(1, 2).contiguous()

    d, m = scales(w.d), torch.empty(0) if c >= 0 else scales(w.m)
    if all(torch.equal(t.half().float(), t) for t in (d, m)):  # every scale exact in fp16: half the bytes, same values
        d, m = d.half(), m.half()
    if arena is not None:
        d, m = arena.place(d), arena.place(m)
    return Q8Weight(w.type_name, w.shape, layout, w.sub, flat, d, m, c)


def matmul(w: PackedWeight | Q8Weight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W^T (+ bias) in the q8 arithmetic; without the compiled kernels, `reference`.
    A PackedWeight is prepared on each call: a caller that multiplies it again keeps `prepare(w)`."""
    from draftverify.kernels import cpu

    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.float32:
        raise ValueError(f"q8 matmul: x must be float32 [M, {w.shape[1]}], got {tuple(x.shape)} {x.dtype}")
    kernels = cpu()
    if kernels is None:
        if isinstance(w, Q8Weight):
            raise ValueError("q8 matmul without the compiled kernels takes the PackedWeight, not its tiles")
        b = None if bias is None else bias.numpy()
        return torch.from_numpy(reference(x.numpy(), w, b))
    t = w if isinstance(w, Q8Weight) else prepare(w)
    empty = torch.empty(0)
    return kernels.q8_linear(
        x.contiguous(), TILE_LAYOUTS[t.layout], t.sub, t.shape[0], t.codes, t.d, t.m, t.centre,
        empty if bias is None else bias.contiguous(),
    )  # fmt: skip


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


def codes(w: PackedWeight, dtype=np.int64) -> np.ndarray:
    """The weight's codes, one per weight: [out, in] (`dtype` uint8: no wider copy of a large weight)."""
    out, k = w.shape
    c = w.codes.numpy()
    if w.layout == "u4":
        c = c.reshape(out, k // 32, 16)
        return np.concatenate([c & 15, c >> 4], axis=-1).reshape(out, k).astype(dtype, copy=False)
    return c.reshape(out, k).astype(dtype, copy=False)


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
    subs, c = k // sub, centre(w)
    q = codes(w).reshape(out, subs, sub)
    xs = qx.astype(np.int64).reshape(m, subs, sub)
    sums = np.einsum("osj,msj->mos", q, xs)  # I [M, out, subs], exact
    big_x = np.broadcast_to(xs.sum(-1)[:, None, :], sums.shape)  # X [M, out, subs]
    d = np.broadcast_to(w.d.numpy().reshape(1, out, subs), sums.shape)
    f32 = lambda t: np.asarray(t, np.float32)  # noqa: E731
    if c >= 0:  # M = -c D: I - c X exactly, and no M term
        sums, mt = sums - c * big_x, None
    else:
        mt = np.broadcast_to(w.m.numpy().reshape(1, out, subs), sums.shape)
    acc = np.zeros((m, out), np.float32)
    per = 32 // sub  # sub-blocks a block of 32 activations
    for b in range(k // 32):
        t = None
        for s in range(b * per, (b + 1) * per):
            i = f32(sums[..., s])
            t = f32(d[..., s] * i) if t is None else fma32(d[..., s], i, t)
            if mt is not None:
                t = fma32(mt[..., s], f32(big_x[..., s]), t)
        acc = fma32(t, np.broadcast_to(dx[:, b : b + 1], acc.shape), acc)
    return acc if bias is None else (acc + np.asarray(bias, np.float32)).astype(np.float32)
