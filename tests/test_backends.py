"""Forward paths: the static backend against the stock model, and sliding-window / hybrid attention
(Mistral, Qwen2 with sliding layers, Gemma 2, Gemma 3, Phi-3) through trees, selects and crops in every
backend, down to every method's greedy output and a tree path's sampling law."""

from __future__ import annotations

import random

import phrase_sampling as ps
import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHS, SLIDING_ARCHS, STATIC_ARCHS, WINDOW, make_model

from draftverify import DraftVerifyError, Engine, Loaded, Runner
from draftverify.backend import Feed
from draftverify.backend.attention import PREFILL_ROWS
from draftverify.drafters.skipsets import SkipSet
from draftverify.models import Shared, forward_many
from draftverify.sampling import Sampling

ALL_ARCHS = ARCHS + ("qwen3",) + SLIDING_ARCHS


@pytest.mark.parametrize("arch", sorted(set(ALL_ARCHS + SLIDING_ARCHS)))
def test_auto_picks_static_where_it_can_and_says_why_not(tiny, arch):
    runner = Runner(tiny(arch).model)
    if arch in STATIC_ARCHS:
        assert (runner.backend, runner.fallback_reason) == ("static", None)
    else:
        assert runner.backend == "eager" and "\n" not in runner.fallback_reason
        assert runner.model.config.model_type in runner.fallback_reason


def test_bad_backends_are_refused_in_one_line(tiny):
    with pytest.raises(DraftVerifyError, match="backend 'static' cannot run this model .*gpt2.*: use --backend eager"):
        Runner(tiny("gpt2").model, "static")
    with pytest.raises(DraftVerifyError, match="unknown backend 'fast': use one of auto, static, eager"):
        Runner(tiny("llama").model, "fast")


def plain_logits(model, seq: list[int]) -> torch.Tensor:
    """The stock model over the whole sequence, its own masks and no cache: [len(seq), V]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0]


def random_tree(rng: random.Random, root: int, size: int) -> tuple[list[int], list[int]]:
    tokens = [root] + [rng.randrange(2, 100) for _ in range(size - 1)]
    parents = [-1] + [rng.randrange(0, i) for i in range(1, size)]
    return tokens, parents


@pytest.mark.parametrize("arch", STATIC_ARCHS)
@pytest.mark.parametrize("backend", ["eager", "static"])
def test_random_trees_selects_and_crops_match_plain_forwards(tiny, arch, backend):
    """Rounds of tree forwards, a random accepted path kept with `select`, sometimes a `crop`: every
    logit of the kept path equals the stock model's over the whole sequence (windows of 6 tokens
    against sequences of up to 40, so the windows bite; the static cache's in-place gather and the
    dynamic cache's rebuild are both checked against the same ground truth)."""
    if backend == "static" and arch not in STATIC_ARCHS:
        pytest.skip("no static path for this architecture")
    model = tiny(arch).model
    runner = Runner(model, backend)
    rng = random.Random(arch + backend)
    seq = [rng.randrange(2, 100) for _ in range(9)]  # the runner holds all but the last token (the root)
    runner.forward(seq[:-1])
    for _ in range(10):
        tokens, parents = random_tree(rng, seq[-1], rng.randint(1, 7))
        depth, mask = [0] * len(tokens), torch.eye(len(tokens), dtype=torch.bool)
        for i in range(1, len(tokens)):
            depth[i] = depth[parents[i]] + 1
            mask[i] |= mask[parents[i]]
        base = runner.length
        logits = runner.forward(tokens, positions=torch.tensor(depth) + base, tree_mask=mask).logits
        path, node = [], rng.randrange(len(tokens))
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        kept = seq[:-1] + [tokens[i] for i in path]
        torch.testing.assert_close(logits[path], plain_logits(model, kept)[-len(path) :], atol=1e-4, rtol=1e-4)
        runner.select(base, [base + i for i in path])
        seq = kept + [rng.randrange(2, 100)]
        if rng.random() < 0.3:
            back = rng.randint(1, 3)
            runner.crop(runner.length - back)
            seq = seq[: len(seq) - back]
        assert runner.length == len(seq) - 1
    assert len(seq) > 3 * WINDOW


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_rotary_rows_come_from_tables_with_the_modules_bits_for_any_positions(tiny, arch):
    """A forward's cos and sin are rows of tables the rotary module made once (grown past their size): each row is
    what the module gives that position in a call of its own, and in a call of many."""
    dec = Runner(tiny(arch).model, "static").decoder
    assert dec._rope_fixed
    dec._ropes(torch.tensor([3]))
    assert dec._rope_table_size == dec.max_length == 512  # within the model's positions, no larger
    rng = random.Random(3)
    for positions in ([0], [5, 6, 7], list(range(40, 73)), [rng.randrange(5000) for _ in range(9)], [4097, 12]):
        ids = torch.tensor(positions)
        got, alone = dec._ropes(ids), [dec._rotary(torch.tensor([p])) for p in positions]
        for key, (cos, sin) in dec._rotary(ids).items():
            assert torch.equal(got[key][0][:, 0], cos[0]) and torch.equal(got[key][1][:, 0], sin[0])
            assert torch.equal(cos[0], torch.cat([a[key][0][0] for a in alone]))
    assert dec._rope_table_size == 8192  # 512 (the model's positions) at first, doubled past 5000 to hold 4097


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_static_cache_grows_and_resets(tiny, arch):
    model = tiny(arch).model
    runner = Runner(model, "static")
    seq = [random.Random(1).randrange(2, 100) for _ in range(300)]
    dec, rows = runner.decoder, []
    kernel = dec.attention_kernel
    if runner.static.layers[0].softcap is not None:  # Gemma 2's capped scores: `attention.capped`, not the kernel
        kernel = None
    if kernel is not None:  # a prefill's attention: a kernel (rope_attention, or attention after a q/k norm),
        for name in ("attention_kernel", "rope_attention"):  # PREFILL_ROWS query rows a call
            call = getattr(dec, name)
            if call is not None:
                setattr(dec, name, lambda q, *rest, call=call: rows.append(q.shape[0]) or call(q, *rest))
    runner.forward(seq[:200])
    assert kernel is None or set(rows) == {PREFILL_ROWS, 200 - PREFILL_ROWS}
    first = runner.cache.capacity
    got = runner.forward(seq[200:]).logits  # past the first 256 slots: the buffers double
    assert runner.cache.capacity > first and runner.length == 300
    torch.testing.assert_close(got, plain_logits(model, seq)[200:], atol=1e-4, rtol=1e-4)
    runner.reset()
    assert runner.length == 0
    torch.testing.assert_close(runner.forward(seq[:5]).logits, plain_logits(model, seq[:5]), atol=1e-4, rtol=1e-4)


