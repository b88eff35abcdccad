"""Draft-length policies: how many tokens to draft before asking the target.

A policy is told `start_round(context)` (the tokens so far) and asked `max_length()` before a
round, `keep_drafting(n, logits, hidden)` after
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

    def start_round(self, context: int) -> None:
        """Told the sequence length before each round (what a forward costs grows with it)."""

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


@dataclass
class AdaptiveThreshold(DraftPolicy):
    """Draft & Verify's adaptive draft exit (Zhang et al. 2023, Sec. 3.4, eqs. 2-4).

    Stop drafting once the draft's top probability falls below `gamma` (at most `max_k` = K
    tokens). After the e-th verification, with AR_e = accepted / drafted:
        AR <- beta1 * AR + (1 - beta1) * AR_e          (beta1 = 0 for e = 1)
        gamma~ = gamma + epsilon if AR <= alpha else gamma - epsilon
        gamma <- beta2 * gamma + (1 - beta2) * gamma~
    Defaults are the paper's (Table 6); alpha, the target acceptance rate, is tuned per task.
    """

    gamma: float = 0.6  # gamma_0
    alpha: float = 0.85
    epsilon: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    max_k: int = 12
    ar: float | None = None  # smoothed acceptance rate; None before the first verification

    def __post_init__(self):
        require(0 <= self.gamma <= 1, f"threshold gamma={self.gamma} must lie in [0, 1]")
        require(0 < self.alpha <= 1, f"target acceptance rate alpha={self.alpha} must lie in (0, 1]")
        require(self.epsilon >= 0, f"step epsilon={self.epsilon} must not be negative")
        require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"beta1={self.beta1} and beta2={self.beta2} must lie in [0, 1)"
        )
        require(self.max_k >= 1, f"max draft length K={self.max_k} must be at least 1")

    def max_length(self) -> int:
        return self.max_k

    def keep_drafting(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return n < self.max_k and logits.float().softmax(-1).max().item() >= self.gamma

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        ar_e = accepted / drafted
        self.ar = ar_e if self.ar is None else self.beta1 * self.ar + (1 - self.beta1) * ar_e
        gamma_tilde = self.gamma + self.epsilon if self.ar <= self.alpha else self.gamma - self.epsilon
        self.gamma = self.beta2 * self.gamma + (1 - self.beta2) * gamma_tilde


@dataclass
class WholePhrases(DraftPolicy):
    """Ouroboros's rule: draft whole phrases until the draft has at least `k` tokens.

    It never stops inside a phrase (`keep_drafting` is always True); a method that drafts
    phrase by phrase checks `max_length()` between phrases. Token by token it drafts k tokens.
    """

    k: int = 4

    def __post_init__(self):
        require(self.k >= 1, f"draft length gamma={self.k} must be at least 1")

    def max_length(self) -> int:
        return self.k

    def keep_drafting(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return True


@dataclass
class CostAware(DraftPolicy):
    """Draft the length with the most expected tokens per second under the measured cost curve.

    With per-token acceptance alpha, k drafts give E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens
    per round (the accepted prefix and the target's own next token) for k t_D(1) + t_T(k + 1)
    seconds, t_D and t_T the draft's and the target's measured forward times (`costs.curve`) at the
    round's context (`start_round`: after a long prompt, wide forwards cost more).
    alpha = (accepted + 1) / (accepted + rejections + 2) over rounds, older rounds weighted down
    by `decay` (a rejection: a round that kept fewer drafts than it had). The draft length is
    the k in 0..max_k with the most tokens per second; k = 0 (a plain target step) when nothing
    pays, and then every `probe`-th round still drafts one token so alpha keeps being measured.
    Which tokens are kept is the verifier's business: sampling stays exact.
    """

    target_costs: dict
    draft_costs: dict
    max_k: int = 8
    decay: float = 0.8
    probe: int = 8
    accepted: float = 0.0
    rejections: float = 0.0
    context: int = 0
    _k: int = 0
    _idle: int = 0

    def __post_init__(self):
        require(self.max_k >= 1, f"max draft length k={self.max_k} must be at least 1")

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.accepted + self.rejections + 2.0)

    def start_round(self, context: int) -> None:
        self.context = context

    def best(self) -> int:
        from draftverify.costs import at_context, forward_time

        target = at_context(self.target_costs, self.context)
        a, t_draft = min(self.alpha, 0.999), forward_time(at_context(self.draft_costs, self.context), 1)
        rates = [
            (1 - a ** (k + 1)) / (1 - a) / (k * t_draft + forward_time(target, k + 1)) for k in range(self.max_k + 1)
        ]
        return max(range(self.max_k + 1), key=rates.__getitem__)

    def max_length(self) -> int:
        self._k = self.best()
        self._idle = self._idle + 1 if self._k == 0 else 0
        if self._idle >= self.probe:
            self._k, self._idle = 1, 0
        return self._k

    def keep_drafting(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return n < self._k

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejections = self.decay * self.rejections + (accepted < drafted)


POLICIES = {"constant": ConstantK, "heuristic": Heuristic, "confidence": Confidence, "phrases": WholePhrases}
POLICIES["adaptive"] = AdaptiveThreshold
POLICIES["cost"] = CostAware


def make_policy(name: str, k: int, threshold: float, target=None, draft=None) -> DraftPolicy:
    """The policy `name`; `cost` measures the target's and the draft's cost curves (Runners `target`, `draft`)."""
    require(name in POLICIES, f"unknown draft policy {name!r}: use one of {', '.join(POLICIES)}")
    if name == "cost":
        from draftverify import costs

        require(target is not None and draft is not None, "the cost policy needs the target and draft runners")
        return CostAware(costs.curve(target), costs.curve(draft, all_logits=False), max_k=k)
    if name == "constant":
        return ConstantK(k)
    if name == "heuristic":
        return Heuristic(float(k))
    if name == "phrases":
        return WholePhrases(k)
    if name == "adaptive":
        return AdaptiveThreshold(gamma=threshold, max_k=k)
    return Confidence(threshold, max_k=k)
