"""`Runner`: one sequence of one model, run token by token against its own KV cache.

The Runner is a thin object over a backend (`backend.eager.EagerDecoder`: the stock model over a
`DynamicCache`, any causal LM; `backend.decoder.StaticDecoder`: the static fast path), chosen in one
place (`choose_backend`). It feeds new tokens at explicit positions with an optional tree mask
(`backend.Feed`) and rolls the cache back through the `backend.KVCache` protocol (`crop` / `select`).
The decoding methods see only the Runner; loading lives in `draftverify.loading`.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftverify.backend.cache import KVCache
from draftverify.backend.decoder import StaticDecoder
from draftverify.backend.eager import EagerDecoder
from draftverify.backend.feed import Feed, Forward
from draftverify.backend.graphed import GraphedDecoder
from draftverify.backend.linear import Packs
from draftverify.backend.recipe import unsupported_layer_types, unsupported_reason
from draftverify.errors import require
from draftverify.loading.hf import model_device

__all__ = ["BACKENDS", "Feed", "Forward", "Runner", "Shared", "choose_backend", "forward_many"]

MASKABLE_ATTENTION = ("sdpa", "eager")
BACKENDS = ("auto", "static", "eager", "graph")


def choose_backend(model: torch.nn.Module, backend: str = "auto") -> tuple[str, str | None]:
    """The backend a Runner of `model` uses, and why `auto` fell back to eager (None if it did not).

    `static` is the fast path (`backend.decoder`: static KV cache, prepacked fused linears);
    `eager` calls the stock transformers model with a dynamic cache and works for any causal LM;
    `graph` (`backend.graphed`) runs every forward at one shape, replayed as a CUDA graph on a GPU.
    """
    require(backend in BACKENDS, f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return "eager", None
    reason = unsupported_reason(model)
    if backend in ("static", "graph"):
        require(reason is None, f"backend {backend!r} cannot run this model ({reason}): use --backend eager or auto")
        return backend, None
    if reason is None and model_device(model).type != "cpu":
        reason = "off a CPU the static path runs plain torch ops, host-bound like the stock model (docs/backends.md)"
    return ("eager", reason) if reason else ("static", None)


def check_runnable(model: torch.nn.Module) -> None:
    """Refuse, in one line each, a model no backend can mask or run token by token."""
    impl = getattr(model.config, "_attn_implementation", None)
    require(
        impl in MASKABLE_ATTENTION,
        f"attention implementation {impl!r} cannot take a custom 4-D mask: load the model with "
        "attn_implementation='sdpa' (or 'eager')",
    )
    require(
        getattr(model.config, "is_encoder_decoder", False) is False,
        f"{type(model).__name__} is an encoder-decoder model: draftverify needs a decoder-only causal LM",
    )
    odd = unsupported_layer_types(model.config)
    require(
        not odd,
        f"{type(model).__name__} has layer types {odd} that draftverify cannot mask: "
        "use a model with full or sliding-window attention",
    )


@dataclass(eq=False)
class Shared:
    """What the runners of one engine share, built or learned once: the static path's packed weights (`packs`),
    the measured cost curves (`costs.curve`: per model) and the feature head's calibration
    (`drafters.feature.acceptance`: per head). An engine owns one and hands it to its runners (forks keep it);
    nothing of it is process-wide, so two engines in one process never steer each other. `curve_folder`: where
    the curves are also kept on disk between processes (`costs.cache_folder()` for an engine; None: measured
    by every process). `full_curves`: measure each curve in full, with its growth with context (a server's start,
    the bench), where a quick curve within a fixed budget of forwards serves otherwise (`costs.curves`)."""

    packs: Packs = field(default_factory=Packs)
    curves: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    calibration: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    curve_folder: Path | None = None
    full_curves: bool = False


class Runner:
    """One sequence, one KV cache: feed new tokens, read logits, roll back.

    The cache holds `length` tokens at cache slots 0..length-1. `forward` appends new tokens;
    by default they sit at the next positions with causal attention. For a tree or a Jacobi
    window pass `positions` [n] (their position ids) and `tree_mask` [n, n] (bool, True =
    token i may attend new token j); every new token attends the whole cached prefix (within
    each layer's sliding window, if it has one). `run(feed)` takes the same as one `Feed`.
    Rollback is `crop(length)` (drop everything after) or `select(keep, slots)` (keep the
    first `keep` slots and then the given slots, in order: one accepted path of a tree).
    `forward(skip=...)` bypasses a drafters.skipsets.SkipSet's sub-layers (self-speculative drafting in
    the same cache); a crop back to the verified prefix, then a full forward, rewrites them.

    `backend` (see `choose_backend`) names the decoder (`self.decoder`) the forwards run on;
    `fallback_reason` says why `auto` chose eager. `draft=True`: a draft model's runner; on the static
    path its forwards may use rounded weights (Q8_0; what it proposes, never what is accepted).
    `shared`: what this runner shares with the other runners of its engine (`Shared`; a runner of its own
    when None).
    """

    def __init__(
        self, model: torch.nn.Module, backend: str = "auto", draft: bool = False, shared: Shared | None = None
    ):
        check_runnable(model)
        self.backend, self.fallback_reason = choose_backend(model, backend)
        if self.backend in ("eager", "graph") and hasattr(model, "stock"):  # a GGUF model read from its file: these
            model = model.stock()  # need the stock module (loading.gguf_model)
        self.model = model
        self.device, self.dtype = _device_dtype(model)
        self.draft = draft
        self.shared = shared if shared is not None else Shared()
        decoders = {"static": StaticDecoder, "graph": GraphedDecoder}
        self.decoder = (
            decoders[self.backend](model, draft, self.shared.packs) if self.backend in decoders else EagerDecoder(model)
        )
        self.cache: KVCache = self.decoder.new_cache()
        self.max_length = getattr(model.config, "max_position_embeddings", None)
        if self.backend == "graph":  # its caches hold a context of its own (`GraphedDecoder.max_length`)
            self.max_length = self.decoder.max_length
        self.forwards = 0  # forward calls since construction (all callers)

    def fork(self) -> "Runner":
        """Another runner of the same model on the same decoder, with a cache of its own (one more sequence of a
        batch): the decoder and its packed weights are shared, not rebuilt."""
        other = object.__new__(Runner)
        other.__dict__.update(self.__dict__)
        other.cache, other.forwards = self.cache.fork(), 0
        return other

    @property
    def static(self) -> StaticDecoder | None:
        """The static decoder when this runner is on the static path (None on eager)."""
        return self.decoder if self.backend == "static" else None

    @property
    def rows_alone(self) -> bool:
        """Whether a forward's rows do not depend on the rows beside them (`StaticDecoder.rows_alone`)."""
        return self.static is not None and self.static.rows_alone

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        self.cache.crop(length)

    def select(self, keep: int, slots: list[int]) -> None:
        """Keep cache slots 0..keep-1 followed by `slots` (each >= keep), dropping the rest."""
        self.cache.select(keep, slots)

    def cached_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the cached keys and values of the slots in use: [kv heads, slots, head dim] each
        (a layer skipped while drafting on the eager backend may hold fewer slots)."""
        return self.cache.kv()

    def forward(
        self,
        tokens: torch.Tensor | list[int],
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        last: int | None = None,
        hidden: bool | str = False,
        skip=None,
        vocab: torch.Tensor | None = None,
    ) -> Forward:
        """Append `tokens` [n] to the cache and return logits for the last `last` of them (all if None);
        the arguments are `backend.Feed`'s."""
        return self.run(Feed(tokens, positions, tree_mask, last, hidden, skip, vocab))

    def run(self, feed: Feed) -> Forward:
        """One forward of `feed` on this runner's decoder and cache."""
        out = self.decoder.forward(self.cache, self.on_device(feed))
        self.forwards += 1
        return out

    def on_device(self, feed: Feed) -> Feed:
        """`feed` with its tokens as a [n] long tensor on the model's device."""
        device = getattr(self.decoder, "input_device", self.device)  # the graph backend takes host ids
        tokens = torch.as_tensor(feed.tokens, dtype=torch.long, device=device).view(-1)
        return dataclasses.replace(feed, tokens=tokens)


def _device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    if getattr(model, "weight_source", None) is not None:  # a GGUF model: fp32 on the CPU, nothing to look at
        return torch.device("cpu"), torch.float32
    weight = model.get_input_embeddings().weight
    return weight.device, weight.dtype


def forward_many(runners: list[Runner], feeds: list[Feed]) -> list[Forward]:
    """One forward for several sequences, each on its own runner. Static runners of one model stack their
    rows into one forward (`StaticDecoder.forward_many`: the linears run once for all); others run one
    after another."""
    first = runners[0] if runners else None
    if len(runners) < 2 or not all(r.static is not None and r.model is first.model for r in runners):
        return [r.run(feed) for r, feed in zip(runners, feeds)]
    outs = first.decoder.forward_many([r.cache for r in runners], [first.on_device(feed) for feed in feeds])
    for r in runners:
        r.forwards += 1
    return outs
