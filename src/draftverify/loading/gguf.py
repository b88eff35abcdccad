"""GGUF files: config and tokenizer read once and cached, the direct static-path model, and the fp32 conversion.

- `gguf_metadata(path)`: the config, generation config and tokenizer of a GGUF file, converted once by transformers
  and cached under `~/.cache/draftverify/gguf-meta/` (keyed by the file's path, size and mtime; written atomically)
  with a record of what transformers built (`record_direct`), so that a repeated load reads them without importing
  transformers: plain configs (`plain_config`) and a tokenizer on the `tokenizers` library (`fast_tokenizer`), the
  tokenizer's fingerprint (`tokenizers.tokenizer_fingerprint`) from a file too. The first conversion of a file the
  direct path reads takes its config from `config_dict` (below), so that transformers never builds its slow
  `GGUFReader` over the whole vocabulary;
- `GGUFModel` (loading/gguf_model.py) is what a GGUF target loads as: the static path multiplies the file's own
  blocks (`gguf_weights.GGUFWeights`); the stock transformers module is built only when something asks for it;
- `gguf_to_folder(path)`: the fp32 safetensors conversion the stock module loads from (the eager path, tools).
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from draftverify.loading.fast_tokenizer import tokenizer_facts
from draftverify.loading.plain_config import PlainConfig, PlainGenerationConfig, record_config
from draftverify.loading.tokenizers import FINGERPRINT, tokenizer_fingerprint
from draftverify.util import atomic_path, atomic_write, cache_root, file_key

DIRECT_VERSION = 1


def metadata_folder(path: Path) -> Path:
    """Where `gguf_metadata` caches the converted config and tokenizer of the GGUF file at `path`."""
    return cache_root() / "gguf-meta" / f"{path.stem}-{file_key(path)}"


DIRECT_FILE = "direct.json"  # what a load without transformers reads (`record_direct`); written last
BACKEND_FILE = "backend-tokenizer.json"  # the Rust tokenizer as transformers built it


def gguf_metadata(path: Path):
    """(config, generation config, tokenizer) of a GGUF file, from its cached conversion (made on first use).

    A load reads them without importing transformers: the config and generation config as `plain_config`'s plain
    objects holding every attribute transformers' held, the tokenizer as a `fast_tokenizer.FastTokenizer` over the
    Rust tokenizer transformers built, all recorded once (`record_direct`) by the transformers they must match (a
    record of another transformers version is made again). A tokenizer a `FastTokenizer` cannot stand for (no Rust
    backend, spaces cleaned up when decoding) is transformers' own."""
    folder = metadata_folder(path)
    direct = _read_direct(folder)
    if direct is None:
        record_direct(folder, *_convert(path, folder))
        direct = _read_direct(folder)
    config = PlainConfig(direct["config"])
    generation = PlainGenerationConfig(direct["generation"])
    if direct["tokenizer"] is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    else:
        import tokenizers

        from draftverify.loading.fast_tokenizer import FastTokenizer

        backend = tokenizers.Tokenizer.from_file(str(folder / BACKEND_FILE))
        tokenizer = FastTokenizer(backend, direct["tokenizer"], folder)
    fingerprint = folder / "tokenizer-fingerprint.txt"  # formed once per file: hashing the vocabulary takes a while
    if fingerprint.is_file():
        setattr(tokenizer, FINGERPRINT, (len(tokenizer), fingerprint.read_text().strip()))
    else:
        atomic_write(fingerprint, tokenizer_fingerprint(tokenizer))
    return config, generation, tokenizer


