"""A combinator: another drafter's chain, lengthened by pool phrases (Ouroboros's lengthening and refinement).

The inner drafter proposes a chain d_1..d_g. The K newest pool phrases that start with its last
token (the root's, for an empty draft) become alternative suffixes: d + suffix for each, one
trie, verified in the target's one forward, so a fully accepted draft runs on into the best
matching suffix. *Refinement*: every verified full-length suffix is replaced in the pool by the
target's own continuation along it, whether or not the draft was accepted. The inner drafter
is told about its own chain only: accepted tokens beyond it came from the suffixes.
`context`: the pool also takes the request's own n-grams (the prompt's at the start, the new
ones as tokens are emitted), for an inner drafter that feeds the pool nothing itself.
`from_root` (Ouroboros's phrase drafting over an inner drafter that reads no pool, the feature head): that many
of the newest phrases that start with the root ride beside the inner draft as branches of their own, so a phrase
the text repeats is tried where the inner draft's first token is wrong (not refined: a phrase that went wrong
early would come back as the target's tokens after a wrong one).

`costs` (a target's cost curve; given with the feature head): the suffixes ride along only when
they pay. Every round's suffixes are scored whether or not they were verified, once the emitted
tokens settle them: the tokens they would have added (the most of one suffix that the target's
tokens follow, where the whole draft was accepted; else none). Their running mean, times a target
forward, must beat the time their rows add to the verifying forward (the cost curve's marginal
times). The root's phrases are priced alike, by a mean of their own: the tokens the best of them would have
added beyond what the rest of the proposal got. Where a row is not nearly free (a CPU's cost curve), unpriced
suffixes can make Ouroboros over the head slower than the head alone. Without `costs` (a draft model's phrase
drafting, the papers' method) they always ride along.
"""

from __future__ import annotations

from dataclasses import replace

from draftverify.backend.ops import argmax_rows
from draftverify.costs import at_context, marginal_times
from draftverify.drafters.base import Drafter, Proposal, Step, add, attribute
from draftverify.drafters.lookahead import ngrams
from draftverify.drafters.pool import PhrasePool
from draftverify.session import Session
from draftverify.tree import build_tree

DECAY = 0.7  # the weight of the older rounds in the suffixes' running mean (as `auto`'s)


class Lengthened(Drafter):
    def __init__(
        self,
        inner: Drafter,
        pool: PhrasePool,
        K: int,
        refinement: bool = True,
        context: bool = False,
        costs=None,
        from_root: int = 0,
    ):
        self.inner, self.pool, self.K, self.refinement, self.context, self.costs = (
            inner,
            pool,
            K,
            refinement,
            context,
            costs,
        )
        self.from_root = from_root
        self.roots: list[list[int]] = []  # the root's phrases verified this round
        self.root_gain = 1.0  # the tokens they add beyond the rest of the proposal, a running mean
        self.root_offered: list[tuple[int, list[list[int]], list[list[int]]]] = []  # position, other paths, phrases
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
            if not self.pays(s, seq, plain, lengthened, self.gain):
                self.suffixes = []
        paths = lengthened if self.suffixes else plain
        self.roots = self.root_phrases(s, seq, room, draft, paths)
        return replace(self.inner_proposal, paths=paths + self.roots)

    def root_phrases(
        self, s: Session, seq: list[int], room: int, draft: list[int], paths: list[list[int]]
    ) -> list[list[int]]:
        """The root's phrases that ride beside `paths` this round (`from_root` of them; for an empty draft the
        suffixes are the root's phrases already)."""
        if not self.from_root or room <= 0 or (not draft and self.K):
            return []
        roots = [list(c[:room]) for c in self.pool.get(seq[-1], self.from_root)]
        if draft:  # not one the draft's own tokens hold (or that runs on from them: the suffixes' part)
            roots = [c for c in roots if c[: len(draft)] != draft[: len(c)]]
        if roots and self.costs is not None:
            self.root_offered.append((len(seq), paths, roots))
            if not self.pays(s, seq, paths, paths + roots, self.root_gain):
                return []
        return roots

    def pays(self, s: Session, seq: list[int], plain: list[list[int]], more: list[list[int]], gain: float) -> bool:
        """Whether the paths `more` adds to `plain` are worth the rows they add to the trie, at `gain` tokens (see
        the module docstring)."""
        base, size = build_tree(seq[-1], plain).size, build_tree(seq[-1], more).size
        times = marginal_times(at_context(self.costs, len(seq)), size, s.others)
        return gain * times[0] > times[size - 1] - times[base - 1]

    def score(self, seq: list[int]) -> None:
        """Score each round's suffixes that the tokens so far settle (see the module docstring)."""
        waiting = []
        for at, draft, suffixes in self.offered:
            known = seq[at:]
            if known[: len(draft)] != draft[: len(known)]:  # the draft was cut short: no suffix could follow
                self.gain = DECAY * self.gain
                continue
            after = known[len(draft) :]
            matched = [_matched(c, after) for c in suffixes]
            if len(known) >= len(draft) and all(m < len(after) or m == len(c) for m, c in zip(matched, suffixes)):
                self.gain = DECAY * self.gain + (1 - DECAY) * max(matched)
            else:
                waiting.append((at, draft, suffixes))
        self.offered = waiting

    def score_roots(self, seq: list[int]) -> None:
        """Score each round's root phrases once the tokens so far settle them (see the module docstring)."""
        waiting = []
        for at, paths, roots in self.root_offered:
            known = seq[at:]
            if len(known) < max(len(c) for c in paths + roots):
                waiting.append((at, paths, roots))
                continue
            extra = max(_matched(c, known) for c in roots) - max(_matched(c, known) for c in paths)
            self.root_gain = DECAY * self.root_gain + (1 - DECAY) * max(0, extra)
        self.root_offered = waiting

    def sources(self, proposal: Proposal, step: Step) -> list[str]:
        """The inner drafter's for the accepted tokens its own paths hold, the pool's for its phrases' tokens."""
        inner = self.inner_proposal.paths or [self.inner_proposal.chain]
        return attribute(step.tokens[: step.accepted], [(self.inner.label, inner), ("phrase-pool", proposal.paths)])

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        self.score(seq + step.tokens)
        self.score_roots(seq + step.tokens)
        if self.roots:
            add(s.stats.extra, root_phrases=len(self.roots))
        draft = self.inner_proposal.chain
        if self.refinement:
            predicted = argmax_rows(step.node_logits)  # [n] the target's next token after each node
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


def _matched(path: list[int], known: list[int]) -> int:
    """How many of `path`'s tokens the known tokens follow."""
    return next((i for i, (a, b) in enumerate(zip(path, known)) if a != b), min(len(path), len(known)))
