"""Layer skipping: run the stock model with some attention and MLP sub-layers bypassed.

A `SkipSet` names attention and MLP sub-layers separately, by decoder-layer index. Inside
`skip_layers(model, skip)` each named sub-module of the stock decoder layers is swapped for
a stand-in that returns zeros, so it adds nothing to the residual stream (and a skipped
attention writes no K/V); on exit, even after an exception, the original modules are put
back. No model code is forked and the config is never edited.

`Runner.forward(tokens, skip=skip)` drafts with a skip set in the runner's own cache (the
static decoder skips the sub-layers itself; the eager model runs inside `skip.applied(model)`).
Skipped attention layers write no cache, so per-layer cache lengths diverge while drafting;
the Runner counts its length itself, gives such forwards explicit positions and masks, and
crops every layer to the same absolute length, after which a full forward rewrites them all.

Skip-set files (JSON, written by `draftverify search-layers`) carry the identity of the
model they were made for and are refused on any other model.
"""

from __future__ import annotations

import json
import operator
import random
import shlex
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from draftverify.errors import DraftVerifyError, require
from draftverify.loading import decoder_layers, model_identity
from draftverify.loading.hf import model_source
from draftverify.util import atomic_write, describe_identity, same_weights

SKIP_FORMAT = "draftverify-skipset"
SKIP_VERSION = 1
ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")  # Llama/Qwen/Mistral, GPT-2, GPT-NeoX, ...
MLP_NAMES = ("mlp", "feed_forward", "ffn")
STRATEGIES = ("searched", "heuristic", "first", "middle", "last", "random", "none")
SHIPPED_DIR = Path(__file__).parent.parent / "assets" / "skipsets"


