"""Each GGML block type's raw blocks -> unsigned codes and fp32 (D, M) per sub-block, vectorised numpy (blocks.py
packs them). Every function takes blocks uint8 [n, type size] and returns q uint8 [n, weights a block] (Q4_0 / Q4_1:
their nibble bytes [n, 16], already the "u4" layout), d and m float32 [n, sub-blocks a block], so that each weight
is fma(q, d, m): the bit layouts and scale formulas are gguf.quants' dequantize_blocks, read step for step.
"""

from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import Q4_K

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    """Bytes [n, 2] -> float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _bits(packed: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """packed uint8 [n, g, w] -> [n, g * len(shifts) * w]: for each group g, (packed >> s) & mask for each s in turn."""
    n = packed.shape[0]
    s = np.array(shifts, dtype=np.uint8).reshape(1, 1, -1, 1)
    return ((packed[:, :, None, :] >> s) & np.uint8(mask)).reshape(n, -1)


def q4_0(b):
    d = _f16(b[:, :2])
    return b[:, 2:], d, d * np.float32(-8)


def q4_1(b):
    return b[:, 4:], _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """qh [n, 4] bytes (bit i: weight i's fifth bit) -> [n, 32] 0 / 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return bits << np.uint8(4)


def q5_0(b):
    d = _f16(b[:, :2])
    low = _bits(b[:, None, 6:], [0, 4], 0x0F)
    return low | _q5_high(b[:, 2:6]), d, d * np.float32(-16)


def q5_1(b):
    low = _bits(b[:, None, 8:], [0, 4], 0x0F)
    return low | _q5_high(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4])


def q8_0(b):
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d, d * np.float32(-128)  # q + 128: two's complement with the top bit flipped


def q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = d * (scales & 0xF).astype(np.float32)
    ml = dmin * (scales >> 4).astype(np.float32)
    q = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3)
    return q, dl, -ml


def q3_k(b):
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = _bits(scales[:, None, :8], [0, 4], 0x0F)
    high = _bits(scales[:, None, 8:], [0, 2, 4, 6], 0x03)
    sc = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = d * sc
    ql = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3)
    qh = _bits(hmask.reshape(n, 1, 32), list(range(8)), 1)
    # gguf: q' = ql - 4 (1 - qh) in -4..3; the code q' + 4 = ql + 4 qh
    return ql | (qh << np.uint8(2)), dl, dl * np.float32(-4)


def _k_scales(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def q4_k(b):
    n = b.shape[0]
    d, m = _k_scales(b)
    return _bits(b[:, 16:].reshape(n, 4, 32), [0, 4], 0x0F), d, m


def q5_k(b):
    n = b.shape[0]
    d, m = _k_scales(b)
    ql = _bits(b[:, 48:].reshape(n, 4, 32), [0, 4], 0x0F)
    qh = _bits(b[:, 16:48].reshape(n, 1, 32), list(range(8)), 1)
    return ql | (qh << np.uint8(4)), d, m


def q6_k(b):
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210]) * sc
    low = _bits(ql.reshape(n, 2, 64), [0, 4], 0x0F)  # per 64 bytes: their low nibbles, then their high ones
    high = _bits(qh.reshape(n, 2, 32), [0, 2, 4, 6], 3)
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).reshape(n, QK_K)
    return q, d, d * np.float32(-32)  # gguf: q' = q - 32


UNPACK = {
    T.Q4_0: q4_0,
    T.Q4_1: q4_1,
    T.Q5_0: q5_0,
    T.Q5_1: q5_1,
    T.Q8_0: q8_0,
    T.Q2_K: q2_k,
    T.Q3_K: q3_k,
    T.Q4_K: q4_k,
    T.Q5_K: q5_k,
    T.Q6_K: q6_k,
}
