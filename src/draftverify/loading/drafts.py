"""Drafts: the draft-spec grammar, a layer-truncated copy of the target, slim drafts, and `DraftSource`.

A draft spec is one of
    none              no draft;
    self:layers=N     the target's first N layers, final norm and head (weights shared);
    PATH              a HF folder or .gguf file (a draft model), or a folder made by
                      `make-draft --kind head` (a feature head, bound to the target).
`load_draft_source` resolves a spec into a `DraftSource`, which says which of these it is, so that
nothing downstream has to ask a draft object for its type (`load_draft` returns just the object).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.feature_head import FeatureHead, is_feature_head
from draftverify.loading.defaults import (
    DEFAULT_MODEL_FILE,
    DEFAULT_SELF_DRAFT_LAYERS,
    SHIPPED_FEATURE_HEAD,
    shipped_draft_path,
)
from draftverify.loading.hf import Loaded, load_model
from draftverify.loading.tokenizers import check_same_tokenizer
from draftverify.util import same_weights

DRAFT_META_FILE = "draftverify.json"  # written by `make-draft` next to a draft's weights


@dataclass(frozen=True)
class DraftSource:
    """What drafts: `kind` is "model" (a draft model), "self layers" (the target's first layers) or
    "feature head"; `model` is set for the first two, `feature_head` for the last."""

    kind: str
    model: Loaded | None = None
    feature_head: FeatureHead | None = None

    KINDS = ("model", "self layers", "feature head")

    def __post_init__(self):
        require(self.kind in self.KINDS, f"unknown draft kind {self.kind!r}: use one of {', '.join(self.KINDS)}")
        has_model = self.kind != "feature head"
        require(
            (self.model is not None) == has_model and (self.feature_head is not None) != has_model,
            f"a {self.kind} draft source needs {'a model' if has_model else 'a feature head'} and nothing else",
        )

    @property
    def name(self) -> str:
        return self.model.name if self.model is not None else self.feature_head.name


def draft_source(draft) -> DraftSource | None:
    """A `DraftSource` for what a caller hands an `Engine`: a DraftSource, a draft model (`Loaded`), a feature
    head, or None. The one place that tells them apart."""
    if draft is None or isinstance(draft, DraftSource):
        return draft
    if isinstance(draft, FeatureHead):
        return DraftSource("feature head", feature_head=draft)
    return DraftSource("model", model=draft)


def load_draft(
    spec: str | None, target: Loaded, dtype: str = "auto", device: str = "auto"
) -> Loaded | FeatureHead | None:
    """The draft a spec names for `target`: a draft model, a feature head, or None (`load_draft_source`)."""
    source = load_draft_source(spec, target, dtype, device)
    return None if source is None else source.model or source.feature_head


def load_draft_source(
    spec: str | None, target: Loaded, dtype: str = "auto", device: str = "auto"
) -> DraftSource | None:
    """Resolve a draft spec (see the module docstring) for `target`.

    `None` means the default draft for the target: the project's shipped draft when the target
    is the default model and the draft is installed, else `self:layers=8`.
    """
    if spec is None:
        shipped = shipped_draft_path()
        default = shipped is not None and target.name == DEFAULT_MODEL_FILE
        spec = str(shipped) if default else f"self:layers={DEFAULT_SELF_DRAFT_LAYERS}"
    if spec == "none":
        return None
    if spec.startswith("self:"):
        key, _, value = spec[len("self:") :].partition("=")
        require(key == "layers" and value.isdigit(), f"bad draft spec {spec!r}: use e.g. self:layers=8")
        return DraftSource("self layers", model=truncated_copy(target, int(value)))
    if is_feature_head(spec):
        return DraftSource("feature head", feature_head=FeatureHead.load(Path(spec)).bind(target))
    from transformers.utils import logging as hf_logging

    quiet = (Path(spec) / DRAFT_META_FILE).is_file()  # a slim draft: transformers would report its embeddings missing
    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        draft = load_model(spec, dtype=dtype, device=device)
    finally:
        hf_logging.set_verbosity(level)
    check_same_tokenizer(target.tokenizer, draft.tokenizer)
    restore_shared_embeddings(draft, target, Path(spec))
    return DraftSource("model", model=draft)


def default_feature_head(target: Loaded, arithmetic: str | None = None) -> FeatureHead | None:
    """The feature head for `target` when no draft is named, bound to it: the draft store's for its weights in
    `arithmetic` (`loading.store`: a `build-drafts` build, else the package's shipped one), else the one shipped
    for the default model; None when there is none."""
    from draftverify.loading.store import describe, find

    found = find(target.identity, arithmetic, "head") if arithmetic else None
    if found is not None and is_feature_head(found):
        head = FeatureHead.load(found)
        head.name = describe(found)
        return head.bind(target)
    if target.name != DEFAULT_MODEL_FILE or not is_feature_head(SHIPPED_FEATURE_HEAD):
        return None
    return FeatureHead.load(SHIPPED_FEATURE_HEAD).bind(target)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList with one entry per hidden layer)."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise DraftVerifyError(
        f"cannot find the decoder layers of {type(model).__name__}: this architecture is unsupported"
    )


def layer_prefix(model: torch.nn.Module) -> str:
    """The state-dict prefix of the decoder layers, e.g. "model.layers."."""
    layers = decoder_layers(model)
    return next(name + "." for name, module in model.named_modules() if module is layers)


def truncated_copy(target: Loaded, n_layers: int) -> Loaded:
    """The target's embedding, first `n_layers` layers, final norm and head, as a model of its own.

    The weights are shared with the target (no extra memory); the copy has its own KV cache.
    """
    total = target.model.config.num_hidden_layers
    require(
        1 <= n_layers < total,
        f"self:layers={n_layers} is impossible: the target has {total} layers, use 1..{total - 1}",
    )
    if hasattr(target.model, "truncated"):  # a GGUF model: the same packed weights, fewer layers
        return Loaded(target.model.truncated(n_layers), target.tokenizer, name=f"{target.name}[:{n_layers} layers]")
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = n_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:n_layers]
    with torch.device("meta"):
        model = type(target.model)(config)
    prefix = layer_prefix(target.model)
    state = {
        k: v
        for k, v in target.model.state_dict().items()
        if not k.startswith(prefix) or int(k[len(prefix) :].split(".")[0]) < n_layers
    }
    model.load_state_dict(state, strict=False, assign=True)
    # Non-persistent buffers (rotary inverse frequencies...) are not in the state dict: take the target's.
    target_buffers = dict(target.model.named_buffers())
    for name, buf in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module._buffers[leaf] = target_buffers[name]
    model.tie_weights()
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    require(not meta, f"truncated copy left parameters uninitialised ({meta[:3]}): this architecture is unsupported")
    model.eval().requires_grad_(False)
    model.generation_config = target.model.generation_config
    return Loaded(model, target.tokenizer, name=f"{target.name}[:{n_layers} layers]")


def restore_shared_embeddings(draft: Loaded, target: Loaded, folder: Path) -> None:
    """Give a draft saved without embeddings (`make-draft --share-embeddings`) the target's embeddings and head.

    Such a folder says so in its `draftverify.json`, with the identity of the target it was built
    for; any other target is refused. Other drafts are left as they are.
    """
    meta_path = folder / DRAFT_META_FILE
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
        shared, built_for = bool(meta["shared_embeddings"]), dict(meta["target"])
    except (ValueError, KeyError, TypeError) as exc:
        raise DraftVerifyError(f"{meta_path} is corrupt: rebuild the draft with `draftverify make-draft`") from exc
    if not shared:
        return
    require(
        same_weights(built_for, target.identity),
        f"draft {folder} stores no embeddings and was built for another target: use it with the target it was made for",
    )
    weight = draft.model.get_input_embeddings().weight
    for source, module in (
        (target.model.get_input_embeddings(), draft.model.get_input_embeddings()),
        (target.model.get_output_embeddings(), draft.model.get_output_embeddings()),
    ):
        # `.to` returns the target's own tensor when device and dtype agree: no copy.
        module.weight = torch.nn.Parameter(source.weight.detach().to(weight.device, weight.dtype), requires_grad=False)
