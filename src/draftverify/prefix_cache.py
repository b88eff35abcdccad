"""An exact prefix cache across requests: a request reuses the target's keys and values of the longest prefix of its
prompt that an earlier request computed (a chat's earlier turns: their prompt and reply), and prefills only the rest.

Why it is exact: on a runner whose rows do not depend on the rows beside them (`Runner.rows_alone`: the static path
with row-invariant products and the kernels' attention), a token's keys and values, and its final hidden state, are the
same bits in whatever forward computed them (a whole prefill, a prompt fed in parts, a verified row of a draft). So a
prefix copied from an earlier request's cache holds exactly what a fresh prefill would write, and the logits of the
first new token are those of a full prefill, bit for bit (tests/test_prefix_cache.py checks it in q8 and fp32).
Elsewhere (the eager backend, whose batched sums differ by row count; the graph backend) the cache is off: every
request prefills its whole prompt.

What an entry holds: the token ids whose keys and values the request's cache held when it ended (prompt + reply, cut
to what the cache holds: the last emitted token never entered it), copies of those keys and values, and the target's
final hidden states of the prompt's positions when the request asked for them (a drafter that `needs_hidden`: the
feature head). A request whose drafter needs hidden states reuses only a prefix whose hidden states are held (the
reply's are not: no forward computes them for every method), so its drafter starts from the same states as without
the cache. At least the prompt's last token is always prefilled: its logits give the first new token.

Memory is bounded: entries are kept least recently used first, and the oldest go once their bytes pass the budget;
an entry that is a prefix of a newer one is replaced by it. The counters (`hits`, `misses`, `tokens_reused`,
`evictions`, `nbytes`) are served at the server's /metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from draftverify.errors import require


@dataclass(eq=False)
class Entry:
    key: int  # its place in `PrefixCache.entries`
    tokens: torch.Tensor  # [L] token ids whose keys and values are held
    kv: list[torch.Tensor]  # per layer the keys, then per layer the values: [kv heads, L, head dim] each
    hidden: torch.Tensor | None  # [h, H] final hidden states of positions 0..h-1 (h <= L), or None
    nbytes: int

    @property
    def hidden_rows(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[0]


def common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading token ids of a [n] and b [m] agree."""
    m = min(a.shape[0], b.shape[0])
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0, 0]) if differ.shape[0] else m


class PrefixCache:
    """Snapshots of a target's KV cache keyed by token-id prefix, LRU by bytes under `budget` bytes (see the module
    docstring). One engine owns one; its requests (one or a batch) restore from it and store into it."""

    def __init__(self, budget: int):
        require(budget >= 0, f"prefix cache budget {budget} must be at least 0 bytes (0: off)")
        self.budget = budget
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.nbytes = 0
        self.reset_counters()
        self._next = 0

    def reset_counters(self) -> None:
        """Count from zero again (the entries stay)."""
        self.hits = self.misses = self.tokens_reused = self.evictions = 0

    @classmethod
    def resized(cls, cache: PrefixCache | None, budget: int) -> PrefixCache | None:
        """`cache` with a budget of `budget` bytes: None for 0, a new cache for None, else `cache` resized."""
        require(budget >= 0, f"prefix cache budget {budget} must be at least 0 bytes (0: off)")
        if budget == 0 or cache is None:
            return cls(budget) if budget else None
        cache.resize(budget)
        return cache

    @staticmethod
    def usable(target) -> bool:
        """Whether `target`'s cached rows are the bits a fresh prefill gives (else the cache is off for it)."""
        return target.rows_alone

    def find(self, prompt: list[int], need_hidden: bool) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that length (at most len(prompt) - 1; when
        `need_hidden`, at most the entry's hidden rows); (None, 0) when none shares a token."""
        ids = torch.tensor(prompt, dtype=torch.long)
        best, length = None, 0
        for entry in self.entries.values():
            cap = len(prompt) - 1 if not need_hidden else min(len(prompt) - 1, entry.hidden_rows)
            n = min(common_length(entry.tokens, ids), cap)
            if n > length:
                best, length = entry, n
        return best, length

    def restore(self, target, prompt: list[int], need_hidden: bool) -> tuple[int, torch.Tensor | None]:
        """Empty `target`'s cache and fill it with the longest stored prefix of `prompt`: the prefix's length n (0: a
        miss) and, when `need_hidden`, its hidden states [n, H]."""
        target.reset()
        entry, n = self.find(prompt, need_hidden)
        if entry is None:
            self.misses += 1
            return 0, None
        self.entries.move_to_end(entry.key)
        self.hits += 1
        self.tokens_reused += n
        target.cache.load(entry.kv, n)
        return n, entry.hidden[:n] if need_hidden else None

    def store(self, target, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """Keep what `target`'s cache holds of `tokens` (the request's prompt and reply; the cache holds their first
        `target.length`), with the prompt's hidden states `hidden` [h, H] when the request had them."""
        tokens = tokens[: target.length]
        if not tokens or self.budget == 0:
            return
        ids, rows = torch.tensor(tokens, dtype=torch.long), 0 if hidden is None else hidden.shape[0]
        for key, entry in list(self.entries.items()):
            shared = common_length(entry.tokens, ids)
            if shared == len(tokens) and entry.hidden_rows >= rows:  # already held: it is used again
                self.entries.move_to_end(key)
                return
            if shared == entry.tokens.shape[0] and entry.hidden_rows <= rows:  # a prefix of this one: replaced
                self._drop(key)
        kv = target.cache.export(len(tokens))
        hidden = None if hidden is None else hidden.detach().clone()
        nbytes = sum(t.nbytes for t in kv) + ids.nbytes + (0 if hidden is None else hidden.nbytes)
        if nbytes > self.budget:
            return
        self.entries[self._next] = Entry(self._next, ids, kv, hidden, nbytes)
        self._next += 1
        self.nbytes += nbytes
        self.resize(self.budget)

    def resize(self, budget: int) -> None:
        """A new budget; the least recently used entries go until the rest fit."""
        require(budget >= 0, f"prefix cache budget {budget} must be at least 0 bytes (0: off)")
        self.budget = budget
        while self.nbytes > self.budget:
            self._drop(next(iter(self.entries)))
            self.evictions += 1

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        self.entries.clear()
        self.nbytes = 0

    def counters(self) -> dict[str, int]:
        """hits, misses, tokens_reused, evictions, entries and bytes held."""
        names = ("hits", "misses", "tokens_reused", "evictions", "nbytes")
        return {**{name: getattr(self, name) for name in names}, "entries": len(self.entries)}

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes


def prefill_start(s, target, need_hidden: bool) -> tuple[int, torch.Tensor | None]:
    """The round's prologue: `target`'s cache emptied, or filled with the longest cached prefix of `s.prompt` when the
    request's engine keeps a prefix cache and `target` may use it (`PrefixCache.restore`)."""
    cache = s.prefix_cache
    if cache is None or cache.budget == 0 or not PrefixCache.usable(target):
        target.reset()
        return 0, None
    n, hidden = cache.restore(target, s.prompt, need_hidden)
    s.stats.cached_tokens = n
    return n, hidden


def keep(s, target, hidden: torch.Tensor | None) -> None:
    """A request ended normally: store its prompt and reply as far as `target`'s cache holds them."""
    cache = s.prefix_cache
    if cache is not None and cache.budget > 0 and PrefixCache.usable(target):
        cache.store(target, s.prompt + s.output, hidden)