def test_runners_of_one_engine_share_packed_weights_and_two_engines_do_not(tiny):
    target = tiny("llama")
    shared = Shared()
    a, b = Runner(target.model, "static", shared=shared), Runner(target.model, "static", shared=shared)
    assert a.static.layers[0].qkv is b.static.layers[0].qkv and a.static.head is b.static.head
    assert a.fork().decoder is a.decoder
    a.forward([5, 6, 7])
    assert b.length == 0 and a.fork().length == 0  # each runner has its own cache
    one, two = Engine(target, backend="static"), Engine(target, backend="static")
    assert one.slot(1)[0].static.layers[0].qkv is one.target_runner.static.layers[0].qkv
    assert one.target_runner.static.layers[0].qkv is not two.target_runner.static.layers[0].qkv


def test_a_draft_multiplies_with_rounded_copies_and_its_target_keeps_its_own_weights(tiny):
    """Rounding is for drafts only: an fp32 draft gets Q8_0 blocks (in the q8 tiles with AVX-512 VNNI), the fp32
    target none, and a runner of the same model as a target (self-speculative, the target itself) does not share the
    draft's copies."""
    from draftverify.kernels import cpu, unavailable
    from draftverify.kernels.quant import q8_blocks

    if cpu() is None:
        pytest.skip(unavailable())
    target, draft = tiny("llama"), tiny("llama", seed=1, layers=2)
    engine = Engine(target, draft, backend="static")
    drafting, verifying = engine.draft_runner.static.layers[0].qkv, engine.target_runner.static.layers[0].qkv
    assert drafting.blocks.kind == "q8_0" and verifying.blocks is None
    assert (drafting.q8 is not None) == cpu().vnni()  # VNNI: the q8 tiles at every row count
    assert drafting.q8 is None or drafting.weight is None  # and then no fp32 copy
    assert Runner(draft.model, "static").static.layers[0].qkv.blocks is None
    w = torch.randn(8, 64)
    rebuilt = q8_blocks(w).dequantize()
    assert (rebuilt - w).abs().max() <= w.abs().max() / 254 + 1e-6  # half a step of the block's scale


PROMPTS = ["Hello there, how are you doing", "def f(x):\n    return f(x - 1) + f(x - 2)"]
METHODS = [("speculative", None), ("lookahead", None), ("lookahead", "context"), ("ouroboros", None)]


