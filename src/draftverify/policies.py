"""Draft-length policies: how many tokens to draft before asking the target.

A policy is asked `max_length()` before a round, `keep_drafting(n, logits, hidden)` after
each drafted token (n = tokens drafted so far this round; logits [V] and hidden [H] are the
draft's outputs for that token), and told `observe(drafted, accepted)` after verification.
Stopping rules that look only at the draft keep sampling exact: they choose *how many*
tokens to verify, never *which*.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from draftverify.errors import require


class DraftPolicy(ABC):
    needs_hidden = False

    @abstractmethod
    def max_length(self) -> int:
        """The most tokens to draft this round."""

    def keep_drafting(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return n < self.max_length()

    def observe(self, drafted: int, accepted: int) -> None:
        pass


@dataclass
class ConstantK(DraftPolicy):
    """Always draft K tokens."""

    k: int = 4

    def __post_init__(self):
        require(self.k >= 1, f"draft length k={self.k} must be at least 1")

    def max_length(self) -> int:
        return self.k


@dataclass
class Heuristic(DraftPolicy):
    """transformers' "heuristic" schedule: +2 after a round with every draft accepted, else -1 (min 1)."""

    k: float = 5.0
    max_k: int = 20

    def max_length(self) -> int:
        return max(1, min(int(self.k), self.max_k))

    def observe(self, drafted: int, accepted: int) -> None:
        self.k = self.k + 2.0 if accepted == drafted else max(1.0, self.k - 1.0)


@dataclass
class Confidence(DraftPolicy):
    """Stop once the draft's top probability falls below `threshold` (transformers' assistant_confidence_threshold)."""

    threshold: float = 0.4
    max_k: int = 10

    def __post_init__(self):
        require(0 <= self.threshold <= 1, f"confidence threshold={self.threshold} must lie in [0, 1]")
        require(self.max_k >= 1, f"max draft length {self.max_k} must be at least 1")

    def max_length(self) -> int:
        return self.max_k

    def keep_drafting(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return n < self.max_k and logits.float().softmax(-1).max().item() >= self.threshold


POLICIES = {"constant": ConstantK, "heuristic": Heuristic, "confidence": Confidence}


def make_policy(name: str, k: int, threshold: float) -> DraftPolicy:
    require(name in POLICIES, f"unknown draft policy {name!r}: use one of {', '.join(POLICIES)}")
    if name == "constant":
        return ConstantK(k)
    if name == "heuristic":
        return Heuristic(float(k))
    return Confidence(threshold, max_k=k)
