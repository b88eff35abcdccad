"""Lookahead decoding: Jacobi guesses grow an n-gram pool that drafts for the model itself.

Fu et al. 2023, "Breaking the Sequential Dependency of LLM Inference Using Lookahead
Decoding" (as described in the Ouroboros papers). One model, no draft. Each step is ONE
forward over three parts (layout in `draftverify.tree`; drafting in `drafters.lookahead`):
1. the root (the last emitted token);
2. the lookahead branch: a window of W columns and N - 1 rows of Jacobi guesses; the last
   row's outputs become a new row, and every column yields an N-gram for the pool;
3. the verification branch: the (at most G) pool n-grams that start with the root, merged
   into a trie and verified by `verify_tree`: greedy matching, or multi-draft rejection
   sampling for sampled decoding (the n-grams are deterministic guesses). The longest
   accepted n-gram is kept **plus the bonus token** (the reference implementation drops it).
Rollback keeps the root and the accepted path in the cache; the window moves one column.

The pool (`draftverify.drafters.pool.PhrasePool`) can outlive a request (`reuse`) and a process
(`pool_file`): `PoolMethod`, shared with Ouroboros.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path

from draftverify.drafters.base import Drafter
from draftverify.drafters.lookahead import LookaheadDrafter
from draftverify.drafters.pool import PhrasePool
from draftverify.errors import require
from draftverify.loading import tokenizer_fingerprint, vocab_rows
from draftverify.methods.base import Method, register
from draftverify.round import Rounds, rounds
from draftverify.session import Session


class PoolMethod(Method):
    """A method with a phrase pool that may outlive a request (`reuse`) and a process (`pool_file`).

    Its Config has fields `N` (phrase length), `G` (phrases kept per first token), `reuse`
    and `pool_file`. `reuse=True`: one pool for every request of this method instance (warm
    start), loaded from `pool_file` at the first request if the file exists and saved to it
    atomically after each request. `reuse=False`: each request starts from the file's pool
    (or an empty one) and its phrases are dropped afterwards; the file is not written.
    """

    pool: PhrasePool | None = None
    _fingerprint: str | None = None  # the tokenizer's, once a request has shown it

    first: "PoolMethod | None" = None  # the slot-0 instance whose pool this one shares (batch slots; `share`)

    def share(self, first: "PoolMethod") -> None:
        self.first = first

    def warm_state(self) -> PhrasePool | None:
        return copy.deepcopy((self.first or self).pool) if self.config.reuse else None

    def restore_warm_state(self, state: PhrasePool | None) -> None:
        if self.config.reuse:
            (self.first or self).pool = copy.deepcopy(state)

    def rounds(self, s: Session) -> Rounds:
        owner = (
            (self.first or self) if self.config.reuse else self
        )  # with reuse, every slot of a batch drafts from one pool
        if owner.pool is None or not self.config.reuse:
            owner.pool = owner._starting_pool(s)
        pool = owner.pool
        try:
            yield from rounds(s, self.target, self.pool_drafter(s, pool))
        finally:
            s.stats.extra["pool_phrases"] = len(pool)
            if self.config.reuse and self.config.pool_file:
                owner.save_pool()

    @abstractmethod
    def pool_drafter(self, s: Session, pool: PhrasePool) -> Drafter:
        """The drafter of request `s`, drafting from `pool`."""

    def save_pool(self, path: str | Path | None = None) -> None:
        """Write the pool to `path` (default: the `pool_file` option) atomically."""
        path = path or self.config.pool_file
        require(path is not None, "no pool file to save to: pass pool_file=PATH")
        require(
            self.pool is not None and self._fingerprint is not None, "there is no pool yet: generate something first"
        )
        self.pool.save(path, self._fingerprint)

    def _starting_pool(self, s: Session) -> PhrasePool:
        cfg = self.config
        if not cfg.pool_file:
            return PhrasePool(cfg.N, cfg.G)
        require(
            s.tokenizer is not None, "pool_file needs the tokenizer to check the pool against: generate through Engine"
        )
        self._fingerprint = tokenizer_fingerprint(s.tokenizer)
        if not Path(cfg.pool_file).exists():
            return PhrasePool(cfg.N, cfg.G)
        vocab = vocab_rows(self.target.model)
        return PhrasePool.load(cfg.pool_file, self._fingerprint, cfg.N, cfg.G, vocab_size=vocab)


@dataclass(frozen=True)
class LookaheadConfig:
    """Lookahead decoding settings (symbols of Fu et al. 2023).

    W: window width, the number of Jacobi guess columns advanced in every forward (0 = no
       window: the pool is fed only by `context`, like prompt lookup decoding).
    N: n-gram size; the window keeps N - 1 rows and every column yields an N-gram.
    G: guess set size, the most n-grams kept per first token, all verified each step.
    context: also put the n-grams of the request's own text in the pool, the prompt's at the
       start and each new one as tokens are emitted (the reference's POOL_FROM_PROMPT, extended
       to the output), so text that repeats the prompt or itself is guessed.
    reuse: keep the n-gram pool across requests (the reference starts each request empty).
    pool_file: JSON file to start the pool from and (with reuse) to save it to after each request.
    A forward feeds W*(N-1) window tokens (the first is the root) and up to G*(N-1) guesses.
    """

    W: int = 3
    N: int = 3
    G: int = 3
    context: bool = False
    reuse: bool = False
    pool_file: str | None = None

    def __post_init__(self):
        require(0 <= self.W <= 64, f"window width W={self.W} must lie in 0..64")
        require(2 <= self.N <= 16, f"n-gram size N={self.N} must lie in 2..16")
        require(1 <= self.G <= 64, f"guess set size G={self.G} must lie in 1..64")


@register
class Lookahead(PoolMethod):
    name = "lookahead"
    Config = LookaheadConfig
    presets = {
        "cpu": {"W": 3, "N": 3, "G": 3},
        # no window: the request's own n-grams only; one guess a round (G=1): on a CPU's cost curve a second guess's
        # rows cost more than it is accepted for
        "context": {"W": 0, "N": 5, "G": 1, "context": True},
        "cpu-context": {"W": 3, "N": 3, "G": 3, "context": True},
        "specbench": {"W": 15, "N": 5, "G": 15},  # the Spec-Bench setting used for Ouroboros
        "humaneval": {"W": 16, "N": 7, "G": 16},  # Ouroboros v2, Table 11, Yi-34B
        "gsm8k": {"W": 15, "N": 6, "G": 15},  # Ouroboros v2, Table 11, Yi-34B
    }

    def pool_drafter(self, s: Session, pool: PhrasePool) -> LookaheadDrafter:
        return lookahead_drafter(self.config, pool)


def lookahead_drafter(c: LookaheadConfig, pool: PhrasePool | None = None) -> LookaheadDrafter:
    """The drafter of settings `c`, over `pool` (None: a fresh pool of `c`'s N and G)."""
    return LookaheadDrafter(PhrasePool(c.N, c.G) if pool is None else pool, c.W, c.N, c.G, c.context)