@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_every_method_on_every_backend_matches_eager_autoregressive(tiny, arch):
    """Greedy tokens of each method, on each backend the architecture has, equal plain autoregressive
    decoding on the stock model (and the static backend's own autoregressive decoding)."""
    target, draft = tiny(arch), tiny(arch, seed=1, layers=2)
    backends = ["eager", "static"] if arch in STATIC_ARCHS else ["eager"]
    reference = Engine(target, draft, backend="eager")
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        assert len(ids) > WINDOW
        ar = reference.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[]).tokens
        for backend in backends:
            engine = Engine(target, draft, backend=backend)
            runs = METHODS + [("autoregressive", None), ("self-speculative", None)]
            for method, preset in runs:
                options = {"strategy": "heuristic"} if method == "self-speculative" else {}
                out = engine.generate(ids, method=method, preset=preset, max_new_tokens=30, eos_token_id=[], **options)
                assert out.tokens == ar, (arch, backend, method, preset, prompt)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_tree_sampling_on_sliding_models_matches_the_target(tokenizer, arch):
    """Multi-draft rejection sampling through tree-masked forwards on a model whose window (2 tokens)
    is shorter than the prompt: the first three tokens follow the target's exact law (chi-square).
    Both run on the static backend (Gemma 3: hybrid sliding and global layers, q/k norms)."""
    model = make_model(arch, 0, layers=2, hidden=32, vocab=ps.VOCAB, window=2)
    target = Loaded(model, tokenizer, f"tiny-{arch}")
    counts = ps.sample_first_three(Engine(target), "lookahead", ps.guess_pool(3, 3), W=2, N=3, G=3, reuse=True)
    assert ps.pvalue(counts, ps.exact_first_three(model)) > 1e-3


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


def quantized(w: torch.Tensor, kind: str) -> torch.Tensor:
    """`w` rounded as llama.cpp quantizes it (Q4_1 or Q8_0 blocks of 32, fp16 scales), dequantized to fp32."""
    b = w.reshape(w.shape[0], -1, 32)
    if kind == "q8_0":
        d = (b.abs().amax(-1) / 127).half().float()
        return (torch.round(b / d.clamp_min(1e-30)[..., None]).clamp(-127, 127) * d[..., None]).reshape(w.shape)
    lo = b.amin(-1)
    d, m = ((b.amax(-1) - lo) / 15).half().float(), lo.half().float()
    q = torch.round((b - lo[..., None]) / d.clamp_min(1e-30)[..., None]).clamp(0, 15)
    return (q * d[..., None] + m[..., None]).reshape(w.shape)


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


