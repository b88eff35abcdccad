"""The drafter contract: what a drafter proposes each round and what it is told afterwards.

A drafter proposes candidate continuations of the root (the last emitted token) for the
target to verify in one forward (`round.decode`). It keeps whatever state it needs (its own
model's KV cache, a phrase pool, a draft-length policy) and is told after each round what
the target accepted, so that it can roll that state back and learn from it. Drafters never
touch the target's cache: the round rolls it back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from draftverify.session import Session
from draftverify.step import Proposal, Step

__all__ = ["Drafter", "Proposal", "Step", "add", "attribute", "standalone"]


class Drafter(ABC):
    """Proposes candidates each round; see the module docstring."""

    needs_hidden: bool = False  # start() wants the target's hidden states of the prompt
    # propose() runs no model and changes nothing but its own index of the request's text: `auto` may ask it and
    # not use the answer
    free: bool = False
    label: str = ""  # who drafted, as provenance names it (`sources`; the server's web page colours by it)

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        """A request begins: `seq` is the prompt and the first emitted token. `hidden` [len(prompt), H]: the
        target's final hidden state after each prompt token, when the drafter `needs_hidden` (else None)."""

    @abstractmethod
    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        """Candidates after `seq[-1]` (the root), none deeper than `room` tokens (which may be 0)."""

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        """The target verified `proposal` after `seq`; `step.tokens` follow `seq` now."""

    def finish(self, s: Session) -> None:
        """The request ended (also on error or cancellation)."""

    def sources(self, proposal: Proposal, step: Step) -> list[str]:
        """Who drafted each of the `step.accepted` drafted tokens that `step` accepted of `proposal` (read only when
        the session asks for provenance): this drafter, unless it combines others."""
        return [self.label or type(self).__name__] * step.accepted


def add(counters: dict, **amounts: int) -> None:
    """Add to drafter-specific counters in `Stats.extra`."""
    for key, amount in amounts.items():
        counters[key] = counters.get(key, 0) + amount


def attribute(accepted: list[int], parts: list[tuple[str, list[list[int]]]]) -> list[str]:
    """Who drafted each accepted token of a proposal made of parts, each (label, its paths): the first part with a
    path through the accepted path up to that token (a part whose paths all differ there did not propose it)."""
    out = []
    for i in range(len(accepted)):
        head = accepted[: i + 1]
        out.append(next((label for label, paths in parts if any(p[: i + 1] == head for p in paths)), parts[-1][0]))
    return out


STANDALONE: dict[str, tuple[type[Drafter], type, dict]] = {}  # method name -> (drafter, Config, presets)


def standalone(name: str, config: type, presets: dict | None = None):
    """Register a drafter that needs neither a draft model nor the target (built as `cls(config)`)
    as a method of its own: `methods` turns each entry into a Method named `name`."""

    def register(cls: type[Drafter]) -> type[Drafter]:
        STANDALONE[name] = (cls, config, presets or {})
        return cls

    return register
