"""The q8 arithmetic (kernels/q8.py, csrc/products_q8.cpp): bit for bit its numpy reference, every row of a forward
bit for bit its one-row product, and close to (but not) the fp32 product."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from draftverify.kernels import cpu
from draftverify.kernels import q8 as q8k
from draftverify.kernels.blocks import PackedWeight
from draftverify.kernels.quant import exact_blocks

needs_kernels = pytest.mark.skipif(cpu() is None, reason="the compiled CPU kernels are unavailable")


def weight(
    layout: str, sub: int, out: int, k: int, seed: int = 0, centre: int | None = None, half: bool = False
) -> PackedWeight:
    """Random codes and scales; `centre` c: M = -c D (a type with signed codes), which the kernel folds into I;
    `half`: scales exact in fp16 (as Q4_0..Q8_0's are), which the kernel's tiles keep in fp16."""
    g = torch.Generator().manual_seed(seed)
    top = {"u4": 16, "u5": 32, "u6": 64}.get(layout, 256)
    # u5: u8 codes below 32 (Q5_*), which `prepare` packs in 5 bits; u6: below 64 (Q6_K), multiplied unsplit on AVX2
    layout = "u8" if layout in ("u5", "u6") else layout
    q = torch.randint(0, top, (out, k), generator=g, dtype=torch.int32).to(torch.uint8)
    if layout == "u4":
        c = q.view(out, k // 32, 2, 16)
        q = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(out, k // 2)
    d = torch.rand(out, k // sub, generator=g) * 0.02
    d = d.half().float() if half else d
    m = -(torch.rand(out, k // sub, generator=g) * 0.1) if centre is None else d * -float(centre)
    m = m.half().float() if half else m
    return PackedWeight("test", (out, k), layout, sub, q.contiguous(), d, m)


def activations(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x[0, :32] = 0.0  # a block of zeros: dx = 0
    if rows > 1:
        x[1, 40] = 1e4  # one large activation dominates its block
    return x


CASES = [("u4", 32, 576), ("u4", 16, 576), ("u8", 32, 256), ("u8", 16, 320), ("u5", 32, 576), ("u5", 16, 320)]
CASES += [("u6", 32, 576), ("u6", 16, 320)]
CENTRES = {"u4": 8, "u8": 128, "u5": 16, "u6": 32}  # Q4_0's, Q8_0's, Q5_0's and Q6_K's


@needs_kernels
@pytest.mark.parametrize("half", [False, True], ids=["fp32-scales", "fp16-scales"])
@pytest.mark.parametrize("centred", [False, True], ids=["asymmetric", "centred"])
@pytest.mark.parametrize("layout,sub,k", CASES)
def test_kernel_matches_reference_bit_for_bit(layout, sub, k, centred, half):
    w = weight(layout, sub, 40, k, centre=CENTRES[layout] if centred else None, half=half)
    assert q8k.centre(w) == (CENTRES[layout] if centred else -1)
    x, bias, tiles = activations(7, k), torch.randn(40), q8k.prepare(w)
    assert tiles.d.dtype == (torch.float16 if half else torch.float32) and tiles.layout == layout
    for b in (None, bias):
        y = q8k.matmul(tiles, x, b).numpy()
        ref = q8k.reference(x.numpy(), w, None if b is None else b.numpy())
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("layout,sub,k", CASES)
def test_the_largest_codes_times_the_largest_activations_are_exact(layout, sub, k):
    """Every code at its largest (15, 31, 63 or 255) times activations that round to +-127 everywhere: the integer sums
    at their bounds. AVX2's maddubs adds pairs of products in int16, and the kernel adds a half block's pairs in
    int16 before widening them (4 x 2 x 31 x 127 = 31496 < 32767; codes below 64: two chunks' pairs, 32004): a wider
    sum would saturate, and differ here."""
    w = weight(layout, sub, 32, k)
    w.codes.fill_(0xFF if layout == "u4" else {"u5": 31, "u6": 63}.get(layout, 255))
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0  # alternating signs: pairs of products that cancel
    x[3, : k // 2] = -1.0
    y = q8k.matmul(q8k.prepare(w), x).numpy()
    assert np.array_equal(y.view(np.uint32), q8k.reference(x.numpy(), w).view(np.uint32))


@needs_kernels
@pytest.mark.parametrize("centred", [False, True], ids=["asymmetric", "centred"])
@pytest.mark.parametrize("layout,sub,k", CASES)
def test_every_row_is_its_one_row_product(layout, sub, k, centred):
    # 48 outputs: three tiles, so a pass over pairs of tiles leaves one alone; every row count's passes
    w = weight(layout, sub, 48, k, seed=3, centre=CENTRES[layout] if centred else None)
    w, x = q8k.prepare(w), activations(32, k, seed=4)
    one = torch.cat([q8k.matmul(w, x[r : r + 1]) for r in range(32)])
    for m in range(1, 33):
        assert torch.equal(q8k.matmul(w, x[:m]), one[:m]), f"{m} rows"


@needs_kernels
def test_tiles_in_an_arena_are_the_same_tiles_on_2mb_aligned_buffers(monkeypatch):
    """`TileArena` places tiles and scales in large buffers that start on 2 MB boundaries (advised to be huge pages):
    the same bytes, 64-byte aligned views, a new buffer when one is full, and the same product bits."""
    monkeypatch.setattr(q8k.TileArena, "CHUNK", 4 << 20)
    arena = q8k.TileArena()
    ws = [weight(layout, sub, 40, k, seed=i) for i, (layout, sub, k) in enumerate(CASES)] * 40  # > one buffer
    x = activations(5, 576)
    firsts: dict[int, int] = {}  # each buffer's storage -> its first view's address
    for w in ws:
        alone, placed = q8k.prepare(w), q8k.prepare(w, arena)
        assert torch.equal(placed.codes, alone.codes) and torch.equal(placed.d, alone.d)
        assert torch.equal(placed.m, alone.m)
        assert all(t.data_ptr() % 64 == 0 for t in (placed.codes, placed.d) if t.numel())
        for t in (placed.codes, placed.d, placed.m):  # a new buffer may begin with any of the three
            if t.numel():
                base = t.untyped_storage().data_ptr()
                firsts[base] = min(firsts.get(base, t.data_ptr()), t.data_ptr())
        if w.shape[1] == 576:
            assert torch.equal(q8k.matmul(placed, x), q8k.matmul(alone, x))
    assert len(firsts) > 1  # the first buffer filled up
    assert all(first % (2 << 20) == 0 for first in firsts.values())  # each buffer starts on a 2 MB page
    t = torch.randn(7, 3)
    assert torch.equal(arena.place(t), t) and arena.place(torch.empty(0)).numel() == 0


def test_reference_is_not_the_fp32_product_but_close():
    w, x = weight("u4", 32, 24, 256), activations(5, 256)
    ref = torch.from_numpy(q8k.reference(x.numpy(), w))
    fp32 = x @ w.dequantize().T
    assert not torch.equal(ref, fp32)  # activations are rounded: a different arithmetic
    assert (ref - fp32).abs().max() <= 0.02 * fp32.abs().max()


def test_rounding_matches_the_q8_0_rule():
    x = np.array([[0.5, -1.0, 127.0 / 254] + [0.0] * 29], np.float32)
    qx, dx = q8k.round_activations(x)
    assert dx[0, 0] == np.float32(1.0) / np.float32(127)
    assert qx[0, :3].tolist() == [64.0, -127.0, 64.0]  # 63.5 -> 64 (ties to even), -127
    assert q8k.round_activations(np.zeros((1, 32), np.float32))[0].sum() == 0


def test_fma32_rounds_once():
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(2000).astype(np.float32) for _ in range(3))
    # the cases double rounding gets wrong: c just off a product's halfway point
    a[:8], b[:8] = np.float32(1 + 2**-12), np.float32(1 + 2**-12)
    c[:4], c[4:8] = np.float32(2**-60), np.float32(-(2**-60))
    got = q8k.fma32(a, b, c)
    for i in range(len(a)):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        lo = np.float32(float(exact))
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda f: (abs(Fraction(float(f)) - exact), int(np.float32(f).view(np.uint32)) & 1))
        assert got[i] == best, i


def test_from_blocks_is_the_same_weight():
    from quantized_models import quantized

    g = torch.Generator().manual_seed(5)
    for kind in ("q8_0", "q4_1"):
        w = quantized(torch.randn(8, 64, generator=g), kind)
        blocks = exact_blocks(w)
        assert blocks is not None and blocks.kind == kind
        assert torch.equal(q8k.from_blocks(blocks).dequantize(), w)


def test_bad_input_is_one_line():
    w = weight("u4", 32, 4, 64)
    with pytest.raises(ValueError, match="float32"):
        q8k.matmul(w, torch.zeros(2, 32))
    dense = PackedWeight("F32", (4, 64), "f32", 32, torch.zeros(4, 64), torch.empty(0), torch.empty(0))
    with pytest.raises(ValueError, match="no codes"):
        q8k.matmul(dense, torch.zeros(1, 64))
    with pytest.raises(ValueError, match="no codes"):
        q8k.prepare(dense)