def gguf_style_llama():
    """A tiny Llama whose weights are exact Q4_1 (layers) and Q8_0 (embeddings, tied head) blocks, as a GGUF model
    loads."""
    model = make_model("llama", 0, layers=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(quantized(p, "q8_0" if "embed" in name or "lm_head" in name else "q4_1"))
    return model


def test_sampling_through_the_quantized_product_and_kernels_matches_the_target(tokenizer, monkeypatch):
    """Sampled speculative decoding on a GGUF-style model (the quantized product and the rope/attention kernels
    for every forward; a Q8_0 draft) draws the second token from the target's exact law; the classic wrong
    rule is caught."""
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    target, sharper = Loaded(gguf_style_llama(), tokenizer, "tiny-q4"), gguf_style_llama()
    with (
        torch.no_grad()
    ):  # a draft close to the target but not it: q = p at a lower temperature, so guesses hit and miss
        sharper.model.norm.weight.mul_(3.0)
    engine = Engine(target, Loaded(sharper, tokenizer, "tiny-q4-sharper"), backend="static")
    assert (
        engine.target_runner.static.layers[0].qkv.blocks is not None
        and engine.target_runner.static.rope_attention is not None
    )
    sampling, prompt = Sampling(temperature=1.0, top_k=6), [5, 9, 14]

    def pvalue():
        counts: dict[int, int] = {}
        for seed in range(2500):
            r = engine.generate(
                prompt,
                method="speculative",
                max_new_tokens=3,
                temperature=1.0,
                top_k=6,
                seed=seed,
                eos_token_id=[],
                k=1,
                policy="constant",
            )
            counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
        return ps.second_token_pvalue(target.model, prompt, sampling, counts)

    assert pvalue() > 1e-3
    ps.broken_rule(monkeypatch)
    assert pvalue() < 1e-4


def test_a_stacked_forward_gives_each_sequence_of_a_quantized_model_its_own_bits():
    """Batched serving stacks one request's prefill (oneDNN) with others' decoding steps and trees (the
    quantized product): every sequence's logits and cache are bit for bit what its forward alone gives."""
    from draftverify.backend.linear import QUANT_ROWS
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    model = gguf_style_llama()
    prompts = [list(range(3, 3 + QUANT_ROWS + 9)), [5, 9, 14], [8] * 7]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [
        [{"tokens": p} for p in prompts],  # three prefills, one long
        [
            {"tokens": [11]},
            {"tokens": list(range(20, 20 + QUANT_ROWS + 3))},
            {"tokens": [12, 13, 14], "tree_mask": tree, "positions": torch.tensor([7, 8, 8])},
        ],  # a decoding step, a long chunk, a tree
        [{"tokens": [30 + i for i in range(QUANT_ROWS - 1)]}, {"tokens": [40, 41]}, {"tokens": [42]}],
    ]  # short, over 32 together
    alone, stacked = [Runner(model, "static") for _ in prompts], [Runner(model, "static") for _ in prompts]
    assert_stacked_is_alone(alone, stacked, steps)


def assert_stacked_is_alone(alone: list, stacked: list, steps: list[list[dict]]) -> None:
    """Each step's feeds (one per sequence) run alone on `alone`'s runners and stacked in one forward on
    `stacked`'s: the same logits, and at the end the same caches, bit for bit."""
    for feeds in steps:
        want = [r.forward(**f) for r, f in zip(alone, feeds)]
        got = forward_many(stacked, [Feed(**f) for f in feeds])
        for r, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w.logits, g.logits), (feeds, r)
    for a, b in zip(alone, stacked):
        for (ka, va), (kb, vb) in zip(a.cached_kv(), b.cached_kv()):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_one_call_layer_gives_the_op_by_op_layers_bits(monkeypatch):
    """A short forward of one sequence runs each layer in one kernel call (`layer`); its logits and cache are
    bit for bit those of the op-by-op layers (prefill, decoding step, tree, a step with sub-layers skipped)."""
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    model = gguf_style_llama()
    fused, plain = Runner(model, "static"), Runner(model, "static")
    calls = []
    monkeypatch.setattr(fused.static, "layer_kernel", lambda *a: calls.append(1) or cpu().layer(*a))
    for layer in plain.static.layers:
        layer.fused = None
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for feed in (
        {"tokens": [3, 17, 5, 9, 14, 2]},
        {"tokens": [11]},
        {"tokens": [12, 13, 14], "tree_mask": tree, "positions": torch.tensor([7, 8, 8])},
    ):
        assert torch.equal(fused.forward(**feed).logits, plain.forward(**feed).logits), feed
    assert len(calls) == 3 * len(model.model.layers)
    skip = SkipSet(attention=(0,), mlp=(1,))  # self-speculative drafting: the layers it leaves whole take the one call
    assert torch.equal(fused.forward([21], skip=skip).logits, plain.forward([21], skip=skip).logits)
    assert len(calls) == 4 * len(model.model.layers) - 2
    for (ka, va), (kb, vb) in zip(fused.cached_kv(), plain.cached_kv()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_a_gguf_style_quantized_model_runs_its_few_row_forwards_on_the_quantized_product(tiny, tokenizer):
    """A tiny Llama whose weights are exact Q4_1 (layers) and Q8_0 (embeddings, tied head) blocks, as a GGUF
    model loads: the static path multiplies few rows with the blocks and every method stays token-identical."""
    from draftverify.backend.linear import QUANT_ROWS
    from draftverify.kernels import cpu, unavailable

    if cpu() is None:
        pytest.skip(unavailable())
    model = gguf_style_llama()
    target = Loaded(model, tokenizer, "tiny-q4")
    static = Runner(model, "static").static
    assert static.layers[0].gate_up.blocks.kind == "q4_1" and static.head.blocks.kind == "q8_0"
    draft = tiny("llama", seed=1, layers=2)  # plain fp32: on oneDNN
    reference = Engine(target, draft, backend="eager")
    engine = Engine(target, draft, backend="static")
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        ar = reference.generate(ids, method="autoregressive", max_new_tokens=30, eos_token_id=[]).tokens
        for method, preset in METHODS + [("autoregressive", None)]:
            assert engine.generate(ids, method=method, preset=preset, max_new_tokens=30, eos_token_id=[]).tokens == ar
    runner = Runner(model, "static")
    ids = (reference.encode(" ".join(PROMPTS)) * 3)[: 2 * QUANT_ROWS + 5]
    logits = runner.forward(ids).logits  # many rows: oneDNN
    runner.crop(0)
    runner.forward(ids[:-QUANT_ROWS])
    few = runner.forward(ids[-QUANT_ROWS:]).logits  # the last rows again, on the quantized product
    torch.testing.assert_close(few, logits[-QUANT_ROWS:], atol=1e-4, rtol=1e-4)
