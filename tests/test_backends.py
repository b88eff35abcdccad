"""Forward paths: the static backend against the stock model, and sliding-window / hybrid attention
(Mistral, Qwen2 with sliding layers, Gemma 2, Gemma 3, Phi-3) through trees, selects and crops in every
backend, down to every method's greedy output and a tree path's sampling law."""

from __future__ import annotations

import random

import phrase_sampling as ps
import pytest
import torch
from conftest import ARCHS, SLIDING_ARCHS, STATIC_ARCHS, WINDOW, make_model

from draftverify import DraftVerifyError, Engine, Loaded, Runner
from draftverify.backend.attention import PREFILL_ROWS
from draftverify.models import Shared

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
    assert dec.rope_fixed
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
