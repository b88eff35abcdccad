"""The phrase pool of lookahead decoding and Ouroboros: n-grams keyed by their first token.

A phrase is N tokens `(v, c_2, ..., c_N)`. The pool keeps, for each first token v, at most
`cap` continuations `(c_2, ..., c_N)` (Ouroboros's P(v) with |P(v)| <= W; lookahead's guess
set of size G). Inserting a phrase makes it the newest of its key (re-inserting one already
there refreshes it); when a key holds more than `cap` the least recently inserted one goes.
`get(v, k)` returns the k newest, newest first.

Besides insertion, verification feeds the pool in two ways (Ouroboros, Zhao et al. 2024):
- *candidate inspiration*: sub-sequences of the discarded part of a draft that match the
  target's own predictions (`inspirations`) become new phrases;
- *candidate refinement*: a phrase used as a draft suffix is replaced by the target's
  corrected version of it (`replace`), keeping its place in the recency order.

The pool can be saved to and loaded from a JSON file that records the tokenizer it was made
with; writing is atomic and a corrupt or mismatched file is refused with one line.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Sequence

from draftverify.errors import DraftVerifyError, require
from draftverify.util import atomic_path

FORMAT = "draftverify-phrase-pool"
VERSION = 1

Phrase = tuple[int, ...]


class PhrasePool:
    """Phrases of `n` tokens keyed by their first token; at most `cap` per key, LRU eviction."""

    def __init__(self, n: int, cap: int):
        require(n >= 2, f"phrase length N={n} must be at least 2")
        require(cap >= 1, f"phrases per token G={cap} must be at least 1")
        self.n = n
        self.cap = cap
        self._by_key: dict[int, OrderedDict[Phrase, None]] = {}  # oldest first

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_key.values())

    def __contains__(self, phrase: Sequence[int]) -> bool:
        entries = self._by_key.get(phrase[0])
        return entries is not None and tuple(phrase[1:]) in entries

    def keys(self) -> list[int]:
        return list(self._by_key)

    def insert(self, phrase: Sequence[int]) -> None:
        """Add phrase (n tokens) as the newest of its first token, evicting the oldest beyond `cap`."""
        require(len(phrase) == self.n, f"a phrase has {self.n} tokens, got {len(phrase)}")
        entries = self._by_key.setdefault(int(phrase[0]), OrderedDict())
        rest = tuple(int(t) for t in phrase[1:])
        entries[rest] = None
        entries.move_to_end(rest)
        if len(entries) > self.cap:
            entries.popitem(last=False)

    def insert_all(self, phrases: Iterable[Sequence[int]]) -> int:
        count = 0
        for phrase in phrases:
            self.insert(phrase)
            count += 1
        return count

    def get(self, key: int, k: int | None = None) -> list[Phrase]:
        """The continuations (n - 1 tokens each) of `key`, newest first, at most `k` of them."""
        entries = self._by_key.get(int(key))
        if not entries:
            return []
        newest_first = list(reversed(entries))
        return newest_first if k is None else newest_first[:k]

    def replace(self, key: int, old: Sequence[int], new: Sequence[int]) -> bool:
        """Candidate refinement: continuation `old` of `key` becomes `new` in the same recency slot.

        If `old` is gone (evicted meanwhile) `new` is inserted as the newest; if `new` is already
        there, `old` is dropped. Returns True when the pool changed.
        """
        old, new = tuple(int(t) for t in old), tuple(int(t) for t in new)
        require(len(new) == self.n - 1, f"a continuation has {self.n - 1} tokens, got {len(new)}")
        entries = self._by_key.get(int(key))
        if old == new:
            return False
        if entries is None or old not in entries:
            self.insert((key,) + new)
            return True
        if new in entries:
            del entries[old]
            return True
        self._by_key[int(key)] = OrderedDict((new if e == old else e, None) for e in entries)
        return True

    def clear(self) -> None:
        self._by_key.clear()

    # -- files --------------------------------------------------------------------------------

    def save(self, path: str | Path, tokenizer: str) -> None:
        """Write the pool to `path` (JSON) atomically: a temporary file renamed over the target."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": tokenizer,
            "n": self.n,
            "cap": self.cap,
            "phrases": {str(k): [list(c) for c in entries] for k, entries in self._by_key.items()},
        }
        with atomic_path(path) as tmp, open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))

    @classmethod
    def load(cls, path: str | Path, tokenizer: str, n: int, cap: int, vocab_size: int | None = None) -> "PhrasePool":
        """Read a pool saved by `save`, refusing a corrupt file, another tokenizer or another N.

        A pool saved with a larger `cap` keeps the newest `cap` phrases of each token.
        """
        path = Path(path)
        fix = "delete it or pass another pool file"
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DraftVerifyError(f"pool file {path} is unreadable or corrupt ({type(exc).__name__}): {fix}") from exc
        require(
            isinstance(data, dict) and data.get("format") == FORMAT, f"{path} is not a draftverify phrase pool: {fix}"
        )
        require(
            data.get("version") == VERSION,
            f"pool file {path} has version {data.get('version')!r}, expected {VERSION}: {fix}",
        )
        require(
            data.get("tokenizer") == tokenizer,
            f"pool file {path} was made with another tokenizer: {fix} (pools only fit the model family they were "
            f"built with)",
        )
        require(
            data.get("n") == n,
            f"pool file {path} holds phrases of N={data.get('n')} tokens but the method uses N={n}: {fix} or set "
            f"N={data.get('n')}",
        )
        pool = cls(n, cap)
        phrases = data.get("phrases")
        require(isinstance(phrases, dict), f"pool file {path} is corrupt (no phrase table): {fix}")
        for key, entries in phrases.items():
            require(
                key.lstrip("-").isdigit() and isinstance(entries, list),
                f"pool file {path} is corrupt (bad entry {key!r}): {fix}",
            )
            for rest in entries:
                phrase = [int(key)] + (rest if isinstance(rest, list) else [])
                valid = len(phrase) == n and all(
                    isinstance(t, int) and t >= 0 and (vocab_size is None or t < vocab_size) for t in phrase
                )
                require(valid, f"pool file {path} is corrupt (bad phrase {phrase[: n + 1]!r} under token {key}): {fix}")
                pool.insert(phrase)
        return pool


def inspirations(draft: Sequence[int], predicted: Sequence[int], accepted: int, n: int) -> list[Phrase]:
    """Ouroboros's candidate inspiration: phrases from the discarded part of a rejected draft.

    `draft` = d_1..d_g, `predicted` = the target's tokens for the same positions and one more
    (g + 1: predicted[j] is what the target puts where d_{j+1} stands, given d_1..d_j), and
    `accepted` = l, the length of the accepted prefix. Every window d_i..d_{i+n-2} after the
    corrected position (i > l) that equals the target's predictions there yields the phrase
    predicted[i .. i+n-1] (n tokens: the matched n - 1 plus the target's next token).
    """
    g = len(draft)
    assert len(predicted) == g + 1, "predicted needs one token per draft position plus the one after"
    found = []
    for i in range(accepted + 1, g - n + 2):
        if list(draft[i : i + n - 1]) == list(predicted[i : i + n - 1]):
            found.append(tuple(int(t) for t in predicted[i : i + n]))
    return found
