"""A combinator for `auto`: each round, the candidate drafter worth the most tokens per second, or none.

A round of candidate c costs its drafting plus one target forward over the root and its candidates and yields
1 + (accepted candidates) tokens, so c is priced by running means over the rounds it drafted (`auto_figures`):

    rate(c) = (1 + accepted(c)) / (draft_s(c) + scale(c) * t(1 + nodes(c)))

with t the target's cost curve at the request's context (in a batch: the time the request's rows add to the
shared forward) and scale(c) the running ratio of the rest of c's rounds' time to t (the curve times forwards
back to back; a forward after a drafting finds colder caches). Plain decoding scores 1 / (scale(plain) * t(1)).

A *free* candidate (`Drafter.free`: a lookup, no model run) is asked every round, priced at its offer's size by
the figures of the offer's kind (`Proposal.kind`), and scored against the text that follows whether it drafts
or not (`Shadow`), so it is never probed. A model-run candidate, and plain decoding while the request decodes
alone, drafts once (a probe) after `probe` rounds without drafting, unless it could not pay even with every
token accepted; a probe that does not pay doubles the wait for the next, up to `MAX_BACKOFF` times. A model-run
drafter's drafting time counts only from rounds that follow one it drafted (a comeback pays a catch-up); where
it knows its chances (`Proposal.expected`), they stand in for the round's count, scaled by how they fared in
this request. The figures carry over to the method's next requests; the waits are each request's own.

Every candidate is told every round (`observe`, an empty proposal where it sat out). Who drafts changes only
what is verified, never what is accepted: greedy output is the target's, and sampling stays exact because each
round's proposal depends only on the tokens so far and its own draws (`verify.verify_tree`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from draftverify.costs import at_context, forward_time, marginal_time
from draftverify.drafters.auto_figures import Calibration, CandidateRecord, Figures, Shadow
from draftverify.drafters.base import Drafter, Proposal, Step, add
from draftverify.session import Session
from draftverify.tree import build_tree

AR = "autoregressive"  # the name of a round nobody drafted
MAX_BACKOFF = 8  # a choice whose probes keep missing waits at most this many times `probe` rounds
# Plain decoding is not probed where a candidate is priced above this many times its rate: plain rounds' scale
# would have to be off by that factor to change the choice, and the probe would forgo a round that copies a repeat.
PLAIN_PROBE_BELOW = 2.0


@dataclass
class Wait:
    """A choice's probes in this request: rounds since it last drafted (where it could have), and its wait for
    the next probe in `probe`s of rounds."""

    idle: int = 0
    backoff: int = 1

    def due(self, every: int) -> bool:
        return self.idle > every * self.backoff

    def judge(self, paid: bool) -> None:
        """After a probe: one that paid resets the wait, one that did not doubles it."""
        self.backoff = 1 if paid else min(MAX_BACKOFF, 2 * self.backoff)


@dataclass
class Round:
    """One round's choice, kept until its step is observed (and its time scored at the next round's start)."""

    costs: dict  # the cost table at this round's context (`costs.at_context`)
    chosen: str = AR
    probing: bool = False  # drafting as a probe (it waited too long), not on its price
    steady: bool = True  # a model-run drafter drafted the round before too: its drafting time is a round's
    proposal: Proposal | None = None  # the chosen candidate's
    keys: dict[str, str] = field(default_factory=dict)  # each free offer's figures, where it names its kind
    draft_s: float = 0.0
    sent_at: float = 0.0  # when the proposal went to verification
    curve_s: float | None = None  # the curve's time for its forward (alone only: a batch's holds others' work)


class AutoDrafter(Drafter):
    def __init__(self, candidates: dict[str, Drafter], costs: dict, figures: Figures, probe: int = 8):
        """`figures` are the caller's, updated in place round by round."""
        self.candidates, self.costs, self.figures, self.probe = candidates, costs, figures, probe
        self.needs_hidden = any(d.needs_hidden for d in candidates.values())
        for name in candidates:
            figures.records.setdefault(name, CandidateRecord())
        self.calibration = {name: Calibration() for name in candidates}
        self.waits = {name: Wait() for name in [*candidates, AR]}
        self.shadows: list[Shadow] = []  # free offers not drafted, waiting for the text that scores them
        self.round = Round({})

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        s.stats.extra["auto_chunks"] = []  # (drafter, tokens emitted) per round: who produced what (`--explain`)
        for d in self.candidates.values():
            d.start(s, seq, hidden if d.needs_hidden else None)

    def record(self, name: str) -> CandidateRecord:
        """The figures `name`'s offer this round is priced by: its kind's (from the prior, the first time that kind
        is offered), or the candidate's."""
        return self.figures.records.setdefault(self.round.keys.get(name, name), CandidateRecord())

    def verify_time(self, name: str, costs: dict, nodes: float, others: int) -> float:
        """The rest of a round `name` chooses, past its drafting: its scale (unmeasured: every round's) times t."""
        return self.figures.scale_of(name) * marginal_time(costs, round(1 + nodes), others)

    def plain_rate(self, costs: dict, others: int) -> float:
        return 1 / self.verify_time(AR, costs, 0, others)

    def rate(self, name: str, costs: dict, others: int, nodes: float, accepted=None, draft_s=None) -> float:
        """Tokens per second of a round of `name` verifying `nodes` candidates (`accepted`, `draft_s` None: its
        running means)."""
        r = self.record(name)
        return (1 + (r.accepted if accepted is None else accepted)) / (
            (r.draft_s if draft_s is None else draft_s) + self.verify_time(name, costs, nodes, others)
        )

    def could_pay(self, name: str, costs: dict, others: int, nodes: float) -> bool:
        """Whether a round of `name` would beat plain decoding with every candidate accepted: where not (in a busy
        batch each row adds much to the shared forward), a probe can only cost."""
        return self.rate(name, costs, others, nodes, accepted=nodes) >= self.plain_rate(costs, others)

    def rescale(self, now: float) -> None:
        """Score the last round's time past its drafting against the curve's t, for every round's scale and its
        choice's."""
        last = self.round
        if last.curve_s is not None:
            self.figures.measured(last.chosen, (now - last.sent_at) / last.curve_s)

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        t0 = time.perf_counter()
        self.rescale(t0)
        last, self.round = self.round, Round(at_context(self.costs, len(seq)))
        if room > 0:
            self.choose(s, seq, room, last.chosen)
        proposal = self.round.proposal if self.round.proposal is not None else Proposal(hidden=self.needs_hidden)
        if self.needs_hidden and not proposal.hidden:
            proposal = replace(proposal, hidden=True)
        self.round.sent_at = time.perf_counter()
        self.round.draft_s = self.round.sent_at - t0
        return proposal

    def choose(self, s: Session, seq: list[int], room: int, last: str) -> None:
        """Price every choice, pick one and ask it for its proposal; free offers that sit out become shadows."""
        r, records = self.round, self.figures.records
        offers = {name: d.propose(s, seq, room) for name, d in self.candidates.items() if d.free}
        r.keys = {name: f"{name} ({offer.kind})" for name, offer in offers.items() if offer.kind}
        size = {name: tree_size(seq[-1], offer.paths) for name, offer in offers.items() if offer.paths}
        nodes = {
            name: size[name] if d.free else records[name].nodes
            for name, d in self.candidates.items()
            if not d.free or name in size
        }
        rates = {AR: self.plain_rate(r.costs, s.others)}
        rates.update({name: self.rate(name, r.costs, s.others, n) for name, n in nodes.items()})
        r.chosen, r.probing = self.pick(rates, nodes, offers, s.others)
        if r.chosen in offers:
            r.proposal = offers[r.chosen]
        elif r.chosen != AR:
            r.proposal = self.candidates[r.chosen].propose(s, seq, room)
            r.steady = r.chosen == last  # caught up on one round, not on many
        sitting_out = [name for name in size if name != r.chosen]
        self.shadows += [Shadow(r.keys.get(n, n), offers[n].paths, size[n]) for n in sitting_out]
        for name in sitting_out:  # a free candidate's scale comes only from its own rounds: let an old one fade
            self.figures.relax(name)

    def pick(self, rates: dict[str, float], nodes: dict[str, float], offers: dict, others: int) -> tuple[str, bool]:
        """The choice (the longest-waiting probe that is due, else the best rate) and whether it is a probe."""
        able = [name for name in rates if name != AR]
        if able:  # a round something could draft in: every wait grows by one (the chosen one's is reset)
            for name in (*able, AR):
                self.waits[name].idle += 1
        every = self.probe * (1 + others)  # in a batch a probe slows every request: probe that much less often
        due = [name for name in able if name not in offers and self.waits[name].due(every)]
        stale = [name for name in due if self.could_pay(name, self.round.costs, others, nodes[name])]
        best = max(rates, key=rates.__getitem__)
        plain = self.waits[AR]  # plain rounds are probed for their scale, alone only, and not against far better
        if able and not others and plain.due(every) and rates[best] < PLAIN_PROBE_BELOW * rates[AR]:
            stale.append(AR)
        chosen = max(stale, key=lambda name: self.waits[name].idle) if stale else best
        if chosen == AR:  # a plain round: chosen on price it resets the wait for the next, a probe doubles it
            plain.idle = 0
            plain.judge(paid=not stale)
        return chosen, bool(stale)

    def score_shadows(self, tokens: list[int]) -> None:
        """Score each free offer that did not draft once the text says how much of it verification would have
        accepted, so a free candidate's figures stay current without probes."""
        waiting = []
        for shadow in self.shadows:
            shadow.seen += tokens
            accepted = shadow.accepted()
            if accepted is None:
                waiting.append(shadow)
            else:
                self.figures.records[shadow.name].update(accepted, None, shadow.nodes)
        self.shadows = waiting

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        r = self.round
        self.score_shadows(step.tokens)
        if not s.others:  # scored at the next round's start (`rescale`)
            r.curve_s = forward_time(r.costs, step.tree.size)
        for name, d in self.candidates.items():
            d.observe(s, seq, r.proposal if name == r.chosen else Proposal(), step)
        if r.chosen != AR:
            self.learn(s, step)
        add(s.stats.extra, **{f"auto_{r.chosen}_rounds": 1, f"auto_{r.chosen}_tokens": len(step.tokens)})
        s.stats.extra["auto_chunks"].append([r.chosen, len(step.tokens)])  # JSON-shaped: records round-trip

    def learn(self, s: Session, step: Step) -> None:
        """Fold the chosen candidate's round into its figures; a probe is judged by the prices every choice uses."""
        r = self.round
        record, accepted = self.record(r.chosen), step.accepted
        if r.proposal.expected is not None:  # its own expectation, scaled by how it fared in this request
            accepted = self.calibration[r.chosen].score(step.accepted, r.proposal.expected)
        record.update(accepted, r.draft_s if r.steady else None, step.drafted)
        wait = self.waits[r.chosen]
        wait.idle = 0
        if r.probing:
            draft_s = r.draft_s if r.steady else record.draft_s
            rate = self.rate(r.chosen, r.costs, s.others, step.drafted, accepted, draft_s)
            wait.judge(paid=rate >= self.plain_rate(r.costs, s.others))
        elif step.accepted:
            wait.backoff = 1

    def sources(self, proposal: Proposal, step: Step) -> list[str]:
        """The chosen candidate's, for its own proposal."""
        return self.candidates[self.round.chosen].sources(self.round.proposal, step)

    def finish(self, s: Session) -> None:
        for d in self.candidates.values():
            d.finish(s)


def tree_size(root: int, paths: list[list[int]]) -> int:
    """The candidate tokens `paths` verify after `root` (one path: its length, without building its trie)."""
    return len(paths[0]) if len(paths) == 1 else build_tree(root, paths).size - 1
