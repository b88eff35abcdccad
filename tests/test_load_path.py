"""What loading the default model and one request must not do, once the file's metadata is cached: import its
architecture's transformers modules, modeling or config (the direct path runs no stock module, reads its config as a
plain PretrainedConfig, and its rotary embedding is draftverify's copy, bit for bit transformers'), build the
embedding's whole fp32 table (a GGUF embedding is read by rows), or load the draft model for a method that does not
draft with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from draftverify.loading.defaults import default_model_path
from draftverify.loading.gguf import gguf_metadata
from draftverify.loading.gguf_model import RotaryEmbedding, rotary_embedding
from draftverify.loading.tokenizers import FINGERPRINT, tokenizer_fingerprint

SCALINGS = [
    None,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
]  # fmt: skip


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "llama3", "linear", "yarn"])
@pytest.mark.parametrize("make", [(LlamaConfig, LlamaRotaryEmbedding), (Qwen3Config, Qwen3RotaryEmbedding)])
def test_the_rotary_embedding_is_transformers_bit_for_bit(make, scaling):
    config_class, stock_class = make
    rope = {"rope_theta": 50000.0, **({"rope_type": "default"} if scaling is None else scaling)}
    config = config_class(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters=rope,
    )  # fmt: skip
    ours, stock = rotary_embedding(config), stock_class(config)
    assert isinstance(ours, RotaryEmbedding)
    x, positions = torch.zeros(1, 1, 1), torch.tensor([[0, 1, 7, 300, 2000, 4095]])
    for a, b in zip(ours(x, positions), stock(x, positions)):
        assert torch.equal(a, b)


PROBE = """
import json, sys
from pathlib import Path
from draftverify import Engine, costs
costs.cache_folder = lambda: Path(sys.argv[1])  # this test's own curves, not the user's
engine = Engine.load()
out = engine.generate("Hi", method=sys.argv[2], chat=True, max_new_tokens=4)
source = engine.target.model.weight_source
print(json.dumps({
    "modeling": sorted(m for m in sys.modules if m.startswith(f"transformers.models.{source.config.model_type}.")),
    "tables": sorted(source.__dict__.get("_tables", {})),
    "draft_loaded": engine.draft_loaded,
    "tokens": len(out.tokens),
}))
"""


@pytest.mark.parametrize("method", ["autoregressive", "auto"])
def test_generate_on_the_default_model_stays_on_the_direct_path(method, tmp_path):
    gguf_metadata(default_model_path())  # a first load converts config and tokenizer once, through transformers
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path), method], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["tokens"] > 0
    assert found["modeling"] == []  # no stock module or config class: their imports are most of a cold load
    assert found["tables"] == []  # no [V, H] fp32 copy of the embedding
    assert not found["draft_loaded"]  # the feature head drafts for auto; autoregressive drafts with nothing


def test_the_cached_tokenizer_fingerprint_is_the_vocabularys_hash():
    """A GGUF target's tokenizer fingerprint is read from its metadata cache after the first load: it must be the
    hash `tokenizer_fingerprint` forms from the vocabulary itself (what pools, skip sets and heads were made with)."""
    gguf_metadata(default_model_path())  # the first load writes it
    _, _, tokenizer = gguf_metadata(default_model_path())
    cached = tokenizer_fingerprint(tokenizer)
    delattr(tokenizer, FINGERPRINT)
    assert tokenizer_fingerprint(tokenizer) == cached
