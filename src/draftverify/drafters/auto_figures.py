"""What `auto` (`drafters.auto.AutoDrafter`) learns of its candidates: running means per candidate, or per kind of a
free candidate's offer, and the free offers waiting for the text that scores them."""

from __future__ import annotations

from dataclasses import dataclass, field

# The prior chance that an offer's first j tokens are all accepted, before any offer of j tokens was scored: this
# to the power j (its sum over an offer of 4 tokens is about the 1 token a model-run candidate's prior expects).
REACH_PRIOR = 0.5


@dataclass
class CandidateRecord:
    """Running means of what one candidate earned per round it drafted, or, for a free candidate, per offer the
    text scored, drafted or not (`decay`: the old rounds' weight)."""

    accepted: float = 1.0  # candidate tokens accepted (the prior is optimistic, so every candidate is tried)
    draft_s: float = 0.0  # seconds drafting (until a round is timed: nothing; the first timed round sets it)
    nodes: float = 4.0  # candidate tokens verified (a free candidate's: offered)
    timed: bool = False  # whether a round has set `draft_s`
    # a free candidate's: reach[j - 1] is the running share of its offers of j or more tokens whose first j the text
    # bore out (depths not scored yet: `REACH_PRIOR` ** j)
    reach: list[float] = field(default_factory=list)

    def update(self, decay: float, accepted: float, draft_s: float | None, nodes: int) -> None:
        """`draft_s` None: this round's drafting time says nothing of a round's (see the module docstring)."""
        self.accepted = decay * self.accepted + (1 - decay) * accepted
        self.time(decay, draft_s)
        self.nodes = decay * self.nodes + (1 - decay) * nodes

    def time(self, decay: float, draft_s: float | None) -> None:
        if draft_s is not None:
            self.draft_s = decay * self.draft_s + (1 - decay) * draft_s if self.timed else draft_s
            self.timed = True

    def score(self, decay: float, accepted: int, depth: int, nodes: int) -> None:
        """A free candidate's offer (`nodes` tokens, its longest path `depth`) of which the text bore out `accepted`
        tokens of a path."""
        self.update(decay, accepted, None, nodes)
        while len(self.reach) < depth:
            self.reach.append(REACH_PRIOR ** (len(self.reach) + 1))
        for j in range(depth):
            self.reach[j] = decay * self.reach[j] + (1 - decay) * (accepted > j)

    def expected(self, length: int) -> list[float]:
        """The tokens an offer is expected to get accepted if cut to 1, 2, ..., `length` tokens."""
        total, out = 0.0, []
        for j in range(length):
            total += self.reach[j] if j < len(self.reach) else REACH_PRIOR ** (j + 1)
            out.append(total)
        return out


@dataclass
class Shadow:
    """A free candidate's offer, scored against the text that came after it."""

    name: str
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
class Figures:
    """What auto has learnt, owned by the method instance: kept across its requests (warm start) and shared by
    the slots of a batch, never by two instances (so two engines in one process do not steer each other)."""

    records: dict[str, CandidateRecord] = field(default_factory=dict)  # per candidate (merged ones included)
    scale: float = 1.0  # running ratio of every measured round's time past drafting to the cost curve's t
    scales: dict[str, float] = field(default_factory=dict)  # the same per choice (AR included): its own rounds'
