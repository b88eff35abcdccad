"""The CPU kernels (`draftverify.kernels`): linear, RMS norm, silu-mul, argmax, the quantized product and the
attention kernels against ATen and fp64, each row's bits independent of the rows beside it, of the row count, of
key chunks and of the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quantized_models import quantized

from draftverify import Runner


def test_cpu_kernels_match_aten_and_serve_the_static_path(tiny):
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:  # no compiler / AVX2 here: the static path runs on oneDNN and ATen alone
        pytest.skip(unavailable())
    torch.manual_seed(0)
    for n, k in ((100, 64), (3072, 576), (576, 1536)):
        w, x, bias = torch.randn(n, k), torch.randn(1, k), torch.randn(n)
        torch.testing.assert_close(kernel.linear(x, w, torch.empty(0)), x @ w.T, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kernel.linear(x, w, bias), x @ w.T + bias, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="one row"):
        kernel.linear(torch.randn(2, 64), torch.randn(8, 64), torch.empty(0))
    for shape in ((1, 576), (5, 576), (3, 4, 100), (2, 7)):  # rows of any width, vector part and tail
        x, w = torch.randn(shape), torch.rand(shape[-1])
        torch.testing.assert_close(kernel.rms_norm(x, w, 1e-5), torch.rms_norm(x, w.shape, w, 1e-5))
    for gate_up in (torch.randn(1, 3072) * 6, torch.randn(40, 10)):  # silu(gate) * up: vector part and tail, both signs
        gate, up = gate_up.chunk(2, dim=-1)
        torch.testing.assert_close(kernel.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)
    rows = torch.randn(8, 576)  # each row alone: its result does not depend on the rows beside it
    assert torch.equal(kernel.rms_norm(rows, w := torch.rand(576), 1e-5)[3], kernel.rms_norm(rows[3:4], w, 1e-5)[0])
    layer = Runner(tiny("qwen2").model, "static").static.layers[0]
    assert layer.qkv.bias is not None  # Qwen2's q/k/v biases ride along
    assert layer.qkv.kernel is kernel  # one row of fp32 weights: our kernel


def test_quantized_blocks_are_recovered_bit_for_bit_or_not_at_all():
    from draftverify.kernels.quant import exact_blocks

    torch.manual_seed(0)
    w = torch.randn(48, 96)
    assert exact_blocks(w) is None  # plain fp32 weights stay on oneDNN
    for kind in ("q4_1", "q8_0"):
        exact = quantized(w, kind)
        blocks = exact_blocks(exact)
        assert blocks is not None and blocks.kind == kind and torch.equal(blocks.dequantize(), exact)
        nudged = exact.clone()
        nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(9.0))  # one weight off by one ulp
        assert exact_blocks(nudged) is None
    assert exact_blocks(torch.randn(4, 40)) is None  # rows not made of 32-weight blocks


def test_quantized_product_matches_fp64_and_gives_each_row_the_same_bits_at_any_row_count():
    from draftverify.kernels import cpu, unavailable
    from draftverify.kernels.quant import exact_blocks

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(0)
    for kind, (n, k) in (("q4_1", (300, 576)), ("q8_0", (257, 1536)), ("q4_1", (5, 32))):
        w = quantized(torch.randn(n, k), kind)
        b, bias = exact_blocks(w), torch.randn(n)
        x = torch.randn(20, k)
        y = kernel.quant_linear(x, b.q, b.d, b.m, bias)
        exact = (x.double() @ w.double().T + bias.double()).float()
        torch.testing.assert_close(y, exact, atol=1e-4, rtol=1e-5)
        for rows in range(
            1, 21
        ):  # a row's sums do not depend on the rows that came with it (passes of 6, the last of up to 8 with AVX-512)
            assert torch.equal(kernel.quant_linear(x[:rows].contiguous(), b.q, b.d, b.m, bias), y[:rows])
            assert torch.equal(kernel.quant_linear(x[rows - 1 :].contiguous(), b.q, b.d, b.m, bias)[0], y[rows - 1])


def test_argmax_kernel_gives_torchs_argmax_ties_infinities_and_nans_included():
    """argmax.cpp (greedy verification's choice of each row): the first index of the largest value, a row with a NaN
    its first NaN's, at every length around the vector width and at a vocabulary's; `argmax_rows` takes it on CPU."""
    from draftverify.backend.ops import argmax_rows
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(0)
    for V in (1, 2, 7, 8, 9, 15, 16, 17, 31, 100, 49152, 49155):
        x = torch.randn(6, V)
        x[1] = torch.randint(0, 3, (V,)).float()  # ties everywhere
        x[2] = -torch.inf  # nothing but -inf
        x[3, V // 2] = torch.inf
        x[4, -1] = 1e9  # the largest in the tail
        x[5, V // 3] = torch.nan  # a NaN anywhere: its index
        if V > 1:
            x[5, V - 1] = torch.nan
        want = x.argmax(-1).tolist()
        assert kernel.argmax_rows(x) == want, V
        assert argmax_rows(x) == want and argmax_rows(x[0]) == want[:1]
    assert argmax_rows(x.double()) == want  # not fp32: ATen's


def test_attention_kernel_matches_fp64_and_gives_each_row_the_same_bits_at_any_row_count():
    """attention.cpp's attention (the static path's, for few new tokens): softmax(q k^T * scale) v with a mask, grouped
    query heads, against fp64 SDPA; a row's output does not depend on the rows that came with it."""
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(0)
    for n, past, heads, kv, d in (
        (1, 40, 9, 3, 64),
        (7, 300, 8, 2, 64),
        (5, 33, 4, 4, 128),
        (6, 20, 14, 2, 64),
        (3, 9, 4, 2, 16),
        (2, 50, 6, 3, 32),
        (4, 150, 4, 1, 256),  # Gemma's head size, across a key chunk boundary
    ):
        keys, values = torch.randn(kv, past + n + 5, d), torch.randn(kv, past + n + 5, d)  # capacity beyond the length
        q = torch.randn(n, heads + kv, d)[:, :heads]  # a view with strided rows, as the static path passes it
        mask = torch.rand(n, past + n) > 0.4
        mask[:, past:] |= torch.eye(n, dtype=torch.bool)  # each token sees itself
        for m in (mask, None):
            out = kernel.attention(
                q, keys, values, past + n, torch.empty(0, dtype=torch.bool) if m is None else m, 0.125
            )
            exact = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None].double(),
                keys[None, :, : past + n].double(),
                values[None, :, : past + n].double(),
                attn_mask=m,
                scale=0.125,
                enable_gqa=True,
            )
            torch.testing.assert_close(
                out, exact[0].transpose(0, 1).reshape(n, heads * d).float(), atol=2e-6, rtol=1e-5
            )
        for r in range(n):
            alone = kernel.attention(q[r : r + 1], keys, values, past + n, mask[r : r + 1].contiguous(), 0.125)
            assert torch.equal(alone[0], kernel.attention(q, keys, values, past + n, mask, 0.125)[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_kernel_gives_rows_that_share_keys_the_bits_they_get_alone(dtype):
    """Rows whose keys of a chunk begin the same way (a prefill's causal rows, the diagonal's one more key a row
    included; rows with no mask) are computed together, four at a time (attention.cpp's attend_rows, each row's keys
    past its own count left out): each must still get the bits of its own one-row call, for whole and partial chunks,
    every head grouping and head size, and an fp32 or fp16 cache. (Built without -ffp-contract=off,
    the AVX2 kernels gave rows of 16-wide heads in pairs other bits together than alone.)"""
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(1)
    for n, past, heads, kv, d in ((9, 0, 9, 3, 64), (13, 250, 9, 3, 64), (6, 127, 8, 2, 32), (5, 124, 4, 1, 256),
                                  (8, 40, 4, 4, 16), (11, 300, 6, 3, 128), (7, 140, 4, 2, 16),
                                  (6, 20, 2, 1, 16)):  # fmt: skip
        keys, values = (torch.randn(kv, past + n + 3, d).to(dtype) for _ in range(2))
        q = torch.randn(n, heads + kv, d)[:, :heads]
        causal = torch.ones(n, past + n, dtype=torch.bool)
        causal[:, past:] = torch.ones(n, n, dtype=torch.bool).tril()
        for mask in (causal, torch.empty(0, dtype=torch.bool)):
            together = kernel.attention(q, keys, values, past + n, mask, 0.125)
            for r in range(n):
                row_mask = mask[r : r + 1].contiguous() if mask.numel() else mask
                alone = kernel.attention(q[r : r + 1], keys, values, past + n, row_mask, 0.125)
                assert torch.equal(alone[0], together[r]), (n, past, heads, kv, d, r, mask.numel() > 0)


def test_attention_kernel_gives_a_tree_token_the_bits_of_its_one_token_step_across_key_chunks():
    """The kernel cuts each row's keys into chunks of 128 and merges them: a tree token whose ancestors sit at
    scattered slots (verification) gets the same bits as the one-token step that attends the same keys after
    `select` packed them (decoding), also where the gaps straddle a chunk boundary."""
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(2)
    heads, kv, d, ancestors, n = 9, 3, 64, [1, 3, 6], 7
    no_mask = torch.empty(0, dtype=torch.bool)
    for past in (100, 125, 126, 127, 128, 254, 383, 700):
        keys, values = torch.randn(kv, past + n + 2, d), torch.randn(kv, past + n + 2, d)
        q = torch.randn(n, heads, d)
        mask = torch.zeros(n, past + n, dtype=torch.bool)
        mask[:, :past] = True
        mask[:, past:] |= torch.eye(n, dtype=torch.bool)
        mask[n - 1, [past + a for a in ancestors]] = (
            True  # the last token's path: slots past+1, past+3, past+6 (itself)
        )
        tree = kernel.attention(q, keys, values, past + n, mask, 0.125)
        packed_keys, packed_values = keys.clone(), values.clone()
        for slot, a in enumerate(ancestors):
            packed_keys[:, past + slot], packed_values[:, past + slot] = keys[:, past + a], values[:, past + a]
        step = kernel.attention(q[n - 1 :], packed_keys, packed_values, past + len(ancestors), no_mask, 0.125)
        assert torch.equal(step[0], tree[n - 1]), past
        for r in range(n - 1):  # a chain token: its one-token step sees the prefix and itself
            chain_keys, chain_values = keys.clone(), values.clone()
            chain_keys[:, past], chain_values[:, past] = keys[:, past + r], values[:, past + r]
            alone = kernel.attention(q[r : r + 1], chain_keys, chain_values, past + 1, no_mask, 0.125)
            assert torch.equal(alone[0], tree[r]), (past, r)


def rope_attention_inputs(n: int, past: int, heads: int, kv: int, d: int):
    """Random rope_attention arguments: qkv [n, (heads + 2 kv) d], rotary cos / sin [n, d], a cache of keys and
    values [kv, past + n + 3, d] and a mask [n, past + n] in which each new token sees itself."""
    qkv = torch.randn(n, (heads + 2 * kv) * d)
    angles = torch.randn(n, d // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    keys, values = torch.randn(kv, past + n + 3, d), torch.randn(kv, past + n + 3, d)
    mask = torch.rand(n, past + n) > 0.3
    mask[:, past:] |= torch.eye(n, dtype=torch.bool)
    return qkv, cos, sin, keys, values, mask


def test_rope_attention_kernel_equals_rotation_cache_writes_and_attention():
    """attention.cpp's rope_attention (the static path's layer step for few tokens) against the Python formula:
    q and k rotated (rotate-half), k and v stored at the cache slots past.., then the attention kernel."""
    from draftverify.backend.ops import rotate_half
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(1)
    for n, past, heads, kv, d in ((1, 30, 9, 3, 64), (5, 12, 4, 2, 16)):
        qkv, cos, sin, keys, values, mask = rope_attention_inputs(n, past, heads, kv, d)
        k2, v2 = keys.clone(), values.clone()
        out = kernel.rope_attention(qkv, cos, sin, keys, values, past, heads, mask, 0.3)
        x = qkv.view(n, heads + 2 * kv, d)
        qk = x[:, : heads + kv] * cos[:, None] + rotate_half(x[:, : heads + kv]) * sin[:, None]
        k2[:, past : past + n], v2[:, past : past + n] = (
            qk[:, heads:].transpose(0, 1),
            x[:, heads + kv :].transpose(0, 1),
        )
        torch.testing.assert_close(keys, k2, atol=1e-6, rtol=1e-6)
        assert torch.equal(values, v2)
        torch.testing.assert_close(
            out, kernel.attention(qk[:, :heads].contiguous(), k2, v2, past + n, mask, 0.3), atol=1e-5, rtol=1e-5
        )


def test_attention_kernels_read_and_write_an_fp16_cache_as_its_exact_float32_upcast():
    """A q8 target's cache holds fp16 keys and values: rope_attention stores each rounded to the nearest fp16 (ties
    to even, as torch's copy rounds), and attention reads them upcast exactly: the bits of the float32 kernel on the
    rounded values."""
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(2)
    for n, past, heads, kv, d in ((1, 300, 9, 3, 64), (6, 140, 4, 2, 16), (3, 20, 2, 1, 256)):
        qkv, cos, sin, keys, values, mask = rope_attention_inputs(n, past, heads, kv, d)
        half_keys, half_values = keys.half(), values.half()
        out = kernel.rope_attention(qkv, cos, sin, keys, values, past, heads, mask, 0.3)
        half_out = kernel.rope_attention(qkv, cos, sin, half_keys, half_values, past, heads, mask, 0.3)
        assert torch.equal(half_keys, keys.half()) and torch.equal(half_values, values.half())  # stored, rounded
        q = torch.randn(n, heads, d)
        assert torch.equal(
            kernel.attention(q, half_keys, half_values, past + n, mask, 0.3),
            kernel.attention(q, half_keys.float(), half_values.float(), past + n, mask, 0.3),
        )
        torch.testing.assert_close(half_out, out, atol=1e-2, rtol=1e-2)  # the same attention, on rounded keys


def test_rope_attention_rounds_cache_values_to_fp16_as_torch_does_at_the_edges():
    """The fp16 cache's rounding (F16C, 16 values at a time) is torch's: ties to even, the largest finite half, the
    overflow to infinity, subnormal halves, values below them, signed zeros."""
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    heads, kv, d = 1, 1, 64
    ties = [1 + 2**-11, 1 + 3 * 2**-11, -(2 + 2**-10), 2**-24 * 1.5, 2**-25, -(2**-25)]
    edges = [65504.0, 65519.0, 65520.0, -70000.0, 6e-8, 3e-8, 1e-9, 0.0, -0.0, 2**-14, 2**-14 - 2**-24]
    special = torch.tensor(ties + edges, dtype=torch.float32)
    values = torch.cat([special, torch.randn(d - special.numel()) * 1e-3])
    qkv = torch.randn(1, (heads + 2 * kv) * d)
    qkv[0, (heads + kv) * d :] = values
    cos, sin = torch.ones(1, d), torch.zeros(1, d)
    keys, cache = torch.zeros(kv, 4, d, dtype=torch.half), torch.zeros(kv, 4, d, dtype=torch.half)
    kernel.rope_attention(qkv, cos, sin, keys, cache, 2, heads, torch.empty(0, dtype=torch.bool), 0.125)
    expected = values.half()
    assert torch.equal(cache[0, 2].view(torch.int16), expected.view(torch.int16))  # bit for bit, zeros' signs too


def test_attention_kernel_gives_the_same_bits_on_one_thread_or_two():
    """However attention's tasks are shared out (one thread, two, or on the calling thread below the work that pays
    for a second one), every row gets the same bits: trees and steps over contexts of one to several key chunks."""
    from draftverify.kernels import cpu, unavailable

    kernel = cpu()
    if kernel is None:
        pytest.skip(unavailable())
    torch.manual_seed(4)
    threads = torch.get_num_threads()
    try:
        for n, past in ((1, 100), (1, 700), (5, 140), (16, 130), (16, 600)):
            q = torch.randn(n, 9, 64)
            keys, values = torch.randn(3, past + n, 64).half(), torch.randn(3, past + n, 64).half()
            mask = torch.rand(n, past + n) > 0.2
            mask[:, past:] = torch.eye(n, dtype=torch.bool) | (torch.rand(n, n) > 0.5).tril()
            outs = []
            for t in (1, 2):
                torch.set_num_threads(t)
                outs.append(kernel.attention(q, keys, values, past + n, mask, 0.125))
            assert torch.equal(outs[0], outs[1]), (n, past)
    finally:
        torch.set_num_threads(threads)
