"""The first load of a GGUF file converts its config and tokenizer through transformers once (loading/gguf.py,
`gguf_metadata`); the config of an architecture the direct path reads comes from `config_dict` over transformers'
fast metadata reader instead of its whole-file `GGUFReader`. Both must give what transformers gives on its own:
the config dict of `load_gguf_checkpoint` for a file of each architecture, and the very files of a converted folder.
"""

from __future__ import annotations

import contextlib
import filecmp

import numpy as np
import pytest
from gguf import GGUFWriter
from test_gguf_archs import write_tiny
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, read_gguf_metadata
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from draftverify.loading.gguf import config_dict, config_from_metadata, gguf_metadata

MERGES = ["Ġ t", "h e", "Ġt he"]
TOKENS = [*bytes_to_unicode().values(), "Ġt", "he", "Ġthe", "<|endoftext|>"]  # byte-level BPE, as SmolLM2's


def write_small(path, arch: str, name: str | None = None, vocab_size: bool = True, head: bool = False) -> None:
    """A one-tensor `arch` file with the metadata llama.cpp writes, and a small byte-level BPE vocabulary.
    `vocab_size=False`: no `{arch}.vocab_size` (transformers counts the tokens); `head`: an untied `output.weight`."""
    w = GGUFWriter(str(path), arch)
    if name:
        w.add_name(name)
    w.add_context_length(256)
    w.add_block_count(1)
    w.add_feed_forward_length(64)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if vocab_size:
        w.add_vocab_size(len(TOKENS))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 1) + [3])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(len(TOKENS) - 1)
    w.add_eos_token_id(len(TOKENS) - 1)
    w.add_chat_template("{% for m in messages %}<|endoftext|>{{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(TOKENS), 32), np.float32))
    if head:
        w.add_tensor("output.weight", np.zeros((len(TOKENS), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


FILES = {
    "llama": lambda p: write_small(p, "llama"),
    "llama, untied, no vocab_size": lambda p: write_small(p, "llama", vocab_size=False, head=True),
    "mistral (a llama file)": lambda p: write_small(p, "llama", name="mistral"),
    "llama named like mistral": lambda p: write_small(p, "llama", name="mistral-tiny"),
    "qwen2": lambda p: write_small(p, "qwen2"),
    "qwen3": lambda p: write_small(p, "qwen3", head=True),
    "gemma2": lambda p: write_tiny(p, "gemma2"),
    "gemma3": lambda p: write_tiny(p, "gemma3"),
    "phi3": lambda p: write_tiny(p, "phi3"),
}


@pytest.mark.parametrize("kind", list(FILES))
def test_the_config_dict_is_transformers_own(kind, tmp_path):
    path = tmp_path / "small.gguf"
    FILES[kind](path)
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert config_dict(*read_gguf_metadata(str(path))) == theirs


def test_a_converted_folder_is_the_one_transformers_writes(tmp_path, monkeypatch):
    """The whole first conversion, on the fast config and on transformers' own: the same files, byte for byte (the
    tokenizer class AutoTokenizer picks from the config included), and transformers' registry left as it was."""
    (tmp_path / "model").mkdir()
    path = tmp_path / "model" / "small.gguf"
    write_small(path, "llama")
    registry = dict(GGUF_CONFIG_ARCHS)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, _, tokenizer = gguf_metadata(path)
    assert GGUF_CONFIG_ARCHS == registry
    (ours,) = (tmp_path / "cache" / "draftverify" / "gguf-meta").iterdir()
    for fast, folder in [(False, tmp_path / "slow"), (True, tmp_path / "fast")]:
        with config_from_metadata() if fast else contextlib.nullcontext():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            theirs = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        theirs.save_pretrained(folder)
        GenerationConfig.from_model_config(config).save_pretrained(folder)
        config.save_pretrained(folder)
    for folder in [tmp_path / "fast", ours]:
        same = filecmp.dircmp(tmp_path / "slow", folder)
        assert not same.left_only and not same.diff_files, (folder, same.left_only, same.diff_files)
    assert tokenizer("the the").input_ids == theirs("the the").input_ids
