"""Lookahead decoding: Jacobi guesses grow an n-gram pool that drafts for the model itself.

Fu et al. 2023, "Breaking the Sequential Dependency of LLM Inference Using Lookahead
Decoding" (as described in the Ouroboros papers). One model, no draft. Each step is ONE
forward over three parts (layout in `draftverify.tree`):
1. the root (the last emitted token);
2. the lookahead branch: a window of W columns and N - 1 rows of Jacobi guesses; the last
   row's outputs become a new row, and every column yields an N-gram for the pool;
3. the verification branch: the (at most G) pool n-grams that start with the root, merged
   into a trie and verified by `verify_tree`: greedy matching, or multi-draft rejection
   sampling for sampled decoding (the n-grams are deterministic guesses). The longest
   accepted n-gram is kept **plus the bonus token** (the reference implementation drops it).
Rollback keeps the root and the accepted path in the cache; the window moves one column.

The pool (`draftverify.pool.PhrasePool`) can outlive a request (`reuse`) and a process
(`pool_file`); this file also holds the pieces Ouroboros reuses for drafting with its draft
model: `JacobiWindow`, `speculate` (one such step on any model) and `PoolMethod`.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from draftverify.errors import require
from draftverify.methods.base import Method, register
from draftverify.models import Runner, tokenizer_fingerprint
from draftverify.pool import PhrasePool
from draftverify.session import Session
from draftverify.tree import build_tree, layout
from draftverify.verify import verify_tree


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


@dataclass
class Step:
    """One forward of a model over root + window + candidate trie, verified against itself."""

    tokens: list[int]  # accepted candidate tokens, then the next token (correction or bonus)
    accepted: int  # how many of `tokens` came from candidates
    drafted: int  # candidate nodes verified
    probs: torch.Tensor | None  # [len(tokens), V] distribution each token was drawn from (sampling)
    logits: torch.Tensor  # [len(tokens), V] raw logits that produced each token
    hidden: torch.Tensor | None  # [len(tokens), H] hidden state that produced each token
    grams: list[tuple[int, ...]]  # N-grams harvested from the window


def speculate(
    runner: Runner,
    s: Session,
    root: int,
    lead: Sequence[int] = (),
    candidates: Sequence[Sequence[int]] = (),
    window: JacobiWindow | None = None,
    hidden: bool = False,
) -> Step:
    """Feed lead + root (+ window + candidates) to `runner`, accept what it agrees with, roll back.

    The cache must hold everything before `lead`; afterwards it holds lead, root and the
    accepted candidate tokens (not the returned next token). Candidates are deterministic
    guesses: greedy keeps the longest one matching argmax; sampling keeps each token exactly
    distributed as the model's own (multi-draft rejection sampling), so the returned tokens
    are a sample of the model, with the distributions they were drawn from in `probs`.
    """
    tree = build_tree(root, candidates)
    rows = window.for_root(root) if window is not None else []
    lay = layout(tree, rows, lead)
    base = runner.length
    positions = torch.tensor(lay.offsets) + base + len(lead)
    out = runner.forward(lay.tokens, positions=positions, tree_mask=lay.mask, last=lay.keep, hidden=hidden)
    node_logits = out.logits[[lay.row(i) for i in lay.tree]]  # [n, V]
    tokens = torch.tensor(tree.tokens, device=node_logits.device)
    if s.sampling.greedy:
        probs = None
        verdict = verify_tree(tokens, tree.parents, node_logits, greedy=True)
    else:
        probs = s.sampling.probs(node_logits)  # [n, V]
        verdict = verify_tree(tokens, tree.parents, probs, generator=s.generator(runner.device), greedy=False)
    producers = [0] + verdict.path  # the node whose distribution gave each returned token
    runner.select(base, [base + i for i in lay.lead + [lay.tree[node] for node in producers]])
    grams = []
    if window is not None and rows:
        last = out.logits[[lay.row(i) for i in lay.window[-1]]].argmax(-1).tolist()  # [W]
        grams = window.advance(root, last)
    return Step(
        tokens=verdict.tokens,
        accepted=verdict.accepted,
        drafted=tree.size - 1,
        probs=None if probs is None else probs[producers],
        logits=node_logits[producers],
        hidden=None if out.hidden is None else out.hidden[[lay.row(lay.tree[node]) for node in producers]],
        grams=grams,
    )


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

    def run(self, s: Session) -> None:
        if self.pool is None or not self.config.reuse:
            self.pool = self._starting_pool(s)
        try:
            self.decode(s, self.pool)
        finally:
            s.stats.extra["pool_phrases"] = len(self.pool)
            if self.config.reuse and self.config.pool_file:
                self.save_pool()

    @abstractmethod
    def decode(self, s: Session, pool: PhrasePool) -> None:
        """Decode one request with `pool` (see `Method.run`)."""

    def save_pool(self, path: str | Path | None = None) -> None:
        """Write the pool to `path` (default: the `pool_file` option) atomically."""
        path = path or self.config.pool_file
        require(path is not None, "no pool file to save to: pass pool_file=PATH")
        require(self.pool is not None and self._fingerprint is not None, "there is no pool yet: generate something first")
        self.pool.save(path, self._fingerprint)

    def _starting_pool(self, s: Session) -> PhrasePool:
        cfg = self.config
        if not cfg.pool_file:
            return PhrasePool(cfg.N, cfg.G)
        require(s.tokenizer is not None, "pool_file needs the tokenizer to check the pool against: generate through Engine")
        self._fingerprint = tokenizer_fingerprint(s.tokenizer)
        if not Path(cfg.pool_file).exists():
            return PhrasePool(cfg.N, cfg.G)
        vocab = self.target.model.get_input_embeddings().weight.shape[0]
        return PhrasePool.load(cfg.pool_file, self._fingerprint, cfg.N, cfg.G, vocab_size=vocab)

    def ahead(self, s: Session) -> int:
        """Positions left after the current root within the models' context."""
        limits = [r.max_length for r in (self.target, self.draft) if r is not None and r.max_length]
        return min(limits, default=1 << 30) - len(s.prompt) - len(s.output)

    def window_for(self, s: Session) -> JacobiWindow | None:
        if not self.config.W:
            return None
        return JacobiWindow(self.config.W, self.config.N, source=s.prompt, avoid=s.stopping.eos_token_ids)


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
        "context": {"W": 0, "N": 5, "G": 2, "context": True},  # no window: the request's own n-grams only
        "cpu-context": {"W": 3, "N": 3, "G": 3, "context": True},
        "specbench": {"W": 15, "N": 5, "G": 15},  # the Spec-Bench setting used for Ouroboros
        "humaneval": {"W": 16, "N": 7, "G": 16},  # Ouroboros v2, Table 11, Yi-34B
        "gsm8k": {"W": 15, "N": 6, "G": 15},  # Ouroboros v2, Table 11, Yi-34B
    }

    def decode(self, s: Session, pool: PhrasePool) -> None:
        cfg, target, stats = self.config, self.target, s.stats
        logits = self.prefill(s)
        root = self.pick(logits, s, target.device)
        if not s.emit([root]):
            return
        window = self.window_for(s)
        if cfg.context:
            add(stats.extra, context_ngrams=pool.insert_all(ngrams(s.prompt + [root], cfg.N)))
        while True:
            room = min(s.remaining - 1, self.ahead(s))  # candidate tokens worth verifying
            guesses = [c[:room] for c in pool.get(root, cfg.G)] if room > 0 else []
            with stats.timer("verify"):
                step = speculate(target, s, root, candidates=guesses, window=window if room > cfg.W + cfg.N else None)
            stats.verified(step.drafted, step.accepted, len(step.tokens))
            add(stats.extra, window_ngrams=pool.insert_all(step.grams))
            if not s.emit(step.tokens):
                return
            if cfg.context:  # the n-grams that end in the new tokens
                tail = (s.prompt + s.output)[-(len(step.tokens) + cfg.N - 1) :]
                add(stats.extra, context_ngrams=pool.insert_all(ngrams(tail, cfg.N)))
            root = step.tokens[-1]


def ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """Every run of n consecutive tokens, in order (so the last is the newest in the pool)."""
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def add(counters: dict, **amounts: int) -> None:
    """Add to method-specific counters in `Stats.extra`."""
    for key, amount in amounts.items():
        counters[key] = counters.get(key, 0) + amount
