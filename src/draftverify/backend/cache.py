"""The one KV-cache interface every caller sees, and its two model caches.

A cache holds `length` tokens in slots 0..length-1 (slot i of the committed prefix holds position i).
Rolling back is boring on purpose: `crop(length)` only moves the length, `select(keep, slots)` keeps
slots 0..keep-1 followed by `slots` (one accepted path of a tree, in order). The round, the step and the
drafters use only this protocol (through `models.Runner`, which forwards it); the feature head's own
cache (`feature_head.HeadCache`) implements it too.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    """length / crop / select / fork / reset; see the module docstring."""

    @property
    def length(self) -> int: ...

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens."""

    def select(self, keep: int, slots: list[int]) -> None:
        """Keep slots 0..keep-1 followed by `slots` (each >= keep), dropping the rest."""

    def fork(self) -> "KVCache":
        """An empty cache of the same shape (another sequence)."""

    def reset(self) -> None:
        """Empty the cache for a new sequence."""


class StaticCache:
    """The static decoder's cache: one preallocated [kv heads, capacity, head dim] buffer per layer for keys and
    one for values, written by slot; capacity doubles when full (never past the model's positions)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, max_length: int | None):
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device, self.max_length = dtype, device, max_length
        self.length = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []  # per layer [n_kv, capacity, head_dim]
        self.values: list[torch.Tensor] = []

    def fork(self) -> "StaticCache":
        return StaticCache(*self.shape, self.dtype, self.device, self.max_length)

    def reset(self) -> None:
        self.length = 0  # the buffers stay allocated for the next sequence

    def reserve(self, needed: int) -> None:
        """Room for `needed` slots, keeping the slots in use."""
        if needed <= self.capacity:
            return
        capacity = max(256, self.capacity)
        while capacity < needed:
            capacity *= 2
        if self.max_length:
            capacity = max(needed, min(capacity, self.max_length))
        layers, kv_heads, head_dim = self.shape
        fresh = [
            torch.zeros((kv_heads, capacity, head_dim), dtype=self.dtype, device=self.device) for _ in range(2 * layers)
        ]
        for old, new in zip(self.keys + self.values, fresh):
            new[:, : self.length].copy_(old[:, : self.length])
        self.keys, self.values = fresh[:layers], fresh[layers:]
        self.capacity = capacity

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()  # the buffers are inference tensors (made inside a forward)
    def select(self, keep: int, slots: list[int]) -> None:
        if slots == list(range(keep, keep + len(slots))):
            return self.crop(keep + len(slots))
        index = torch.tensor(slots, device=self.device)
        for buf in self.keys + self.values:  # gather in place: the accepted slots move down to keep..
            buf[:, keep : keep + len(slots)] = buf.index_select(1, index)
        self.length = keep + len(slots)

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of the slots in use: [kv heads, slots, head dim] each."""
        return [(k[:, : self.length], v[:, : self.length]) for k, v in zip(self.keys, self.values)]

    @torch.inference_mode()
    def export(self, length: int) -> list[torch.Tensor]:
        """Copies of slots 0..length-1 (length <= `self.length`): per layer the keys, then per layer the values,
        [kv heads, length, head dim] each (the prefix cache's snapshot, `prefix_cache.PrefixCache`)."""
        return [buf[:, :length].clone() for buf in self.keys + self.values]

    @torch.inference_mode()
    def load(self, kv: list[torch.Tensor], length: int) -> None:
        """Hold exactly `length` slots, copied from an `export` of at least that many."""
        self.length = 0
        self.reserve(length)
        for buf, saved in zip(self.keys + self.values, kv):
            buf[:, :length].copy_(saved[:, :length])
        self.length = length


class EagerCache:
    """The stock model's cache (a transformers `DynamicCache`), with the length counted here: a layer skipped
    while drafting (`Feed.skip`) holds fewer tokens than the others, so no layer's count is the sequence's.
    Every layer keeps its full history (a sliding layer's own cache would drop keys a rollback needs)."""

    def __init__(self, device):
        from transformers import DynamicCache

        self.device = device
        self.store = DynamicCache()
        self.length = 0

    def fork(self) -> "EagerCache":
        return EagerCache(self.device)

    def reset(self) -> None:
        from transformers import DynamicCache

        self.store = DynamicCache()
        self.length = 0

    def crop(self, length: int) -> None:
        for layer in self.store.layers:  # per layer: a layer skipped while drafting holds fewer tokens
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        self.length = min(self.length, length)

    def select(self, keep: int, slots: list[int]) -> None:
        if slots == list(range(keep, keep + len(slots))):
            return self.crop(keep + len(slots))
        index = torch.tensor(list(range(keep)) + list(slots), device=self.device)
        for layer in self.store.layers:  # the one place that touches DynamicCache internals
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index.to(layer.keys.device))
                layer.values = layer.values.index_select(-2, index.to(layer.values.device))
        self.length = keep + len(slots)

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the cached keys and values: [kv heads, slots, head dim] each (a layer skipped while drafting
        may hold fewer slots)."""
        return [(layer.keys[0], layer.values[0]) for layer in self.store.layers]
