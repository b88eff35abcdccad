"""A GGUF target's config and generation config as plain objects, without importing transformers.

`loading.gguf` records, once per file, every attribute transformers' `PretrainedConfig` and `GenerationConfig` held
for it (`record_config`, `GenerationConfig.to_dict()`); a load rebuilds them here as `PlainConfig` and
`PlainGenerationConfig`: the same attribute names and values (the config's properties `_attn_implementation`,
`output_attentions`, `name_or_path` and `num_labels` as plain attributes), which is what the direct path reads of a
config (tests/test_fast_tokenizer.py compares them with transformers' own). Code that hands a config to transformers
(a rotary module of transformers' own) takes `transformers_config(config)`.
"""

from __future__ import annotations

import copy


class PlainConfig:
    """A model config as attributes (see the module docstring)."""

    def __init__(self, recorded: dict):
        attrs = copy.deepcopy(recorded)
        if isinstance(attrs.get("id2label"), dict):  # JSON keeps keys as text; transformers' config holds ints
            attrs["id2label"] = {int(k): v for k, v in attrs["id2label"].items()}
            attrs["num_labels"] = len(attrs["id2label"])
        if isinstance(attrs.get("dtype"), str):
            import torch

            attrs["dtype"] = getattr(torch, attrs["dtype"].removeprefix("torch."))
        attrs["_attn_implementation"] = attrs.pop("_attn_implementation_internal", None)
        attrs["_experts_implementation"] = attrs.pop("_experts_implementation_internal", None)
        attrs["output_attentions"] = attrs.get("_output_attentions", False)
        attrs["name_or_path"] = attrs.get("_name_or_path", "")
        self.__dict__.update(attrs)

    def __repr__(self) -> str:
        return f"PlainConfig({self.__dict__.get('model_type')!r})"


class PlainGenerationConfig:
    """A generation config as attributes (`GenerationConfig.to_dict()`'s)."""

    def __init__(self, recorded: dict):
        self.__dict__.update(copy.deepcopy(recorded))

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)


def record_config(config) -> dict:
    """The attributes of a transformers config, as JSON can hold them (a torch dtype by name)."""
    return {
        k: (str(v) if type(v).__name__ == "dtype" else v) for k, v in vars(config).items() if k != "_post_init_done"
    }


def transformers_config(config):
    """`config` as a transformers `PretrainedConfig` (itself when it is one), for transformers' own modules."""
    if not isinstance(config, PlainConfig):
        return config
    from transformers.configuration_utils import PretrainedConfig

    skip = ("_attn_implementation", "_experts_implementation", "output_attentions", "name_or_path", "num_labels")
    attrs = {k: v for k, v in vars(config).items() if k not in skip and not k.startswith("_")}
    found = PretrainedConfig(**attrs)
    found._attn_implementation = config._attn_implementation
    return found
