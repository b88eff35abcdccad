"""Prompt lookup (Saxena 2023; transformers' `prompt_lookup_num_tokens`): copy what followed the last match.

The longest suffix of the sequence (at most `max_ngram` tokens, at least `min_ngram`) that
occurred earlier in the prompt or the output proposes the `k` tokens that followed its latest
earlier occurrence. No model, no state: it wins on text that repeats its context (code edits,
summaries, extraction); elsewhere it proposes nothing and the round is a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftverify.drafters.base import Drafter, Proposal, standalone
from draftverify.errors import require
from draftverify.session import Session


@dataclass(frozen=True)
class PromptLookupConfig:
    """k: most tokens proposed per round; max_ngram / min_ngram: the suffix lengths matched, longest first.
    k is 4 by default: on a CPU a forward's rows past the first few cost nearly a step's share each, and the tokens
    of a copy further on are accepted less often (docs/benchmarks/smollm2-context-guesses-xeon-amx, against the 8
    of before; the `hf` preset keeps transformers' 10)."""

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        require(1 <= self.k <= 64, f"k={self.k} must lie in 1..64")
        require(
            1 <= self.min_ngram <= self.max_ngram <= 16,
            f"need 1 <= min_ngram={self.min_ngram} <= max_ngram={self.max_ngram} <= 16",
        )


@standalone(
    "prompt-lookup", PromptLookupConfig, presets={"k4": {"k": 4}, "hf": {"k": 10, "max_ngram": 2}}
)  # hf: transformers' defaults
class PromptLookup(Drafter):
    free = True

    def __init__(self, config: PromptLookupConfig):
        self.k, self.max_ngram, self.min_ngram = config.k, config.max_ngram, config.min_ngram

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # latest earlier occurrence first
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + min(self.k, room)]
                    return Proposal([follow])
        return Proposal()
