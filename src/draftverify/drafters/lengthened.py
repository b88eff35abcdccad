"""A combinator: another drafter's chain, lengthened by pool phrases (Ouroboros's lengthening and refinement).

The inner drafter proposes a chain d_1..d_g. The K newest pool phrases that start with its last
token (the root's, for an empty draft) become alternative suffixes: d + suffix for each, one
trie, verified in the target's one forward, so a fully accepted draft runs on into the best
matching suffix. *Refinement*: every verified full-length suffix is replaced in the pool by the
target's own continuation along it, whether or not the draft was accepted. The inner drafter
is told about its own chain only: accepted tokens beyond it came from the suffixes.
`context`: the pool also takes the request's own n-grams (the prompt's at the start, the new
ones as tokens are emitted), for an inner drafter that feeds the pool nothing itself.
"""

from __future__ import annotations

from dataclasses import replace

from draftverify.drafters.base import Drafter, Proposal, Step, add
from draftverify.drafters.lookahead import ngrams
from draftverify.drafters.pool import PhrasePool
from draftverify.session import Session


class Lengthened(Drafter):
    def __init__(self, inner: Drafter, pool: PhrasePool, K: int, refinement: bool = True, context: bool = False):
        self.inner, self.pool, self.K, self.refinement, self.context = inner, pool, K, refinement, context
        self.inner_proposal: Proposal = Proposal()  # the inner drafter's own proposal this round
        self.suffixes: list[list[int]] = []

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
        others = self.inner_proposal.paths[1:]  # a tree drafter's other branches ride along
        return replace(self.inner_proposal, paths=[draft + c for c in self.suffixes] + others if self.suffixes else self.inner_proposal.paths or [draft])

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
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