def _convert(path: Path, folder: Path):
    """The transformers config, generation config and tokenizer of a GGUF file, from its cached conversion to a
    folder (written here first when missing). The config is read as a plain `PretrainedConfig` holding every field
    the architecture's config class wrote (`model_type`, sizes, `rope_parameters`, `layer_types`, ...): what the
    direct path reads of a config, without importing the architecture's config module."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.configuration_utils import PretrainedConfig

    if not (folder / "config.json").is_file():
        with atomic_path(folder, folder=True) as tmp, config_from_metadata():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            config.save_pretrained(tmp)  # last: its presence marks a complete folder
    config = PretrainedConfig.from_json_file(folder / "config.json")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, config=config)  # not AutoConfig's
    generation = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return config, generation, tokenizer


def record_direct(folder: Path, config, generation, tokenizer) -> None:
    """Write what `gguf_metadata` reads without transformers: the Rust tokenizer as `tokenizer` holds it, then
    `DIRECT_FILE` (the config's attributes, the generation config's, the tokenizer's facts and the version of
    transformers that built them), each atomically."""
    facts = tokenizer_facts(tokenizer)
    if facts is not None:
        atomic_write(folder / BACKEND_FILE, tokenizer.backend_tokenizer.to_str())
    record = {
        "version": DIRECT_VERSION,
        "transformers": _transformers_version(),
        "config": record_config(config),
        "generation": generation.to_dict(),
        "tokenizer": facts,
    }
    atomic_write(folder / DIRECT_FILE, json.dumps(record))


def _read_direct(folder: Path) -> dict | None:
    """`DIRECT_FILE` of `folder` when whole and made by this transformers, else None."""
    try:
        found = json.loads((folder / DIRECT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if found.get("version") != DIRECT_VERSION or found.get("transformers") != _transformers_version():
        return None
    if found.get("tokenizer") is not None and not (folder / BACKEND_FILE).is_file():
        return None
    return found


def _transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def config_dict(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config dict transformers' `load_gguf_checkpoint(..., return_tensors=False)["config"]` builds for a file
    of an architecture the direct path reads, from the metadata of transformers' fast reader
    (`integrations.gguf.read_gguf_metadata`, which walks past the vocabulary's strings instead of parsing each).

    The same steps in the same order: Mistral files (architecture "llama", named "mistral") renamed,
    `tie_word_embeddings` from the absence of `output.weight`, the architecture's defaults, each metadata key through
    transformers' mapping table (later keys win, one-element arrays unwrapped as its parser does), Gemma 3 as its
    text model, `vocab_size` from the vocabulary's length when the file has none. Arrays of strings only live
    under `tokenizer.*`, which the config's table does not read; tests/test_gguf_metadata.py compares the result
    with transformers' own on a file of each architecture."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = metadata["general.architecture"]
    updated = architecture
    if "llama" in architecture and metadata.get("general.name") == "mistral":  # its test: "mistral" in [name]
        updated = "mistral"
    config = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(
        updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {})
    ).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.replace(architecture, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if config["model_type"] == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]  # the fast reader's count of an array of strings it skipped
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config


@contextmanager
def config_from_metadata():
    """Inside: transformers builds the config of a GGUF file the direct path reads with `config_dict`.

    `AutoConfig` and `AutoTokenizer` (which wants the config to choose a tokenizer class) ask transformers'
    registry of fast config builders (`integrations.gguf.GGUF_CONFIG_ARCHS`) first and otherwise parse the whole
    file with gguf's `GGUFReader`, seconds for a 49k-token vocabulary, twice. The architectures are registered for
    the conversion only, and only those transformers has no builder of its own for (a conversion in another thread
    that outlives the registration takes transformers' slow path: the same result)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    from draftverify.loading.gguf_weights import DIRECT_ARCHITECTURES

    added = [arch for arch in DIRECT_ARCHITECTURES if arch not in GGUF_CONFIG_ARCHS]
    GGUF_CONFIG_ARCHS.update(dict.fromkeys(added, config_dict))
    try:
        yield
    finally:
        for arch in added:
            GGUF_CONFIG_ARCHS.pop(arch, None)


def gguf_to_folder(path: Path) -> Path:
    """Convert a GGUF file once into a safetensors folder in the user cache and return it.

    transformers de-quantises GGUF on every load (slow) and `save_pretrained` refuses
    GGUF-loaded models, so the state dict is saved here by hand. The folder is written under a
    temporary name and renamed, so an interrupted conversion leaves nothing half-written.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache_root() / "gguf" / f"{path.stem}-{file_key(path)}"
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
