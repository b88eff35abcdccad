"""Gemma 2, Gemma 3 and Phi-3 GGUF files read straight from the file (loading/gguf_weights.py's per-architecture
tables, backend/source.py), against transformers' own module loaded from the same file.

Tiny random files are written here with gguf.GGUFWriter (the architecture's metadata as llama.cpp writes it; block
tensors of random raw blocks, `test_gguf_direct.raw_blocks`): Gemma's norms stored as w + 1 and its tied, scaled
embedding, Gemma 2's soft-capping and alternating sliding / global layers, Gemma 3's per-head q/k norms, its two
rotary bases and head_dim 256, Phi-3's fused attn_qkv and gate|up ffn_up. The reference is
`AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`: the direct path holds its weights bit for bit, its
logits match the stock full-sequence forward, and speculative decoding is token-identical to autoregressive.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as T
from phrase_sampling import broken_rule, second_token_law, second_token_pvalue
from test_auto import Guess
from test_gguf_direct import finish, raw_blocks

from draftverify import Engine
from draftverify.loading import Loaded, gguf_model, load_draft_source
from draftverify.loading.gguf_model import GGUFModel
from draftverify.loading.gguf_weights import GGUFWeights
from draftverify.loading.hf import direct_gguf
from draftverify.models import Runner
from draftverify.round import decode
from draftverify.sampling import Sampling
from draftverify.session import Session, Stopping

VOCAB = 100  # the character tokenizer of conftest (its ids stay below it)
# Per architecture: hidden, ffn, heads, kv heads, head_dim, layers, and each tensor's block type.
ARCHS = {
    # head_dim 32 != hidden / heads; attn_output's rows of 128 weights: no K-quant (256 a super-block)
    "gemma2": dict(hidden=256, ffn=512, heads=4, kv=2, head_dim=32, layers=3, window=4,
                   types={"attn_q": T.Q4_K, "attn_k": T.Q8_0, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
                          "ffn_gate": T.Q4_K, "ffn_up": T.F16, "ffn_down": T.Q6_K}),
    # head_dim 256 (Gemma's own); six layers: five sliding, one global (transformers' default pattern)
    "gemma3": dict(hidden=256, ffn=512, heads=2, kv=1, head_dim=256, layers=6, window=4,
                   types={"attn_q": T.Q5_K, "attn_k": T.Q4_K, "attn_v": T.Q8_0, "attn_output": T.Q6_K,
                          "ffn_gate": T.Q8_0, "ffn_up": T.Q4_K, "ffn_down": T.BF16}),
    "phi3": dict(hidden=256, ffn=512, heads=4, kv=4, head_dim=64, layers=2, window=None,
                 types={"attn_qkv": T.Q4_K, "attn_output": T.Q6_K, "ffn_up": T.Q8_0, "ffn_down": T.Q5_K}),
}  # fmt: skip


def shapes(a: dict) -> dict:
    """[out, in] of each layer tensor (Phi-3: q|k|v rows in attn_qkv, gate|up rows in ffn_up)."""
    q, kv = a["heads"] * a["head_dim"], a["kv"] * a["head_dim"]
    return {
        "attn_q": (q, a["hidden"]), "attn_k": (kv, a["hidden"]), "attn_v": (kv, a["hidden"]),
        "attn_qkv": (q + 2 * kv, a["hidden"]), "attn_output": (a["hidden"], q), "ffn_gate": (a["ffn"], a["hidden"]),
        "ffn_up": ((2 if "attn_qkv" in a["types"] else 1) * a["ffn"], a["hidden"]), "ffn_down": (a["hidden"], a["ffn"]),
    }  # fmt: skip


def norms(arch: str, a: dict) -> dict:
    """Each layer's norms by GGUF name -> length."""
    found = {"attn_norm": a["hidden"], "ffn_norm": a["hidden"]}
    if arch.startswith("gemma"):
        found |= {"post_attention_norm": a["hidden"], "post_ffw_norm": a["hidden"]}
    if arch == "gemma3":
        found |= {"attn_q_norm": a["head_dim"], "attn_k_norm": a["head_dim"]}
    return found


