"""The real default target, SmolLM2-135M-Instruct (fp32, CPU): lossless speculative decoding."""

from __future__ import annotations

import functools

import pytest
import torch

from draftverify import Engine, truncated_copy
from draftverify.loading import DEFAULT_MODEL_FILE
from draftverify.util import cache_root

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "How do I reverse a list in Python?",
    "Why do cats purr?",
    "Give me a tip for better sleep.",
    "What is 12 times 7? Show your work.",
    "Describe the water cycle briefly.",
    "Write one sentence about the moon.",
]


def test_gguf_converted_once_and_cached(smollm):
    """The stock module (eager path, tools) loads the file's safetensors conversion, made once and then found."""
    from draftverify.loading.gguf import gguf_to_folder

    stock_smollm()  # converts on a machine that has not yet
    # The folder is keyed by the file's path, size and time, so another checkout's copy of the same file (an
    # earlier CI clone, the developer's tree) has a folder of its own beside this one: find this file's, not a count.
    folder = gguf_to_folder(smollm.source)
    assert folder.parent == cache_root() / "gguf" and folder.name.startswith(DEFAULT_MODEL_FILE.removesuffix(".gguf"))
    made = (folder / "model.safetensors").stat().st_mtime_ns
    assert gguf_to_folder(smollm.source) == folder and (folder / "model.safetensors").stat().st_mtime_ns == made
    assert smollm.name == DEFAULT_MODEL_FILE and smollm.model.config.num_hidden_layers == 30


def test_llamacpp_gets_an_f32_gguf_of_exactly_the_target_weights(smollm):
    """The llama.cpp peers' file: every tensor F32, every metadata key kept, values equal to what the target runs."""
    import gguf

    from draftverify.bench.llamacpp import f32_gguf

    path = f32_gguf(smollm.source)
    assert f32_gguf(smollm.source) == path  # cached
    source, copy = gguf.GGUFReader(smollm.source), gguf.GGUFReader(path)
    assert {t.name for t in copy.tensors} == {t.name for t in source.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in copy.tensors)
    assert set(source.fields) == set(copy.fields) and copy.fields["general.file_type"].contents() == int(
        gguf.LlamaFileType.ALL_F32
    )
    embd = next(t for t in copy.tensors if t.name == "token_embd.weight")
    ours = smollm.model.get_input_embeddings().weight
    assert torch.equal(torch.from_numpy(embd.data.reshape(ours.shape).copy()), ours)


@functools.cache
def stock_smollm():
    """The default model as transformers' own module over the file's weights in fp32 (the fixture runs the
    file's blocks directly)."""
    from draftverify.loading import load_model

    return load_model(device="cpu", dtype="fp32", direct=False)


def test_speculative_equals_autoregressive_and_hf_generate(smollm):
    engine = Engine(smollm, truncated_copy(smollm, 8))
    for i, prompt in enumerate(PROMPTS[:4]):
        ar = engine.generate(prompt, chat=True, method="autoregressive", max_new_tokens=64, eos_token_id=[])
        spec = engine.generate(
            prompt, chat=True, method="speculative", max_new_tokens=64, eos_token_id=[], policy="constant", k=3
        )
        assert spec.tokens == ar.tokens, prompt
        if i < 2:  # transformers' own greedy loop agrees too (stopping at EOS as it does by default)
            ours = engine.generate(prompt, chat=True, method="speculative", max_new_tokens=64, policy="constant", k=3)
            ids = torch.tensor([ours.prompt_tokens])
            ref = stock_smollm().model.generate(ids, do_sample=False, max_new_tokens=64)
            assert ref[0, ids.shape[1] :].tolist() == ours.tokens, prompt


def test_the_methods_over_the_shipped_feature_head_equal_autoregressive(smollm):
    """The shipped feature head, and the SpecDec++ head shipped for it (`specdec-pp` over the head)."""
    from draftverify.loading import default_feature_head
    from draftverify.methods.base import Artifact

    engine = Engine(smollm, default_feature_head(smollm))
    ar = engine.generate(PROMPTS[0], chat=True, method="autoregressive", max_new_tokens=40)
    for name in ("speculative", "ouroboros", "specdec-pp", "auto"):
        out = engine.generate(PROMPTS[0], chat=True, method=name, max_new_tokens=40)
        assert out.tokens == ar.tokens, name
        if name == "specdec-pp":
            assert engine.method(name).draft_source is Artifact.FEATURE_HEAD and out.stats.drafted > 0


def test_every_method_with_its_shipped_defaults_equals_autoregressive(smollm):
    """What a user gets out of the box: the shipped draft, skip set and SpecDec++ head, each method's defaults."""
    from draftverify.loading import load_draft, shipped_draft_path
    from draftverify.methods import METHODS

    assert shipped_draft_path() is not None, "the default draft is not shipped"
    engine = Engine(smollm, load_draft(None, smollm))
    for prompt in PROMPTS[:2]:
        ar = engine.generate(prompt, chat=True, method="autoregressive", max_new_tokens=40)
        for name in sorted(set(METHODS) - {"autoregressive"}):
            out = engine.generate(prompt, chat=True, method=name, max_new_tokens=40)
            assert out.tokens == ar.tokens, (prompt, name)
            # lookahead's pool may still be empty after a short answer; the cost policy (speculative's
            # default) may find that no draft pays on this machine and not draft at all
            if METHODS[name].drafts().required and getattr(engine.method(name).config, "policy", None) != "cost":
                assert out.stats.drafted > 0, (prompt, name)
