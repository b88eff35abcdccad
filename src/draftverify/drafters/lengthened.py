"""A combinator: another drafter's chain, lengthened by pool phrases (Ouroboros's lengthening and refinement).

The inner drafter proposes a chain d_1..d_g. The K newest pool phrases that start with its last
token (the root's, for an empty draft) become alternative suffixes: d + suffix for each, one
trie, verified in the target's one forward, so a fully accepted draft runs on into the best
matching suffix. *Refinement*: every verified full-length suffix is replaced in the pool by the
target's own continuation along it, whether or not the draft was accepted. The inner drafter
is told about its own chain only: accepted tokens beyond it came from the suffixes.
`context`: the pool also takes the request's own n-grams (the prompt's at the start, the new
ones as tokens are emitted), for an inner drafter that feeds the pool nothing itself.

`costs` (a target's cost curve; given with the feature head): the suffixes ride along only when
they pay. Every round's suffixes are scored whether or not they were verified, once the emitted
tokens settle them: the tokens they would have added (the most of one suffix that the target's
tokens follow, where the whole draft was accepted; else none). Their running mean, times a target
forward, must beat the time their rows add to the verifying forward (the cost curve's marginal
times). Where a row is not nearly free (a CPU's cost curve), unpriced suffixes can make Ouroboros over
the head slower than the head alone (the runs in docs/benchmarks/smollm2-feature-head). Without `costs` (a
draft model's phrase drafting, the papers' method) they always ride along.
"""

from __future__ import annotations

from dataclasses import replace

from draftverify.costs import at_context, marginal_times
from draftverify.drafters.base import Drafter, Proposal, Step, add
from draftverify.drafters.lookahead import ngrams
from draftverify.drafters.pool import PhrasePool
from draftverify.session import Session
from draftverify.tree import build_tree

DECAY = 0.7  # the weight of the older rounds in the suffixes' running mean (as `auto`'s)


class Lengthened(Drafter):
    def __init__(
        self, inner: Drafter, pool: PhrasePool, K: int, refinement: bool = True, context: bool = False, costs=None
    ):
        self.inner, self.pool, self.K, self.refinement, self.context, self.costs = (
            inner,
            pool,
            K,
            refinement,
            context,
            costs,
        )
        self.inner_proposal: Proposal = Proposal()  # the inner drafter's own proposal this round
        self.suffixes: list[list[int]] = []  # the suffixes verified this round
        self.gain = 1.0  # the tokens a round's suffixes add, a running mean (optimistic at first: they are tried)
        self.offered: list[
            tuple[int, list[int], list[list[int]]]
        ] = []  # suffixes not scored yet: position, draft, suffixes

    @property
    def needs_hidden(self) -> bool:
        return self.inner.needs_hidden

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        self.inner.start(s, seq, hidden)
        if self.context:
            add(s.stats.extra, context_ngrams=self.pool.insert_all(ngrams(seq, self.pool.n)))

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        self.inner_proposal = self.inner.propose(s, seq, room)
        draft = self.inner_proposal.chain
        key = draft[-1] if draft else seq[-1]
        left = room - len(draft)
        self.suffixes = [list(c[:left]) for c in self.pool.get(key, self.K)] if left > 0 else []
        plain = self.inner_proposal.paths or [draft]
        lengthened = [draft + c for c in self.suffixes] + plain[1:]  # a tree drafter's other branches ride along
        if self.costs is not None and self.suffixes:
            self.offered.append((len(seq), draft, self.suffixes))
            if not self.pays(s, seq, plain, lengthened):
                self.suffixes = []
        return replace(self.inner_proposal, paths=lengthened if self.suffixes else plain)

    def pays(self, s: Session, seq: list[int], plain: list[list[int]], lengthened: list[list[int]]) -> bool:
        """Whether the suffixes are worth the rows they add to the trie (see the module docstring)."""
        base, size = build_tree(seq[-1], plain).size, build_tree(seq[-1], lengthened).size
        times = marginal_times(at_context(self.costs, len(seq)), size, s.others)
        return self.gain * times[0] > times[size - 1] - times[base - 1]

    def score(self, seq: list[int]) -> None:
        """Score each round's suffixes that the tokens so far settle (see the module docstring)."""
        waiting = []
        for at, draft, suffixes in self.offered:
            known = seq[at:]
            if known[: len(draft)] != draft[: len(known)]:  # the draft was cut short: no suffix could follow
                self.gain = DECAY * self.gain
                continue
            after = known[len(draft) :]
            matched = [
                next((i for i, (a, b) in enumerate(zip(c, after)) if a != b), min(len(c), len(after))) for c in suffixes
            ]
            if len(known) >= len(draft) and all(m < len(after) or m == len(c) for m, c in zip(matched, suffixes)):
                self.gain = DECAY * self.gain + (1 - DECAY) * max(matched)
            else:
                waiting.append((at, draft, suffixes))
        self.offered = waiting

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        self.score(seq + step.tokens)
        draft = self.inner_proposal.chain
        if self.refinement:
            predicted = step.node_logits.argmax(-1).tolist()  # [n] the target's next token after each node
            key = draft[-1] if draft else seq[-1]
            for old, path in zip(self.suffixes, step.tree.paths):
                if len(old) == self.pool.n - 1:
                    fixed = [predicted[node] for node in [len(draft)] + path[len(draft) : -1]]
                    add(s.stats.extra, refined=int(self.pool.replace(key, old, fixed)))
        self.inner.observe(s, seq, self.inner_proposal, step)
        if self.context:  # the n-grams that end in the new tokens
            tail = (seq + step.tokens)[-(len(step.tokens) + self.pool.n - 1) :]
            add(s.stats.extra, context_ngrams=self.pool.insert_all(ngrams(tail, self.pool.n)))

    def finish(self, s: Session) -> None:
        self.inner.finish(s)
