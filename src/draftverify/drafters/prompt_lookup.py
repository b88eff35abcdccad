"""Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`): copy what followed the last match.

The longest suffix of the sequence (at most `max_ngram` tokens, at least `min_ngram`) that
occurred earlier in the prompt or the output proposes the `k` tokens that followed its latest
earlier occurrence, as an overlapping copy (`repeat`: a repeat whose period is shorter than `k` goes
on with itself). No model: it wins on text that repeats its context (code edits, summaries,
extraction); elsewhere it proposes nothing and the round is a plain step. Its one state is an index
of the request's n-grams (each to where it last occurred), grown by the tokens each round adds, so a
round costs the same whatever the context's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftverify.drafters.base import Drafter, Proposal, standalone
from draftverify.errors import require
from draftverify.session import Session


@dataclass(frozen=True)
class PromptLookupConfig:
    """k: most tokens proposed per round; k1: most after a match of one token only; max_ngram / min_ngram: the suffix
    lengths matched, longest first.
    k is 4 by default: on a CPU a forward's rows past the first few cost nearly a step's share each, and the tokens
    of a copy further on are accepted less often (the `hf` preset keeps transformers' 10). A one-token match is a
    weak sign that the text repeats itself: fewer of its tokens are accepted than after a longer match's, so it
    offers k1 = 2.
    long, k_long: where the text before the matched occurrence goes on matching the sequence's for `long` tokens
    or more (counted back from a match of `max_ngram`), the text is copying itself at length, and the offer is
    `k_long` tokens (never fewer than k). 7 by default: the root and 7 rows fill one pass of the q8 product's rows on
    AVX-512 (docs/q8.md), and on the development prompts it paid better than 4."""

    k: int = 4
    k1: int = 2
    max_ngram: int = 3
    min_ngram: int = 1
    long: int = 5
    k_long: int = 7

    def __post_init__(self):
        require(1 <= self.k <= 64 and 1 <= self.k1 <= 64, f"k={self.k} and k1={self.k1} must lie in 1..64")
        require(
            0 <= self.k_long <= 64 and self.long >= 1, f"k_long={self.k_long} must lie in 0..64, long={self.long} >= 1"
        )
        require(
            1 <= self.min_ngram <= self.max_ngram <= 16,
            f"need 1 <= min_ngram={self.min_ngram} <= max_ngram={self.max_ngram} <= 16",
        )


@standalone(
    "prompt-lookup", PromptLookupConfig, presets={"k4": {"k": 4, "k1": 4}, "hf": {"k": 10, "k1": 10, "max_ngram": 2}}
)  # hf: transformers' defaults
class PromptLookup(Drafter):
    free = True
    label = "prompt-lookup"

    def __init__(self, config: PromptLookupConfig):
        self.k, self.k1, self.max_ngram, self.min_ngram = config.k, config.k1, config.max_ngram, config.min_ngram
        self.long, self.k_long = config.long, max(config.k_long, config.k)
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> where the tokens after its latest occurrence begin
        # the index holds the n-grams that positions 1..indexed - 1 follow; `last` is seq[indexed - 1]
        self.indexed, self.last = 0, None

    def index(self, seq: list[int]) -> None:
        """Add the n-grams that a token follows, up to `seq`'s last token (which nothing follows yet: the suffix
        looked up is never its own match). The index is of one request's sequence, which only grows; a sequence
        that is shorter or ends its indexed part otherwise is indexed afresh."""
        if self.indexed > len(seq) or (self.indexed and seq[self.indexed - 1] != self.last):
            self.follows, self.indexed = {}, 0
        for j in range(max(1, self.indexed), len(seq)):
            for n in range(self.min_ngram, min(self.max_ngram, j) + 1):
                self.follows[tuple(seq[j - n : j])] = j
        self.indexed, self.last = len(seq), seq[-1] if seq else None

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        self.index(seq)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            j = self.follows.get(tuple(seq[-n:]))  # latest earlier occurrence
            if j is not None:
                if n == self.max_ngram and matched(seq, j, n, self.long) >= self.long:
                    count, kind = self.k_long, f"match {self.long}+"
                else:
                    count, kind = self.k if n > 1 else self.k1, f"match {n}"
                return Proposal([repeat(seq, j, min(count, room))], kind=kind)
        return Proposal()


def matched(seq: list[int], j: int, n: int, most: int) -> int:
    """How many tokens (at most `most`) before position j match the end of `seq`, given that n already do."""
    end = len(seq)
    while n < most and j - n - 1 >= 0 and seq[j - n - 1] == seq[end - n - 1]:
        n += 1
    return n


def repeat(seq: list[int], j: int, count: int) -> list[int]:
    """The `count` tokens that followed position j (< len(seq)), as an overlapping copy: where they run into the end of
    `seq`, the text from j on repeats with period len(seq) - j, so the copy goes on with its own first tokens. A
    repeat shorter than the offer (a line, a word or a bracket said again and again) is offered whole, not cut at
    the end of the text."""
    out = seq[j : j + count]
    period = len(seq) - j
    while len(out) < count:
        out.append(out[len(out) - period])
    return out
