"""A combinator for `auto`: each round, the candidate drafter worth the most tokens per second, or none.

Every round costs the chosen drafter's drafting time plus one target forward over root + its
candidates, and yields 1 + (accepted candidates) tokens. For each candidate the drafter keeps
running means, over the rounds that candidate drafted, of what it cost and earned:

    rate(c) = (1 + accepted(c)) / (draft_s(c) + scale(c) * t(1 + nodes(c)))

with t the target's measured cost curve at the request's context (`costs.curve`, `costs.at_context`:
long prompts make wide forwards dearer) and `scale(c)` the running ratio, over the rounds c drafted,
of what the rest of such a round measured (from the proposal to the next round: the forward, the
verification, the drafters' bookkeeping, the emitting) to the curve's t. Plain autoregressive
decoding scores (1 - margin) / (scale(plain) * t(1)), its scale taken from plain rounds alike: it
wins only where every candidate is slower by more than `margin` (`AutoConfig.margin`), because a
drafted round tells auto what its drafter is worth now, and because a drafter that sat out pays a
catch-up when it comes back (docs/benchmarks/smollm2-auto: auto's runs).

Each choice has a scale of its own because a round's forward does not cost the curve's t alike for
every choice. The curve times forwards back to back; a drafted round's forward follows the drafting,
and on a CPU whose cache other work shares it finds less of the weights still cached the longer it
waited, so one scale for all priced a drafted round too cheap against a plain one (the ratios measured
are in docs/architecture.md#auto; `auto[measure=false]` prices the old way). A choice not yet measured takes the
running ratio of every round (`Figures.scale`, so load on the machine moves them alike), and plain
decoding is probed like a candidate when the request decodes alone (a plain round after `probe` drafted
ones, waits doubling while it does not win on price, none where a candidate is priced far above it), so its scale
is measured too. In a batch
(`batch`), t is the time the request's rows *add* to the shared forward (`costs.marginal_time` after the other requests'
rows): drafts pay while the curve is flat and stop paying where it turns linear. A *free* drafter (`Drafter.free`: a
pool or
prompt lookup, no model run) is asked every round, and is a candidate only when it has
something, priced at its actual number of nodes. With `merge`, a model-run drafter and a free one
that has something also make a *merged* candidate (`head+lookup`): the model's candidates and the
free offer verified as one trie in one forward, priced by running means of its own (on a flat cost
curve the free offer rides almost for nothing, and wins where the text repeats itself while the
model still drafts the rest; on a CPU's steeper curve it is one more choice to probe and seldom
pays, so it is off by default). The highest rate drafts; a model-run or merged candidate (a free one is
scored without drafting, below) that has not drafted for `probe` rounds it could have drafted in
drafts once, so a draft that started badly is noticed (in a batch, where a
probe slows every request, every `probe` times one plus the other requests' rows; and none for a
candidate that would not beat plain decoding even with every token it verifies accepted, as where
each row a busy batch adds costs its shared forward more than a step's share); a merged
candidate's probe verifies only the first `PROBE_TOKENS` tokens of its free offer's first path. A probe that
did not pay (its tokens per second, priced as above, below plain decoding's) doubles that
candidate's wait for its next probe (up to `MAX_BACKOFF` times), and a probe that paid, or a
round chosen on price that got something accepted, resets it: where a drafter does not pay, its
probes stop costing every `probe`-th round. The running means carry over to the next requests
(warm start, through the method's `Figures`; they start from an optimistic prior in a fresh one); the waits are each
request's own, so a request unlike the earlier ones gets its probes early.

Two things keep the figures from misleading it. A drafter that sat out catches up on the
rounds it missed when it drafts again (a feature head feeds their features, a draft model
their tokens): that round's time says what sitting out cost, not what a round costs, so
`draft_s` is taken only from rounds that follow one the drafter drafted. And where a drafter
knows its own chances (`Proposal.expected`: the feature head's calibrated acceptance of its
tree, summed), `accepted` is taken from that rather than from the round's count: one round
accepts 0 or 2 where the head expected 0.8, and a probe judged by the count alone would shut
out a head that pays on average. That expectation is scaled by how it fared in this request
(tokens accepted over tokens expected in the drafter's rounds so far, `CALIBRATION_PRIOR`
expected tokens counted as right to start): the head is calibrated on its training replies, and
a request's text may be harder or easier than those (docs/benchmarks/smollm2-auto: auto's runs).

A free drafter's offers may differ in worth in a way it can tell in advance (prompt lookup's after a one-token
match are accepted far less often than after a three-token one): it names each offer's kind (`Proposal.kind`), and
auto keeps figures per kind (`name (kind)`) and prices each offer by its own kind's, so a kind that does not pay in
a request sits out while the others draft.

A free candidate is asked every round, so it is scored every round too: an offer it made in a
round it did not draft (`Shadow`) is held until the text that follows says how much of it
verification would have accepted (its longest path's prefix that the target went on to produce;
under sampling a guess matches the sampled token with the chance verification would accept it),
and that goes into its running mean as a drafted round's count would. Its figures so stay current
without probes, which it never gets: a probe would cost a round to learn what the text tells for
nothing, and a lookup that sat out behind stale figures would sit out for good. Only its time is not told
by the text: its scale (above) comes from its own rounds, so while it sits out that figure fades toward every
round's (`relax`), or one slow round would price it out for the rest of the process.

Every candidate is told every round (`observe` with its own proposal when it drafted, an empty
one otherwise), so the feature head queues the target's features and the pools take the new
n-grams whoever drafted. Which candidates draft changes only what is verified, never what is
accepted: greedy output is the target's, and sampling stays exact because each round's
proposal depends only on the tokens so far and its own draws (`verify.verify_tree`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from draftverify.costs import at_context, forward_time, marginal_time
from draftverify.drafters.base import Drafter, Proposal, Step, add
from draftverify.session import Session
from draftverify.tree import build_tree

AR = "autoregressive"  # the name of a round nobody drafted
MAX_BACKOFF = 8  # a candidate whose probes keep missing waits at most this many times `probe` rounds
PROBE_TOKENS = 2  # a free offer in a merged candidate's probe: its first path's first tokens (a wide trie costs dearly)
# A plain round is not probed where a candidate is priced above this many times plain decoding's rate: plain
# rounds' scale would have to be off by that factor to change the choice, and the probe would forgo a round that
# copies a long repeat.
PLAIN_PROBE_BELOW = 2.0
CALIBRATION_PRIOR = 4.0  # tokens: a drafter's own expectation counts as right until this many have been scored


@dataclass
class CandidateRecord:
    """Running means of what one candidate earned per round it drafted (`decay`: the old rounds' weight)."""

    accepted: float = 1.0  # candidate tokens accepted (the prior is optimistic, so every candidate is tried)
    draft_s: float = 0.0  # seconds drafting (until a round is timed: nothing; the first timed round sets it)
    nodes: float = 4.0  # candidate tokens verified
    timed: bool = False  # whether a round has set `draft_s`

    def update(self, decay: float, accepted: float, draft_s: float | None, nodes: int) -> None:
        """`draft_s` None: this round's drafting time says nothing of a round's (see the module docstring)."""
        self.accepted = decay * self.accepted + (1 - decay) * accepted
        if draft_s is not None:
            self.draft_s = decay * self.draft_s + (1 - decay) * draft_s if self.timed else draft_s
            self.timed = True
        self.nodes = decay * self.nodes + (1 - decay) * nodes


@dataclass
class Shadow:
    """A free candidate's offer in a round it did not draft, scored against the text that came after it."""

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


class AutoDrafter(Drafter):
    def __init__(
        self,
        candidates: dict[str, Drafter],
        costs: dict,
        figures: Figures,
        probe: int = 8,
        decay: float = 0.7,
        merge: bool = False,
        margin: float = 0.0,
        measure: bool = True,
    ):
        """`figures` are the caller's, updated in place round by round.
        `merge`: also offer each model-run drafter's candidates merged with each free drafter's offer.
        `measure`: scale each choice's price by what its own rounds measure (False: every choice by the running
        scale of all rounds, which cancels out of the choice)."""
        self.candidates, self.costs, self.figures, self.measuring = candidates, costs, figures, measure
        self.records = figures.records
        self.needs_hidden = any(d.needs_hidden for d in candidates.values())
        self.probe, self.decay, self.margin = probe, decay, margin
        model_run = [name for name, d in candidates.items() if not d.free]
        free = [name for name, d in candidates.items() if d.free]
        self.merged = (
            {f"{m}+{f}": (m, f) for m in model_run for f in free} if merge else {}
        )  # name -> (model-run, free)
        for name in [*candidates, *self.merged]:
            self.records.setdefault(name, CandidateRecord())
        self.calibration = {
            name: [CALIBRATION_PRIOR, CALIBRATION_PRIOR] for name in candidates
        }  # this request's accepted, expected
        self.idle = dict.fromkeys(
            [*candidates, *self.merged, AR], 0
        )  # this request's rounds since each last drafted (when it could have); plain decoding is probed too
        self.backoff = dict.fromkeys(
            [*candidates, *self.merged, AR], 1
        )  # the wait for each one's next probe, in `probe`s of rounds
        self.timing: tuple[str, float] | None = None  # the last round's choice and curve time, scored next round
        self.chosen: str = AR
        self.model_run: str | None = None  # the model-run drafter in this round's choice, if any
        self.previous: set[str] = set()  # the candidates that proposed last round (caught up, if they run a model)
        self.probing = False  # whether the chosen candidate drafts as a probe (it sat out too long), not on its price
        self.parts: dict[str, Proposal] = {}  # what each candidate proposed this round (two for a merged one)
        self.draft_s = 0.0
        self.sent_at = 0.0  # when the proposal went to verification
        self.costs_now: dict = {}  # the cost table at this round's context (`costs.at_context`)
        self.shadows: list[Shadow] = []  # free offers not drafted, waiting for the text that scores them
        self.keys: dict[str, str] = {}  # this round's free offers' figures, where an offer has a kind

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        s.stats.extra["auto_chunks"] = []  # (drafter, tokens emitted) per round: who produced what (`--explain`)
        for d in self.candidates.values():
            d.start(s, seq, hidden if d.needs_hidden else None)

    def verify_time(self, name: str, costs: dict, nodes: float, others: int) -> float:
        """The rest of a round `name` chooses, past its drafting: its scale times the curve's time."""
        scale = self.figures.scales.get(name, self.figures.scale) if self.measuring else self.figures.scale
        return scale * marginal_time(costs, round(1 + nodes), others)

    def plain_rate(self, costs: dict, others: int) -> float:
        return (1 - self.margin) / self.verify_time(AR, costs, 0, others)

    def rate(self, name: str, costs: dict, others: int, nodes: float, accepted: float | None = None) -> float:
        """Tokens per second of a round of `name` verifying `nodes` candidates, `accepted` of them (None: the
        running mean of its figures for this round's kind of offer)."""
        r = self.record(name)
        return (1 + (r.accepted if accepted is None else accepted)) / (
            r.draft_s + self.verify_time(name, costs, nodes, others)
        )

    def could_pay(self, name: str, costs: dict, others: int, nodes: float) -> bool:
        """Whether a round of `name` verifying `nodes` candidates would beat plain decoding with every one of them
        accepted: where not (in a busy batch each row adds much to the shared forward), a probe can only cost."""
        return self.rate(name, costs, others, nodes, accepted=nodes) >= self.plain_rate(costs, others)

    def record(self, name: str) -> CandidateRecord:
        """The figures `name`'s offer this round is priced by and scores: its kind's (`Proposal.kind`; from the
        prior a candidate starts from, the first time that kind is offered), or the candidate's."""
        return self.records.setdefault(self.keys.get(name, name), CandidateRecord())

    def nodes(self, size: dict[str, int]) -> tuple[dict[str, float], dict[str, int]]:
        """What each candidate would verify this round, given the free offers' sizes, and a free offer's share of
        it (a model-run candidate's: its running mean)."""
        nodes, free_part = {}, {}
        for name, d in self.candidates.items():
            if not d.free:
                nodes[name] = self.records[name].nodes
            elif name in size:
                nodes[name], free_part[name] = size[name], size[name]
        for name, (model_run, free) in self.merged.items():
            if free in size:
                nodes[name], free_part[name] = self.records[model_run].nodes + size[free], size[free]
        return nodes, free_part

    def measure(self, now: float) -> None:
        """Score the round before this one (its time past drafting against the curve's), alone only: in a batch
        a round's time holds the other requests' rows and work."""
        if self.timing is not None:
            name, curve_s = self.timing
            measured = (now - self.sent_at) / curve_s
            self.figures.scale = self.decay * self.figures.scale + (1 - self.decay) * measured
            if self.measuring:
                old = self.figures.scales.get(name, measured)
                self.figures.scales[name] = self.decay * old + (1 - self.decay) * measured
        self.timing = None

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        t0 = time.perf_counter()
        self.measure(t0)
        self.chosen, self.parts, self.model_run, self.keys = AR, {}, None, {}
        self.costs_now = costs = at_context(self.costs, len(seq))
        if room > 0:
            offers = {name: d.propose(s, seq, room) for name, d in self.candidates.items() if d.free}
            self.keys = {name: f"{name} ({offer.kind})" for name, offer in offers.items() if offer.kind}
            size = {name: tree_size(seq[-1], offer.paths) for name, offer in offers.items() if offer.paths}
            nodes, free_part = self.nodes(size)
            rates = {AR: self.plain_rate(costs, s.others)}
            rates.update({name: self.rate(name, costs, s.others, n) for name, n in nodes.items()})
            able = [name for name in rates if name != AR]
            if able:  # a round something could draft in: every wait grows by one (the chosen one is reset below)
                for name in (*able, AR):
                    self.idle[name] += 1
            every = self.probe * (1 + s.others)  # in a batch a probe slows every request: probe that much less often
            # a free candidate is never probed: its offers are scored whether it drafts or not (`Shadow`)
            due = [name for name in able if self.idle[name] > every * self.backoff[name] and name not in offers]
            # a probe's free offer is its first guesses only (below)
            probe_nodes = {n: nodes[n] - free_part.get(n, 0) + min(free_part.get(n, 0), PROBE_TOKENS) for n in due}
            stale = [name for name in due if self.could_pay(name, costs, s.others, probe_nodes[name])]
            best = max(rates, key=rates.__getitem__)
            # plain rounds are probed for their scale, alone only, and not where a candidate promises far more
            if able and self.measuring and not s.others and self.idle[AR] > every * self.backoff[AR]:
                stale += [AR] if rates[best] < PLAIN_PROBE_BELOW * rates[AR] else []
            self.chosen = max(stale, key=self.idle.__getitem__) if stale else best
            self.probing = bool(stale)
            if self.chosen == AR:  # a plain round: chosen on price it resets the wait for the next, a probe doubles it
                self.idle[AR] = 0
                self.backoff[AR] = min(MAX_BACKOFF, 2 * self.backoff[AR]) if self.probing else 1
            model_run, free = self.merged.get(
                self.chosen, (AR, self.chosen) if self.chosen in offers else (self.chosen, None)
            )
            if model_run != AR:
                self.model_run = model_run
                self.parts = {model_run: self.candidates[model_run].propose(s, seq, room)}
            if free is not None:
                offer = offers[free]
                if self.probing:  # a probe asks whether the offer is right at all: its first guesses, not a wide trie
                    offer = replace(offer, paths=[offer.paths[0][:PROBE_TOKENS]])
                self.parts[free] = offer
            sitting_out = [n for n in offers if n in size and n != free]  # free offers this round does not draft
            self.shadows += [Shadow(self.keys.get(n, n), offers[n].paths, size[n]) for n in sitting_out]
            self.relax(sitting_out)
        proposal = merge(*self.parts.values()) if self.parts else Proposal(hidden=self.needs_hidden)
        if self.needs_hidden and not proposal.hidden:
            proposal = replace(proposal, hidden=True)
        self.sent_at = time.perf_counter()
        self.draft_s = self.sent_at - t0
        return proposal

    def relax(self, sitting_out: list[str]) -> None:
        """Move the scale of each free candidate that had an offer but sits out this round toward the running scale of
        every round. A free candidate is never probed (its offers are scored as shadows), so only its own rounds
        measure its scale: one slow round (the machine busy elsewhere) priced it out, it never drafted again, and the
        figures carry over to later requests, so `auto` decoded plainly for the rest of the process. What a choice's
        own rounds measured fades while it sits out, as a probe would have renewed it."""
        for name in sitting_out:
            if name in self.figures.scales:
                old = self.figures.scales[name]
                self.figures.scales[name] = self.decay * old + (1 - self.decay) * self.figures.scale

    def score_shadows(self, tokens: list[int]) -> None:
        """Score each free offer that did not draft once the text says how much of it verification would have
        accepted (under sampling, a guess matches the sampled token with the chance verification accepts it), so
        a free candidate's figures stay current without probes."""
        waiting = []
        for shadow in self.shadows:
            shadow.seen += tokens
            accepted = shadow.accepted()
            if accepted is None:
                waiting.append(shadow)
            else:
                self.records[shadow.name].update(self.decay, accepted, None, shadow.nodes)
        self.shadows = waiting

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        self.score_shadows(step.tokens)
        if not s.others:  # scored at the next round's start (`measure`), against the curve's t for this forward
            self.timing = (self.chosen, forward_time(self.costs_now, step.tree.size))
        for name, d in self.candidates.items():
            d.observe(s, seq, self.parts.get(name, Proposal()), step)
        if self.chosen != AR:
            record = self.record(self.chosen)
            steady = self.model_run is None or self.model_run in self.previous  # caught up on one round, not on many
            own = self.parts.get(self.chosen)  # a single candidate's proposal (a merged one's figures are the round's)
            accepted = step.accepted
            if (
                own is not None and own.expected is not None
            ):  # its own expectation, scaled by how it fared in this request
                calibration = self.calibration[self.chosen]
                calibration[0] += step.accepted
                calibration[1] += own.expected
                accepted = own.expected * calibration[0] / calibration[1]
            record.update(self.decay, accepted, self.draft_s if steady else None, step.drafted)
            self.idle[self.chosen] = 0
            if self.probing:  # judged by the prices every choice uses: did this round beat plain decoding's rate?
                costs, draft_s = self.costs_now, self.draft_s if steady else record.draft_s
                verify_s = self.verify_time(self.chosen, costs, step.drafted, s.others)
                paid = (1 + accepted) / (draft_s + verify_s) >= self.plain_rate(costs, s.others)
                self.backoff[self.chosen] = 1 if paid else min(MAX_BACKOFF, 2 * self.backoff[self.chosen])
            elif step.accepted:
                self.backoff[self.chosen] = 1
        self.previous = set(self.parts)
        add(s.stats.extra, **{f"auto_{self.chosen}_rounds": 1, f"auto_{self.chosen}_tokens": len(step.tokens)})
        s.stats.extra["auto_chunks"].append([self.chosen, len(step.tokens)])  # JSON-shaped: records round-trip

    def finish(self, s: Session) -> None:
        for d in self.candidates.values():
            d.finish(s)


def tree_size(root: int, paths: list[list[int]]) -> int:
    """The candidate tokens `paths` verify after `root` (one path: its length, without building its trie)."""
    return len(paths[0]) if len(paths) == 1 else build_tree(root, paths).size - 1


def merge(first: Proposal, *more: Proposal) -> Proposal:
    """One proposal of several candidates' paths (one trie): `first`'s own (its sampled chain, if any, stays
    the first path) and the others' paths as further deterministic guesses. At most one may carry a window."""
    if not more:
        return first
    windows = [p.rows for p in (first, *more) if p.rows]
    assert len(windows) <= 1, "one forward holds one lookahead window"
    return replace(
        first, paths=[*first.paths, *(path for p in more for path in p.paths)], rows=windows[0] if windows else []
    )
