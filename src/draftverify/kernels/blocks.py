"""GGUF weight blocks repacked for the CPU products (csrc/products_blocks.cpp), exactly.

Every supported GGML type is, per sub-block of 16 or 32 consecutive weights of a row, `w = fma(q, D, M)` with an
unsigned integer code q and fp32 D, M; `pack` turns a tensor's raw blocks (a view of the file, kernels/gguf_file.py)
into one of the layouts below without ever building the fp32 weight, and `PackedWeight.matmul` multiplies with it.

Layouts (`LAYOUTS`): "u4" codes 0..15 two a byte (byte j of a 32-weight block: q_j | q_{j+16} << 4), "u8" codes one a
byte, both with D and M fp32 [out, in / sub]; "f16" and "bf16" the file's 2-byte weights, upcast exactly; "f32"
dense fp32 weights (F32 tensors, and the fallback for a type with no kernel). Codes are unsigned so that an int8
activation product (VNNI's u8 x s8 `vpdpbusd`, AVX2's `maddubs`) can use the same layouts: per sub-block,
sum w x = D sum q x + M sum x.

Why fma(q, D, M) gives gguf.quants.dequantize's value bit for bit (D = the type's scale, formed as gguf forms it:
fp16 d times the integer sub-block scale, exact in fp32): where gguf computes `D * q + M` or `D * q - dm`, D * q is
exact in fp32 (at most 22 significant bits), so one rounding of the sum is all either does. Where gguf computes
`D * q'` with a signed q' (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K), the code is q = q' + c and M = -c D (c a power of two, so
M is exact): fma rounds D q + M = D q' once, as gguf rounds D * q' once. The only difference is the sign of a zero
weight (fma gives +0 where D * 0 with D < 0 gives -0), which no product can tell apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from draftverify.kernels.gguf_file import type_name

# GGML type -> (layout, sub-block size, what unpacks its blocks). One row per type, as ggml's type_traits_cpu.
KERNELS: dict[int, tuple[str, int]] = {
    T.Q4_0: ("u4", 32),
    T.Q4_1: ("u4", 32),
    T.Q5_0: ("u8", 32),
    T.Q5_1: ("u8", 32),
    T.Q8_0: ("u8", 32),
    T.Q2_K: ("u4", 16),
    T.Q3_K: ("u4", 16),
    T.Q4_K: ("u4", 32),
    T.Q5_K: ("u8", 32),
    T.Q6_K: ("u8", 16),
    T.F16: ("f16", 32),
    T.BF16: ("bf16", 32),
    T.F32: ("f32", 32),
}
LAYOUTS = {"u4": 0, "u8": 1, "f16": 2, "bf16": 3, "f32": 4}  # csrc/products_blocks.cpp's `Layout`
DEQUANTIZE_ROWS = 1024  # `PackedWeight.dequantize` forms this many rows at a time (each row's values alone)


def fallback_reason(ggml_type: int) -> str | None:
    """Why a type runs on fp32 weights (None: it has a kernel)."""
    if ggml_type in KERNELS:
        return None
    return f"{type_name(ggml_type)} weights have no block kernel: dequantized to fp32 (4 bytes a weight)"


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] in one of `LAYOUTS`: `codes` uint8 [out, row bytes] (f32: the fp32 weight), `d` and `m`
    fp32 [out, in / sub] (empty for f16 / bf16 / f32), `reason` set when a type with no kernel fell back to f32."""

    type_name: str
    shape: tuple[int, int]
    layout: str
    sub: int
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    reason: str | None = None

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the product multiplies by (fma(q, D, M), formed in float64: exact, then rounded
        once, as an fma rounds)."""
        out, k = self.shape
        if self.layout == "f32":
            return self.codes.view(torch.float32).view(out, k)
        if self.layout in ("f16", "bf16"):
            return self.codes.view(torch.float16 if self.layout == "f16" else torch.bfloat16).view(out, k).float()
        w = torch.empty(out, k)
        for start in range(0, out, DEQUANTIZE_ROWS):  # by chunks of rows: the float64 temporaries stay small
            rows = slice(start, min(out, start + DEQUANTIZE_ROWS))
            n = rows.stop - rows.start
            if self.layout == "u4":
                c = self.codes[rows].reshape(n, k // 32, 16)
                q = torch.cat([c & 15, c >> 4], dim=-1).view(n, k)
            else:
                q = self.codes[rows].reshape(n, k)
            d = self.d[rows].double().repeat_interleave(self.sub, dim=1)
            m = self.m[rows].double().repeat_interleave(self.sub, dim=1)
            w[rows] = (q.double() * d + m).float()
        return w

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, out] = x [M, in] @ W^T (+ bias), fp32; with the compiled kernels every row of y is bit for bit the
        one-row product of that row of x. Without them (no AVX2 / compiler): torch on the dequantized weight."""
        from draftverify.kernels import cpu

        if x.dim() != 2 or x.shape[1] != self.shape[1] or x.dtype != torch.float32:
            raise ValueError(f"matmul: x must be float32 [M, {self.shape[1]}], got {tuple(x.shape)} {x.dtype}")
        kernels = cpu()
        if kernels is None or self.shape[1] % 32:
            y = x @ self.dequantize().T
            return y if bias is None else y + bias
        empty = torch.empty(0)
        return kernels.block_linear(
            x.contiguous(), LAYOUTS[self.layout], self.sub, self.codes, self.d, self.m, empty if bias is None else bias
        )


