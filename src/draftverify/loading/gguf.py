"""GGUF files, converted once into a safetensors folder that transformers loads quickly."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

import torch

from draftverify.util import atomic_path, cache_root


def gguf_to_folder(path: Path) -> Path:
    """Convert a GGUF file once into a safetensors folder in the user cache and return it.

    transformers de-quantises GGUF on every load (slow) and `save_pretrained` refuses
    GGUF-loaded models, so the state dict is saved here by hand. The folder is written under a
    temporary name and renamed, so an interrupted conversion leaves nothing half-written.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    started = time.monotonic()
    print(f"draftverify: converting {path.name} to a safetensors folder once...", file=sys.stderr, flush=True)
    with atomic_path(folder, folder=True) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    print(
        f"draftverify: converted in {time.monotonic() - started:.0f} s, cached in {folder}", file=sys.stderr, flush=True
    )
    return folder
