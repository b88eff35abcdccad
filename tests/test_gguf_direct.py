"""GGUF targets read straight from the file (loading/gguf_weights.py, gguf_model.py; backend/source.py, BlockLinear).

A tiny random Llama-family GGUF written here with gguf.GGUFWriter holds K-quant (Q4_K, Q6_K) and other block tensors
(random raw blocks). The stock transformers model of the same weights (gguf's dequantization, q and k rows permuted
as transformers' GGUF loader permutes them: what the old conversion path loads) is the reference: the direct static
path's logits match its full-sequence forward, every method is token-identical to autoregressive, and sampled
tokens follow the target's law (chi-square)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from phrase_sampling import second_token_pvalue
from test_quant_formats import HALVES

from draftverify import Engine
from draftverify.loading import Loaded, load_draft_source
from draftverify.loading.gguf_model import GGUFModel
from draftverify.loading.gguf_weights import GGUFWeights
from draftverify.models import Runner
from draftverify.sampling import Sampling

HIDDEN, FFN, HEADS, KV, LAYERS = 256, 512, 4, 2, 2  # K-quants need rows of whole 256-weight super-blocks
# Per layer, the type of each weight: Q4_K_M-like (q, k, gate in Q4_K; v, down in Q6_K) plus the other families.
LAYER_TYPES = [
    {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q5_0, "ffn_gate": T.Q4_K,
     "ffn_up": T.Q8_0, "ffn_down": T.Q6_K},
    {"attn_q": T.Q5_K, "attn_k": T.Q3_K, "attn_v": T.Q2_K, "attn_output": T.F16, "ffn_gate": T.Q4_0,
     "ffn_up": T.Q5_1, "ffn_down": T.BF16},
]  # fmt: skip
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV * 64, HIDDEN), "attn_v": (KV * 64, HIDDEN)}
SHAPES |= {"attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN)}
SHAPES |= {"ffn_down": (HIDDEN, FFN)}


def raw_blocks(rng, kind: int, out: int, k: int) -> np.ndarray:
    """uint8 [out, row bytes]: random codes and small fp16 scales of either sign (F16 / BF16: small weights)."""
    if kind in (T.F16, T.BF16):
        return gq.quantize((rng.standard_normal((out, k)) * 0.05).astype(np.float32), T(kind)).view(np.uint8)
    block, size = GGML_QUANT_SIZES[T(kind)]
    raw = rng.integers(0, 256, (out * (k // block), size), dtype=np.uint8)
    for at in HALVES[kind]:
        scale = (rng.uniform(1e-4, 2e-3, raw.shape[0]) * rng.choice([-1.0, 1.0], raw.shape[0])).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(out, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, tokenizer):
    """(path, {name: (raw, type)}): the tiny file and what it holds."""
    return write_file(tmp_path_factory.mktemp("gguf") / "tiny.gguf", LAYER_TYPES, len(tokenizer))


def write_file(path, layer_types: list[dict], vocab: int):
    """A tiny file with these layers' weight types: (path, {name: (raw, type)})."""
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (raw_blocks(rng, T.Q6_K, vocab, HIDDEN), T.Q6_K)}
    tensors["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32), T.F32)
    for i, types in enumerate(layer_types):
        for name, kind in types.items():
            tensors[f"blk.{i}.{name}.weight"] = (raw_blocks(rng, kind, *SHAPES[name]), kind)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32), T.F32)
    finish(GGUFWriter(str(path), "llama"), tensors)
    return path, tensors


def finish(w: GGUFWriter, tensors: dict) -> None:
    """Add `tensors` (name -> (data, GGML type); F32 as floats, every other type as its raw blocks) and write
    the file."""
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=None if kind == T.F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def config_for(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=512, rms_norm_eps=1e-5, attn_implementation="sdpa",
    )  # fmt: skip


@pytest.fixture(scope="module")
def direct(gguf_file, tokenizer):
    from transformers import GenerationConfig

    config = config_for(tokenizer)
    model = GGUFModel(GGUFWeights(gguf_file[0], config, tokenizer), GenerationConfig.from_model_config(config))
    return Loaded(model, tokenizer, name="tiny.gguf", source=gguf_file[0])


