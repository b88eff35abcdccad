"""Lookahead drafting (Fu et al. 2023): Jacobi guesses grow an n-gram pool that drafts for the model.

Each round proposes the (at most G) pool n-grams that start with the root, merged into a trie,
together with the lookahead branch: a window of W columns and N - 1 rows of Jacobi guesses
that rides in the same forward (layout in `draftverify.tree`). Afterwards the window's last row
of outputs becomes a new row and every column yields an N-gram for the pool; with `context`
the request's own n-grams go into the pool as well (the prompt's at the start, each new one as
tokens are emitted), so text that repeats the prompt or itself is guessed.
"""

from __future__ import annotations

from typing import Sequence

from draftverify.drafters.base import Drafter, Proposal, add
from draftverify.drafters.pool import PhrasePool
from draftverify.session import Session


class JacobiWindow:
    """The lookahead branch: up to N - 1 rows of W guessed tokens, cell (l, i) at root + i + l.

    Rows are added one per step until there are N - 1 of them; from then on each step turns
    every column (row tokens, then the last row's output) into an N-gram and drops the oldest
    row. Either way the window moves one position, as the root does. Empty cells are filled
    with prompt tokens taken in order (deterministic; no random source needed).
    """

    def __init__(self, W: int, N: int, source: Sequence[int], avoid: Sequence[int] = ()):
        self.W, self.N = W, N
        self._source = [t for t in source if t not in set(avoid)] or [0]
        self._avoid = set(avoid)
        self._next = 0
        self.rows: list[list[int]] = [[self._fill() for _ in range(W)]] if W else []

    def _fill(self) -> int:
        token = self._source[self._next % len(self._source)]
        self._next += 1
        return token

    def for_root(self, root: int) -> list[list[int]]:
        """The rows to feed, with cell (0, 0) standing for `root`."""
        if not self.rows:
            return []
        return [[root] + self.rows[0][1:]] + [list(r) for r in self.rows[1:]]

    def advance(self, root: int, outputs: Sequence[int]) -> list[tuple[int, ...]]:
        """Take the last row's outputs [W]; return the N-grams harvested (none while filling)."""
        rows = self.for_root(root)
        grams = [tuple(r[i] for r in rows) + (outputs[i],) for i in range(self.W)] if len(rows) == self.N - 1 else []
        new_row = [t if t not in self._avoid else self._fill() for t in outputs]  # EOS in the window stalls it
        if grams:
            self.rows = rows[1:] + [new_row]
        else:
            self.rows = [r[1:] + [self._fill()] for r in rows] + [new_row[1:] + [self._fill()]]
        return grams


def window_for(s: Session, W: int, N: int) -> JacobiWindow | None:
    """A request's Jacobi window, filled from its prompt (None when W = 0)."""
    return JacobiWindow(W, N, source=s.prompt, avoid=s.stopping.eos_token_ids) if W else None


def ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Every run of n consecutive tokens, in order (so the last is the newest in the pool)."""
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


class LookaheadDrafter(Drafter):
    free = True  # a pool lookup; the window's rows are built, not run
    label = "lookahead"

    def __init__(self, pool: PhrasePool, W: int, N: int, G: int, context: bool):
        self.pool, self.W, self.N, self.G, self.context = pool, W, N, G, context
        self.window: JacobiWindow | None = None

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        self.window = window_for(s, self.W, self.N)
        if self.context:
            add(s.stats.extra, context_ngrams=self.pool.insert_all(ngrams(seq, self.N)))

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        root = seq[-1]
        rows = self.window.for_root(root) if self.window is not None and room > self.W + self.N else []
        return Proposal([c[:room] for c in self.pool.get(root, self.G)] if room > 0 else [], rows=rows)

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step) -> None:
        grams = self.window.advance(seq[-1], step.window_out) if step.window_out is not None else []
        add(s.stats.extra, window_ngrams=self.pool.insert_all(grams))
        if self.context:  # the n-grams that end in the new tokens
            tail = seq[max(0, len(seq) - self.N + 1) :] + step.tokens  # (not a copy of the whole sequence each round)
            add(s.stats.extra, context_ngrams=self.pool.insert_all(ngrams(tail, self.N)))