def write_tiny(path, arch: str, seed: int = 0) -> None:
    """A tiny random `arch` GGUF at `path`, its metadata the keys llama.cpp writes and transformers reads."""
    a, rng = ARCHS[arch], np.random.default_rng(seed)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731 (Gemma: stored as w + 1)
    tensors = {"token_embd.weight": (raw_blocks(rng, T.Q8_0, VOCAB, a["hidden"]), T.Q8_0)}
    tensors["output_norm.weight"] = (norm(a["hidden"]), T.F32)
    if arch == "phi3":  # an untied head
        tensors["output.weight"] = (raw_blocks(rng, T.Q6_K, VOCAB, a["hidden"]), T.Q6_K)
    for i in range(a["layers"]):
        for name, kind in a["types"].items():
            tensors[f"blk.{i}.{name}.weight"] = (raw_blocks(rng, kind, *shapes(a)[name]), kind)
        for name, n in norms(arch, a).items():
            tensors[f"blk.{i}.{name}.weight"] = (norm(n), T.F32)
    w = GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_block_count(a["layers"])
    w.add_feed_forward_length(a["ffn"])
    w.add_embedding_length(a["hidden"])
    w.add_head_count(a["heads"])
    w.add_head_count_kv(a["kv"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1e6)  # Gemma 3's local layers keep 10000
    w.add_vocab_size(VOCAB)
    w.add_pad_token_id(0)
    w.add_eos_token_id(0)
    if arch.startswith("gemma"):
        w.add_key_length(a["head_dim"])
        w.add_value_length(a["head_dim"])
        w.add_sliding_window(a["window"])
    finish(w, tensors)


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory, tokenizer):
    """(direct, stock): the file on the direct path, and transformers' module loaded from the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = tmp_path_factory.mktemp(request.param)
    write_tiny(folder / "tiny.gguf", request.param)
    config = AutoConfig.from_pretrained(folder, gguf_file="tiny.gguf")
    stock = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32)
    stock = stock.eval().requires_grad_(False)
    model = GGUFModel(GGUFWeights(folder / "tiny.gguf", config, tokenizer), GenerationConfig.from_model_config(config))
    return Loaded(model, tokenizer, name="tiny.gguf", source=folder / "tiny.gguf"), Loaded(stock, tokenizer, "stock")


def test_direct_path_holds_the_stock_modules_weights_bit_for_bit(pair, monkeypatch):
    direct, stock = pair
    monkeypatch.setattr(gguf_model, "KEPT_ROWS", 3)  # the kept rows start over within the lookups below
    decoder, inner = Runner(direct.model).static, stock.model.model
    assert decoder is not None and "f32" not in {w.layout for layer in decoder.layers for w in layer.qkv.parts}
    for ours, theirs in zip(decoder.layers, inner.layers):
        attn, mlp = theirs.self_attn, theirs.mlp
        qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
        pairs = [(ours.qkv, qkv), (ours.o, [attn.o_proj]), (ours.gate_up, gate_up), (ours.down, [mlp.down_proj])]
        for lin, modules in pairs:
            assert torch.equal(torch.cat([w.dequantize() for w in lin.parts]), torch.cat([m.weight for m in modules]))
        offset = 1.0 if hasattr(theirs, "pre_feedforward_layernorm") else 0.0  # Gemma's RMSNorm scales by 1 + w
        want_in = theirs.input_layernorm.weight + offset
        assert torch.equal(ours.norm_in, want_in)
        if offset:
            assert torch.equal(ours.norm_mlp, theirs.pre_feedforward_layernorm.weight + 1)
            assert torch.equal(ours.norm_attn_out[0], theirs.post_attention_layernorm.weight + 1)
            assert torch.equal(ours.norm_mlp_out[0], theirs.post_feedforward_layernorm.weight + 1)
        if hasattr(attn, "q_norm"):
            assert torch.equal(ours.q_norm[0], attn.q_norm.weight + 1) and torch.equal(
                ours.k_norm[0], attn.k_norm.weight + 1
            )
        assert ours.scaling == attn.scaling and ours.softcap == getattr(attn, "attn_logit_softcapping", None)
    embed, ids = direct.model.get_input_embeddings(), torch.tensor([3, 7, 0, 42])
    assert torch.equal(embed(ids), inner.embed_tokens(ids))  # Gemma: scaled, fp32
    long = torch.arange(gguf_model.FEW_IDS + 1) % embed.num_embeddings  # dequantized in one go, not kept
    assert torch.equal(embed(long), inner.embed_tokens(long))
    for few in ([7], [7, 7, 3], [42, 5, 7]):  # kept rows, read again: the same bits
        rows = embed(torch.tensor(few))
        assert torch.equal(rows, inner.embed_tokens(torch.tensor(few)))
        rows += 1  # the caller's own tensor: the kept rows stay as they were
    assert torch.equal(embed(torch.tensor([7])), inner.embed_tokens(torch.tensor([7])))
    assert embed(torch.tensor([], dtype=torch.long)).shape == (0, embed.embedding_dim)  # an empty lookup, as before
    assert torch.equal(decoder.head.parts[0].dequantize(), stock.model.lm_head.weight)  # tied or not


def test_direct_path_matches_the_stock_model(pair):
    direct, stock = pair
    seq = [5, 9, 3, 17, 2, 44, 8, 1, 30, 12, 7, 7]
    runner = Runner(direct.model)
    assert runner.backend == "static"
    got = torch.cat([runner.forward(seq[:6]).logits, *(runner.forward([t]).logits for t in seq[6:])])
    want = stock.model(torch.tensor([seq])).logits[0]
    # fp32 sums in another order (the stock module's own static path differs from its full forward alike): a
    # tolerance on the logits' scale (a random untied Q6_K head gives logits in the hundreds)
    torch.testing.assert_close(got, want, atol=max(1e-4, 5e-5 * float(want.abs().max())), rtol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert direct.identity == stock.identity


def test_speculative_is_token_identical_to_autoregressive(pair):
    direct, _ = pair
    assert direct_gguf(direct.source, "cpu", torch.float32, None, "sdpa") is not None  # `load_model` takes it
    engine = Engine(direct, load_draft_source("self:layers=1", direct), backend="static")
    assert "target: static" in engine.describe_backend()  # what the bench header prints as the forward path
    ids = engine.encode("Hello there, hello there, how are you")
    ar = engine.generate(ids, method="autoregressive", max_new_tokens=20, eos_token_id=[]).tokens
    for method in ("speculative", "prompt-lookup", "lookahead"):
        assert engine.generate(ids, method=method, max_new_tokens=20, eos_token_id=[]).tokens == ar, method


def test_sampling_follows_the_targets_law(pair, monkeypatch):
    """The second token (the first that goes through verification) follows the target's law on each family's
    file (Gemma's soft-capped logits included), drafted by a fixed guess of its likeliest value; the classic
    wrong rejection rule is caught. Two candidates at a high temperature: these random models' distributions are
    too peaked for a rejection to happen often enough otherwise."""
    direct, stock = pair
    runner, prompt, sampling = Runner(direct.model), [5, 6, 7], Sampling(temperature=4.0, top_k=2)
    guesses = second_token_law(stock.model, prompt, sampling).topk(1).indices.tolist()

    def pvalue() -> float:
        counts: dict[int, int] = {}
        for seed in range(600):  # the wrong rule's p-value is below 1e-16 on each family here
            s = Session(prompt, Sampling(temperature=4.0, top_k=2, seed=seed), Stopping(3, ()))
            decode(s, runner, Guess(guesses))
            counts[s.output[1]] = counts.get(s.output[1], 0) + 1
        return second_token_pvalue(stock.model, prompt, sampling, counts)

    assert pvalue() > 1e-3
    broken_rule(monkeypatch)
    assert pvalue() < 1e-4
