"""The GGUF block layouts (kernels/blocks.py, unpack.py) and their product (csrc/products_blocks.cpp): for each
type, random raw blocks built here; the packed weight equals gguf's dequantization; every row of an m-row product
is bit for bit the one-row product of that row, which agrees with a dense fp32 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from draftverify.kernels.blocks import KERNELS, fallback_reason, pack

# Where each type keeps its fp16 scales (byte offsets in a block); every other byte is a code or a small scale,
# for which any value is valid.
HALVES = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
}
QUANTIZED = list(HALVES)[:-1]


def random_raw(ggml_type: int, out: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, row bytes]: random codes, random finite fp16 scales of either sign (F16 / BF16: random weights)."""
    rng = np.random.default_rng(seed)
    if ggml_type in (T.F16, T.BF16):
        w = rng.standard_normal((out, k)).astype(np.float32)
        return gq.quantize(w, T(ggml_type)).view(np.uint8).reshape(out, -1)
    block, size = GGML_QUANT_SIZES[T(ggml_type)]
    raw = rng.integers(0, 256, (out * (k // block), size), dtype=np.uint8)
    for at in HALVES[ggml_type]:
        scale = (rng.uniform(1e-3, 0.1, raw.shape[0]) * rng.choice([-1.0, 1.0], raw.shape[0])).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(out, -1)


def reference(raw: np.ndarray, ggml_type: int) -> torch.Tensor:
    return torch.from_numpy(gq.dequantize(raw, T(ggml_type)).astype(np.float32))


TYPES = [*QUANTIZED, T.F16, T.BF16]


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: T(t).name)
def test_packed_weight_is_gguf_dequantization(ggml_type):
    k = 512
    raw = random_raw(ggml_type, 24, k)
    packed = pack(raw, ggml_type, (24, k))
    assert packed.layout == KERNELS[ggml_type][0] and packed.reason is None
    want = reference(raw, ggml_type)
    assert packed.codes.dtype == torch.uint8 and packed.codes.numel() < want.numel() * 4  # never an fp32 copy
    got = packed.dequantize()
    assert torch.equal(got, want)  # value for value (a zero's sign may differ: blocks.py says why)
    assert not (got.isnan().any() or want.isnan().any())


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: T(t).name)
def test_blocks_from_ggufs_quantizer(ggml_type):
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = gq.quantize(w, T(ggml_type))
    assert torch.equal(pack(raw, ggml_type, (8, 256)).dequantize(), reference(raw, ggml_type))


def test_a_wrong_bit_is_seen():
    """The comparison above can fail: one flipped code bit changes the packed weight."""
    raw = random_raw(T.Q4_K, 4, 256)
    bad = raw.copy()
    bad[0, 20] ^= 1  # a code byte (after d, dmin and the 12 scale bytes)
    assert not torch.equal(pack(bad, T.Q4_K, (4, 256)).dequantize(), reference(raw, T.Q4_K))


def kernels():
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(f"CPU kernels unavailable: {unavailable()}")
    return cpu()


@pytest.mark.parametrize("ggml_type", [*TYPES, T.F32], ids=lambda t: T(t).name)
def test_every_row_is_its_one_row_product(ggml_type):
    kernels()
    out, k = 37, 512  # out: not a multiple of any interleave or thread chunk
    if ggml_type == T.F32:
        raw = np.random.default_rng(2).standard_normal((out, k)).astype(np.float32).view(np.uint8)
    else:
        raw = random_raw(ggml_type, out, k, seed=2)
    packed = pack(raw, ggml_type, (out, k))
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(out, generator=torch.Generator().manual_seed(4))
    one = torch.cat([packed.matmul(x[i : i + 1], bias) for i in range(32)])
    for m in (1, 2, 3, 8, 17, 32):
        assert torch.equal(packed.matmul(x[:m], bias), one[:m]), m
    w = packed.dequantize().double()
    dense = x.double() @ w.T + bias.double()
    bound = x.double().abs() @ w.abs().T + bias.double().abs()  # fp32 rounding error grows with sum |x w|
    assert ((one.double() - dense).abs() <= 1e-5 * bound + 1e-6).all()
    # the kernel's own weight: the product with the identity gives it back
    assert torch.equal(packed.matmul(torch.eye(k)).T, packed.dequantize())


def test_odd_shapes_are_refused_or_handled():
    with pytest.raises(ValueError, match="multiple of 256"):
        pack(np.zeros((2, 110), np.uint8), T.Q3_K, (2, 200))
    with pytest.raises(ValueError, match="bytes"):
        pack(np.zeros((2, 10), np.uint8), T.Q4_0, (2, 32))
    with pytest.raises(ValueError, match="is \\[out, in\\]"):
        pack(np.zeros(18, np.uint8), T.Q4_0, (32,))
    raw = random_raw(T.F16, 5, 48)  # in not a multiple of 32: the product falls back to torch
    packed = pack(raw, T.F16, (5, 48))
    x = torch.randn(3, 48)
    torch.testing.assert_close(packed.matmul(x), x @ reference(raw, T.F16).T)
    with pytest.raises(ValueError, match="float32"):
        packed.matmul(torch.randn(3, 47))


def test_a_type_without_kernel_runs_in_fp32_and_says_so():
    assert fallback_reason(T.Q4_K) is None
    assert "IQ4_NL" in fallback_reason(T.IQ4_NL)
    raw = random_raw(T.IQ4_NL, 6, 64)
    packed = pack(raw, T.IQ4_NL, (6, 64))
    assert packed.layout == "f32" and "IQ4_NL" in packed.reason
    assert torch.equal(packed.dequantize(), reference(raw, T.IQ4_NL))
    x = torch.randn(2, 64)
    torch.testing.assert_close(packed.matmul(x), x @ reference(raw, T.IQ4_NL).T)


def test_every_listed_type_has_an_unpacker():
    from draftverify.kernels.unpack import UNPACK

    coded = {t for t, (layout, _) in KERNELS.items() if layout in ("u4", "u8")}
    assert coded == set(UNPACK) and set(QUANTIZED) == coded


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0], ids=lambda t: T(t).name)
def test_the_file_blocks_multiply_as_the_recovered_blocks_do(ggml_type):
    """The static path's Q4_1 / Q8_0 product on blocks recovered from the fp32 weight (quant.exact_blocks) and the
    block product on the file's blocks: the same weights, the same sums, the same bits."""
    from draftverify.kernels.quant import exact_blocks

    kernel = kernels()
    w = np.random.default_rng(5).standard_normal((40, 256)).astype(np.float32)
    raw = gq.quantize(w, T(ggml_type))
    packed = pack(raw, ggml_type, (40, 256))
    recovered = exact_blocks(packed.dequantize())
    assert recovered is not None and recovered.kind == T(ggml_type).name.lower()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6))
    want = kernel.quant_linear(x, recovered.q, recovered.d, recovered.m, torch.empty(0))
    assert torch.equal(packed.matmul(x), want)
