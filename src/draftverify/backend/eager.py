"""The stock transformers model over a `DynamicCache` (`EagerCache`): works for any causal LM that takes a
custom 4-D attention mask. Trees and Jacobi windows go through the stock `attention_mask` plus explicit
`position_ids`; layer skipping is a context manager around the stock decoder layers (`SkipSet.applied`)."""

from __future__ import annotations

import contextlib
import inspect

import torch

from draftverify.backend.cache import EagerCache
from draftverify.backend.feed import Feed, Forward
from draftverify.backend.ops import layer_windows, vocab_logits, window_masks


class EagerDecoder:
    """Runs the stock model; sliding windows are applied through explicit per-layer-type masks (the cache keeps
    every layer's full history, see `EagerCache`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.windows = layer_windows(model.config)
        self._dict_masks = isinstance(getattr(model.config, "layer_types", None), (list, tuple))
        # the cache's argument: `cache` in recent transformers 5 (which still maps the older name, warning that it
        # goes), `past_key_values` before
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self) -> EagerCache:
        return EagerCache(self.device)

    def forward_many(self, caches: list[EagerCache], feeds: list[Feed]) -> list[Forward]:
        """One forward after another: the stock model has no stacked form over several caches."""
        return [self.forward(cache, feed) for cache, feed in zip(caches, feeds)]

    @torch.inference_mode()
    def forward(self, cache: EagerCache, feed: Feed) -> Forward:
        """Feed `feed.tokens` [n] (a tensor on the model's device) after `cache`'s tokens."""
        tokens, positions, tree_mask, skip = feed.tokens, feed.positions, feed.tree_mask, feed.skip
        n, past = tokens.shape[0], cache.length
        kwargs = {}
        sliding = any(w is not None for w in self.windows)
        if positions is not None or tree_mask is not None or sliding or skip is not None:
            # explicit positions and mask: the model would size them from layer 0's cache
            if positions is None:
                positions = torch.arange(past, past + n, device=self.device)
            kwargs["position_ids"] = positions.to(self.device).view(1, n)
            if tree_mask is None:
                tree_mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            kwargs["attention_mask"] = self._masks(tree_mask, positions.to(self.device), past)
        with skip.applied(self.model) if skip is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=tokens.view(1, n),
                use_cache=True,
                logits_to_keep=feed.last or 0,
                output_hidden_states=bool(feed.hidden),
                **{self._cache_arg: cache.store},
                **kwargs,
            )
        cache.length += n
        logits = out.logits[0]  # [m, V]
        if feed.vocab is not None:  # a draft's vocabulary (`Feed.vocab`): those tokens' logits, every other -inf
            logits = vocab_logits(logits.index_select(1, feed.vocab.to(self.device)), feed.vocab, logits.shape[1])
        states = None
        if feed.hidden:  # [m, H], or [n, H] for "all"
            last = out.hidden_states[-1][0]
            states = last if feed.hidden == "all" else last[-logits.shape[0] :]
        return Forward(logits, states)

    def _masks(self, tree_mask: torch.Tensor, positions: torch.Tensor, past: int):
        """Additive [1, 1, n, past + n] mask(s) over cache + new tokens: one tensor, or one per layer type."""
        n = tree_mask.shape[0]
        allowed = window_masks(positions, tree_mask, past, [None, *self.windows])

        def additive(ok: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(n, past + n, dtype=self.dtype, device=self.device)
            return mask.masked_fill_(~ok, torch.finfo(self.dtype).min).view(1, 1, n, past + n)

        if self._dict_masks:
            sliding = next((w for w in self.windows if w is not None), None)
            return {"full_attention": additive(allowed[None]), "sliding_attention": additive(allowed[sliding])}
        return additive(allowed[self.windows[0]])
