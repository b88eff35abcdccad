"""What `auto` learns of its choices, and how a round updates it.

Every figure is a running mean (`mean`: the older rounds weigh `DECAY`). `Figures` is what a method instance
keeps across its requests: per candidate (or per kind of a candidate's offers) a `CandidateRecord` of what its
rounds earned and cost, and per choice the ratio of its rounds' time to the cost curve's. `Shadow` scores a free
offer that was not drafted against the text that followed it; `Calibration` follows, within one request, how a
drafter's own expectation of its acceptance fared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.7  # the older rounds' weight in every running mean (lower: quicker to switch)
CALIBRATION_PRIOR = 4.0  # tokens: a drafter's own expectation counts as right until this many have been scored


def mean(old: float, new: float) -> float:
    """A running mean moved by one new value."""
    return DECAY * old + (1 - DECAY) * new


@dataclass
class CandidateRecord:
    """Running means of what one candidate (or one kind of its offers) earned per round it drafted."""

    accepted: float = 1.0  # candidate tokens accepted (the prior is optimistic, so every candidate is tried)
    draft_s: float = 0.0  # seconds drafting (until a round is timed: nothing; the first timed round sets it)
    nodes: float = 4.0  # candidate tokens verified
    timed: bool = False  # whether a round has set `draft_s`

    def update(self, accepted: float, draft_s: float | None, nodes: int) -> None:
        """`draft_s` None: this round's drafting time was a catch-up after sitting out, not a round's."""
        self.accepted = mean(self.accepted, accepted)
        if draft_s is not None:
            self.draft_s = mean(self.draft_s, draft_s) if self.timed else draft_s
            self.timed = True
        self.nodes = mean(self.nodes, nodes)


@dataclass
class Figures:
    """What auto has learnt, owned by the method instance: kept across its requests (warm start) and shared by
    the slots of a batch, never by two instances (so two engines in one process do not steer each other)."""

    records: dict[str, CandidateRecord] = field(default_factory=dict)  # per candidate, or `name (kind)`
    scale: float = 1.0  # every measured round's time past drafting over the cost curve's t
    scales: dict[str, float] = field(default_factory=dict)  # the same per choice (AR included): its own rounds'

    def scale_of(self, choice: str) -> float:
        """`choice`'s scale; every round's until its own rounds are measured."""
        return self.scales.get(choice, self.scale)

    def measured(self, choice: str, ratio: float) -> None:
        """A round of `choice` took `ratio` times the curve's t past its drafting."""
        self.scale = mean(self.scale, ratio)
        self.scales[choice] = mean(self.scales.get(choice, ratio), ratio)

    def relax(self, choice: str) -> None:
        """Move `choice`'s scale toward every round's (a free candidate sitting out: it is never probed, so one slow
        round of its own, the machine busy elsewhere, would otherwise price it out for good)."""
        if choice in self.scales:
            self.scales[choice] = mean(self.scales[choice], self.scale)


@dataclass
class Shadow:
    """A free candidate's offer in a round it did not draft, scored against the text that came after it."""

    name: str  # the figures it goes into
    paths: list[list[int]]
    nodes: int
    seen: list[int] = field(default_factory=list)  # the tokens emitted after the offer's root so far

    def accepted(self) -> int | None:
        """The tokens of the offer verification would have accepted (the longest prefix of a path the text went on
        to repeat), or None while the text so far cannot tell."""
        best = 0
        for path in self.paths:
            n = 0
            while n < len(path) and n < len(self.seen) and path[n] == self.seen[n]:
                n += 1
            if n == len(self.seen) < len(path):  # right so far, the rest still to come
                return None
            best = max(best, n)
        return best


@dataclass
class Calibration:
    """How a drafter's own expectation (`Proposal.expected`) fared in this request: tokens accepted, expected (a
    feature head is calibrated on its training replies; a request's text may be harder or easier)."""

    accepted: float = CALIBRATION_PRIOR
    expected: float = CALIBRATION_PRIOR

    def score(self, accepted: int, expected: float) -> float:
        """Count a round in; its expectation scaled by how the expectations fared so far."""
        self.accepted += accepted
        self.expected += expected
        return expected * self.accepted / self.expected