def pack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> PackedWeight:
    """A 2-D tensor's raw GGUF bytes (uint8, any shape holding out * row-bytes bytes: `TensorInfo.raw`) in the layout
    `KERNELS` gives its type, or dequantized to fp32 for a type with none (`reason` says so)."""
    out, k = (int(shape[0]), int(shape[1])) if len(shape) == 2 else (0, 0)
    if len(shape) != 2 or out <= 0 or k <= 0:
        raise ValueError(f"pack: a weight is [out, in], got shape {tuple(shape)}")
    name = type_name(ggml_type)
    try:
        block, size = GGML_QUANT_SIZES[T(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(
            f"pack: GGML type {ggml_type} is unknown to the installed gguf package (upgrade gguf)"
        ) from None
    if k % block or raw.nbytes != out * (k // block) * size:
        raise ValueError(
            f"pack: {name} [{out}, {k}] needs in a multiple of {block} and {out * (k // block) * size} bytes"
        )
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(out * (k // block), size)
    reason = fallback_reason(ggml_type)
    if reason is not None:
        dense = gq.dequantize(blocks.reshape(out, -1), T(ggml_type)).astype(np.float32)
        return _dense(name, (out, k), dense, reason)
    layout, sub = KERNELS[ggml_type]
    if layout == "f32":
        return _dense(name, (out, k), blocks.view(np.float32).reshape(out, k), None)
    if layout in ("f16", "bf16"):
        codes = torch.from_numpy(blocks.reshape(out, 2 * k).copy())
        return PackedWeight(name, (out, k), layout, sub, codes, torch.empty(0), torch.empty(0))
    if k % 32:
        raise ValueError(f"pack: {name} [{out}, {k}]: in must be a multiple of 32 for the block kernels")
    from draftverify.kernels.unpack import UNPACK

    q, d, m = UNPACK[ggml_type](blocks)  # q uint8 [blocks, block] (or packed u4 bytes), d, m fp32 [blocks, subs]
    codes = q.reshape(out, -1) if layout == "u8" or q.shape[1] * 2 == block else _nibbles(q.reshape(out, k))
    tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return PackedWeight(
        name, (out, k), layout, sub, tensor(codes), tensor(d.reshape(out, -1)), tensor(m.reshape(out, -1))
    )


def _dense(name: str, shape: tuple[int, int], w: np.ndarray, reason: str | None) -> PackedWeight:
    codes = torch.from_numpy(np.array(w, dtype=np.float32, copy=True).reshape(shape))
    return PackedWeight(name, shape, "f32", 32, codes, torch.empty(0), torch.empty(0), reason)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [out, in] (0..15) -> bytes [out, in / 2]: byte j of each 32 holds q_j | q_{j+16} << 4."""
    out, k = q.shape
    q = q.reshape(out, k // 32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out, k // 2)


def pack_tensor(info) -> PackedWeight:
    """`pack` of a 2-D tensor of a GGUFFile (`gguf_file.TensorInfo`): its blocks read from the map, packed."""
    if len(info.shape) != 2:
        raise ValueError(f"pack_tensor: {info.name} has shape {info.shape}; only 2-D weights are packed")
    return pack(info.raw, info.ggml_type, info.shape)