@pytest.fixture(scope="module")
def stock(gguf_file, tokenizer):
    """The stock model of the same weights, as transformers' GGUF loader builds them (dequantized, q/k permuted)."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = config_for(tokenizer)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV})
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
    names |= {"attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}
    names |= {"ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    state = {}
    for name, (data, kind) in gguf_file[1].items():
        w = data if kind == T.F32 else gq.dequantize(data, T(kind)).astype(np.float32)
        w = processor.process(w, name).weights
        if name.startswith("blk."):
            _, i, part, _ = name.split(".")
            state[f"model.layers.{i}.{names[part]}.weight"] = torch.from_numpy(np.array(w))
        else:
            state[
                {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}[name]
            ] = torch.from_numpy(np.array(w))
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return Loaded(model, tokenizer, name="tiny-stock")


def test_weights_are_the_files_blocks_not_an_fp32_copy(direct):
    decoder = Runner(direct.model).static
    assert decoder is not None
    layouts = {w.layout for layer in decoder.layers for lin in (layer.qkv, layer.down) for w in lin.parts}
    assert {"u4", "u8", "f16", "bf16"} & layouts and "f32" not in layouts
    assert [w.type_name for w in decoder.layers[0].qkv.parts] == ["Q4_K", "Q6_K"]  # q|k fused, v in its own layout


def test_direct_path_matches_the_stock_model(direct, stock):
    seq = [5, 9, 3, 17, 2, 44, 8, 1, 30, 12]
    runner = Runner(direct.model)
    got = torch.cat([runner.forward(seq[:6]).logits, *(runner.forward([t]).logits for t in seq[6:])])
    want = stock.model(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert direct.identity == stock.identity  # the shipped heads' fingerprint: the same value either way


@pytest.mark.parametrize("arithmetic", ["fp32", "q8"])
def test_the_one_call_layer_gives_the_op_by_op_layers_bits(direct, arithmetic, monkeypatch):
    """A short forward of one sequence runs each layer of the file's blocks in one kernel call (every block type,
    F16 and BF16 of this file, in either arithmetic); logits and cache are bit for bit the op-by-op layers'."""
    from draftverify.backend.linear import Packs
    from draftverify.kernels import cpu, unavailable
    from draftverify.models import Shared

    if cpu() is None:
        pytest.skip(unavailable())
    fused, plain = (Runner(direct.model, shared=Shared(packs=Packs(arithmetic))) for _ in range(2))
    calls = []
    monkeypatch.setattr(fused.static, "layer_kernel", lambda *a: calls.append(1) or cpu().layer(*a))
    assert all(layer.fused is not None for layer in fused.static.layers)
    plain.static.layers = [replace(layer, fused=None) for layer in plain.static.layers]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for feed in ({"tokens": [3, 17, 5, 9, 14, 2]}, {"tokens": [11]}, {"tokens": [12, 13, 14], "tree_mask": tree}):
        assert torch.equal(fused.forward(**feed).logits, plain.forward(**feed).logits), feed
    assert len(calls) == 3 * LAYERS
    for (ka, va), (kb, vb) in zip(fused.cached_kv(), plain.cached_kv()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_k_quant_layers_in_one_call_give_the_op_by_op_bits(tmp_path, tokenizer):
    """A file whose every layer is Q4_K_M-like (q|k and v, gate and up: runs of two block types a product): in q8 a
    short forward runs all its layers in one call (`LayerStack`, each product's runs side by side), with the logits
    and cache of a layer a call and of the op-by-op layers, on one thread or two."""
    from transformers import GenerationConfig

    from draftverify.backend.linear import Packs
    from draftverify.kernels import cpu, unavailable
    from draftverify.models import Shared

    if cpu() is None:
        pytest.skip(unavailable())
    path, _ = write_file(tmp_path / "kquant.gguf", [LAYER_TYPES[0]] * LAYERS, len(tokenizer))
    config = config_for(tokenizer)
    model = GGUFModel(GGUFWeights(path, config, tokenizer), GenerationConfig.from_model_config(config))
    threads = torch.get_num_threads()
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    feeds = [{"tokens": [3, 17, 5, 9, 14, 2] * 25}, {"tokens": [11]}, {"tokens": [12, 13, 14], "tree_mask": tree}]
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            stacked, layered, plain = (Runner(model, shared=Shared(packs=Packs("q8"))) for _ in range(3))
            assert stacked.static.stack is not None and len(stacked.static.layers[0].fused[0]) == 9  # q|k, v: 2 runs
            layered.static.stack = plain.static.stack = None
            plain.static.layers = [replace(layer, fused=None) for layer in plain.static.layers]
            for feed in feeds:
                want = plain.forward(**feed).logits
                for runner in (stacked, layered):
                    assert torch.equal(runner.forward(**feed).logits, want), (t, feed)
            for runner in (stacked, layered):
                for (ka, va), (kb, vb) in zip(runner.cached_kv(), plain.cached_kv()):
                    assert torch.equal(ka, kb) and torch.equal(va, vb)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("arithmetic", ["fp32", "q8"])
def test_a_stacked_batch_step_gives_each_sequence_its_own_bits(direct, arithmetic):
    """A batch's decoding steps and trees stacked in one forward (each layer one `layer_many` call) give every
    sequence the logits and cache its forward alone gives (one `layer` call a layer)."""
    from quantized_models import assert_stacked_is_alone

    from draftverify.backend.linear import Packs
    from draftverify.models import Shared

    make = lambda: Runner(direct.model, shared=Shared(packs=Packs(arithmetic)))  # noqa: E731
    prompts = [[3, 17, 5, 9], [5, 9, 14], [8] * 7]
    alone, stacked = [make() for _ in prompts], [make() for _ in prompts]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [
        [{"tokens": p} for p in prompts],
        [{"tokens": [11]}, {"tokens": [12, 13, 14], "tree_mask": tree, "positions": torch.tensor([3, 4, 4])},
         {"tokens": [20, 21]}],
    ]  # fmt: skip
    assert_stacked_is_alone(alone, stacked, steps)


def test_every_method_is_token_identical_to_autoregressive(direct):
    draft = load_draft_source("self:layers=1", direct)
    engine = Engine(direct, draft, backend="static")
    assert engine.target_runner.backend == "static" and engine.draft_runner.backend == "static"
    for prompt in ["Hello there, how are you doing", "def f(x):\n    return f(x - 1) + f(x - 2)"]:
        ids = engine.encode(prompt)
        ar = engine.generate(ids, method="autoregressive", max_new_tokens=24, eos_token_id=[]).tokens
        for method, preset in [("speculative", None), ("lookahead", None), ("lookahead", "context"),
                               ("ouroboros", None), ("prompt-lookup", None), ("self-speculative", None),
                               ("auto", None)]:  # fmt: skip
            options = {"strategy": "heuristic"} if method == "self-speculative" else {}
            out = engine.generate(ids, method=method, preset=preset, max_new_tokens=24, eos_token_id=[], **options)
            assert out.tokens == ar, (method, preset, prompt)


def test_sampling_follows_the_targets_law(direct, stock):
    """The second token (the first that goes through verification) follows sum_x1 p(x1) p(x2 | x1)."""
    engine = Engine(direct, load_draft_source("self:layers=1", direct), backend="static")
    prompt, sampling, counts = [5, 6, 7], Sampling(temperature=1.0, top_k=8), {}
    for seed in range(2000):
        r = engine.generate(prompt, method="speculative", max_new_tokens=3, temperature=1.0, top_k=8, seed=seed,
                            eos_token_id=[], policy="constant", k=3)  # fmt: skip
        counts[r.tokens[1]] = counts.get(r.tokens[1], 0) + 1
    assert second_token_pvalue(stock.model, prompt, sampling, counts) > 1e-3


@pytest.mark.parametrize("arithmetic", ["fp32", "q8"])
def test_a_long_prompt_beside_decoding_requests_runs_in_parts_and_changes_no_bit(direct, arithmetic, monkeypatch):
    """A prompt longer than `prompt_part` that joins a batch while another request decodes is fed a part a step;
    its logits, every row's final hidden state and its cache are bit for bit a whole prefill's, and the other
    request gets a token every step."""
    from draftverify import batch as batch_module
    from draftverify.backend.feed import Feed
    from draftverify.backend.linear import Packs
    from draftverify.batch import Batch
    from draftverify.models import Shared

    make = lambda: Runner(direct.model, shared=Shared(packs=Packs(arithmetic)))  # noqa: E731
    part = 128
    alone, parted, other = make(), make(), make()
    assert parted.rows_alone
    prompt = [int(t) for t in torch.randint(2, 80, (2 * part + 37,), generator=torch.Generator().manual_seed(0))]
    whole = alone.forward(prompt, last=1, hidden="all")

    def prefill(box):
        box.append((yield Feed(prompt, last=1, hidden="all")))

    def decoding(box):
        out = yield Feed([3, 17, 5])
        while len(box) < 8:
            box.append(out)
            out = yield Feed([int(out.logits[-1].argmax())])

    sizes = []
    spied = batch_module.forward_many
    monkeypatch.setattr(
        batch_module,
        "forward_many",
        lambda runners, feeds: sizes.append([f.size for f in feeds]) or spied(runners, feeds),
    )
    got, steps = [], []
    batch = Batch(prompt_part=part)
    batch.add(SimpleNamespace(), other, decoding(steps))
    batch.step()
    batch.add(SimpleNamespace(), parted, prefill(got))
    while batch.members:
        batch.step()
    assert sizes[1:4] == [[1, part], [1, part], [1, 37]]  # a part a step, a token for the other each
    assert torch.equal(got[0].logits, whole.logits) and torch.equal(got[0].hidden, whole.hidden)
    for (ka, va), (kb, vb) in zip(parted.cached_kv(), alone.cached_kv()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    sizes.clear()  # with nobody decoding, prompts run whole: parts would only delay them
    both = Batch(prompt_part=part)
    for runner in (make(), make()):
        both.add(SimpleNamespace(), runner, prefill([]))
    both.step()
    assert sizes == [[len(prompt), len(prompt)]]