@dataclass(frozen=True)
class SkipSet:
    """Which sub-layers to bypass while drafting: decoder-layer indices, attention and MLP apart."""

    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    def __post_init__(self):
        for kind in ("attention", "mlp"):
            value = tuple(sorted(set(operator.index(i) for i in getattr(self, kind))))  # ints only (no 3.0)
            require(
                all(i >= 0 for i in value), f"skip set has a negative {kind} layer index: use 0-based layer indices"
            )
            object.__setattr__(self, kind, value)

    @property
    def size(self) -> int:
        """Number of skipped sub-layers."""
        return len(self.attention) + len(self.mlp)

    def applied(self, model: torch.nn.Module):
        """`skip_layers(model, self)`: the context in which the stock model runs with these sub-layers bypassed."""
        return skip_layers(model, self)

    def check(self, n_layers: int) -> None:
        for kind, layers in (("attention", self.attention), ("mlp", self.mlp)):
            require(
                not layers or layers[-1] < n_layers,
                f"skip set names {kind} layer {layers[-1] if layers else 0} but the model has {n_layers} layers "
                f"(0..{n_layers - 1}): "
                "use a skip set made for this model",
            )

    def describe(self) -> str:
        return f"attention [{','.join(map(str, self.attention))}] mlp [{','.join(map(str, self.mlp))}]"

    # -- simple strategies (the paper's Appendix D comparison) ---------------------------

    @classmethod
    def first(cls, n_layers: int, n_attention: int, n_mlp: int) -> "SkipSet":
        return cls(tuple(range(n_attention)), tuple(range(n_mlp)))

    @classmethod
    def last(cls, n_layers: int, n_attention: int, n_mlp: int) -> "SkipSet":
        return cls(tuple(range(n_layers - n_attention, n_layers)), tuple(range(n_layers - n_mlp, n_layers)))

    @classmethod
    def middle(cls, n_layers: int, n_attention: int, n_mlp: int) -> "SkipSet":
        def centred(n: int) -> tuple[int, ...]:
            start = (n_layers - n) // 2
            return tuple(range(start, start + n))

        return cls(centred(n_attention), centred(n_mlp))

    @classmethod
    def random(cls, n_layers: int, n_attention: int, n_mlp: int, seed: int = 0) -> "SkipSet":
        rng = random.Random(seed)
        return cls(tuple(rng.sample(range(n_layers), n_attention)), tuple(rng.sample(range(n_layers), n_mlp)))

    @classmethod
    def heuristic(cls, n_layers: int, scale: float = 1.0) -> "SkipSet":
        """Paper-like (Draft & Verify, Fig. 6): about 45% of the sub-layers at scale 1, twice as many
        attentions as MLPs, spread over the back of the model (attention from 1/4 of the depth, MLP
        from 1/2), never the last layer."""

        def spread(lo: int, n: int) -> tuple[int, ...]:
            hi = n_layers - 1  # keep the last layer
            n = max(0, min(n, hi - lo))
            if n == 0:
                return ()
            step = (hi - lo) / n
            return tuple(lo + int(j * step) for j in range(n))

        return cls(
            spread(n_layers // 4, round(0.6 * n_layers * scale)), spread(n_layers // 2, round(0.3 * n_layers * scale))
        )


def make_skip_set(
    strategy: str,
    model: torch.nn.Module,
    searched: SkipSet | None,
    n_attention: int | None = None,
    n_mlp: int | None = None,
    seed: int = 0,
) -> SkipSet:
    """The skip set of a strategy for `model`. The simple strategies skip as many sub-layers as the
    searched set (or the heuristic one when there is none) unless `n_attention` / `n_mlp` say otherwise."""
    require(strategy in STRATEGIES, f"unknown skip strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    n_layers = len(decoder_layers(model))
    if strategy == "none":
        return SkipSet()
    if strategy == "heuristic":
        return SkipSet.heuristic(n_layers)
    if strategy == "searched":
        require(
            searched is not None,
            f"no searched skip set for this {model.config.model_type} model: run `draftverify search-layers --model "
            f"{shlex.quote(model_source(model))} --out skip.json` and pass -o skip_file=skip.json, or pick "
            "-o strategy=heuristic",
        )
        return searched
    like = searched if searched is not None else SkipSet.heuristic(n_layers)
    n_attention = len(like.attention) if n_attention is None else n_attention
    n_mlp = len(like.mlp) if n_mlp is None else n_mlp
    require(
        0 <= n_attention <= n_layers and 0 <= n_mlp <= n_layers,
        f"cannot skip {n_attention} attention / {n_mlp} MLP sub-layers of a {n_layers}-layer model",
    )
    if strategy == "random":
        return SkipSet.random(n_layers, n_attention, n_mlp, seed)
    return getattr(SkipSet, strategy)(n_layers, n_attention, n_mlp)


# -- skip-set files ---------------------------------------------------------------------------


def save_skip_set(path: str | Path, skip: SkipSet, identity: dict, search: dict | None = None) -> Path:
    """Write a skip set with the identity of its model (and how it was found) as JSON, atomically."""
    doc = {
        "format": SKIP_FORMAT,
        "version": SKIP_VERSION,
        "model": identity,
        "attention": list(skip.attention),
        "mlp": list(skip.mlp),
    }
    if search is not None:
        doc["search"] = search
    return atomic_write(path, json.dumps(doc, indent=1) + "\n")


def load_skip_set(path: str | Path, identity: dict | None = None) -> SkipSet:
    """Read a skip-set file; refuse it if it is corrupt or was made for a model other than `identity`."""
    path = Path(path)
    fix = "make one with `draftverify search-layers --out FILE`"
    require(path.is_file(), f"skip file {path} does not exist: {fix}")
    try:
        doc = json.loads(path.read_text())
        require(
            isinstance(doc, dict) and doc.get("format") == SKIP_FORMAT, f"{path} is not a draftverify skip set: {fix}"
        )
        require(
            doc.get("version") == SKIP_VERSION,
            f"skip file {path} has version {doc.get('version')}, this draftverify reads {SKIP_VERSION}: {fix}",
        )
        skip = SkipSet(tuple(doc["attention"]), tuple(doc["mlp"]))
        made_for = dict(doc["model"])
    except DraftVerifyError:
        raise
    except Exception as exc:  # bad JSON, missing keys, non-integer indices
        raise DraftVerifyError(f"skip file {path} is corrupt ({type(exc).__name__}): {fix}") from None
    if identity is not None:
        require(
            same_weights(made_for, identity),
            f"skip file {path} was made for another model ({describe_identity(made_for)}; this one is "
            f"{describe_identity(identity)}): "
            "run `draftverify search-layers` for this model",
        )
        skip.check(identity["num_hidden_layers"])
    return skip


def shipped_skip_set(model: torch.nn.Module) -> SkipSet | None:
    """The skip set shipped in `assets/skipsets/` for this model, if there is one."""
    identity = model_identity(model)
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        try:
            return load_skip_set(path, identity)
        except DraftVerifyError:
            continue
    return None


def stored_skip_set(runner) -> SkipSet | None:
    """The skip set for a target runner's model in its arithmetic: the draft store's (`loading.store`: a
    `build-drafts` build, or the package's shipped one), else one shipped in `assets/skipsets/` for this model."""
    from draftverify.loading.store import find

    identity = model_identity(runner.model)
    found = find(identity, runner.shared.packs.arithmetic, "skipset")
    return load_skip_set(found, identity) if found is not None else shipped_skip_set(runner.model)


# -- the context manager ----------------------------------------------------------------------


class SkippedAttention(torch.nn.Module):
    """Stands in for a skipped attention sub-layer: output zeros (no attention weights), no cache write."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class SkippedMLP(torch.nn.Module):
    """Stands in for a skipped MLP sub-layer: output zeros."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return torch.zeros_like(hidden_states)


def sublayer_names(layer: torch.nn.Module) -> tuple[str, str]:
    """The attribute names of a decoder layer's attention and MLP sub-modules."""

    def find(names: tuple[str, ...], kind: str) -> str:
        for name in names:
            child = getattr(layer, name, None)
            if isinstance(child, (SkippedAttention, SkippedMLP)):
                raise DraftVerifyError(
                    "layer skipping is already active on this model: leave the outer `skip_layers` block first"
                )
            if isinstance(child, torch.nn.Module):
                return name
        raise DraftVerifyError(
            f"cannot skip layers of {type(layer).__name__}: it has no {kind} sub-module named {' / '.join(names)}; "
            "supported are Llama-style (self_attn, mlp), GPT-2 (attn, mlp) and GPT-NeoX (attention, mlp) decoder layers"
        )

    return find(ATTENTION_NAMES, "attention"), find(MLP_NAMES, "MLP")


@contextmanager
def skip_layers(model: torch.nn.Module, skip: SkipSet):
    """Inside this block `model` runs with `skip`'s sub-layers bypassed; they are restored on exit."""
    layers = decoder_layers(model)
    skip.check(len(layers))
    names = [sublayer_names(layer) for layer in layers] if skip.size else []
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []  # (layer, attribute, original module)
    try:
        for which, indices, stand_in in ((0, skip.attention, SkippedAttention()), (1, skip.mlp, SkippedMLP())):
            for i in indices:
                attribute = names[i][which]
                swapped.append((layers[i], attribute, getattr(layers[i], attribute)))
                setattr(layers[i], attribute, stand_in)
        yield
    finally:
        for layer, attribute, original in reversed(swapped):
            setattr(layer, attribute, original)
