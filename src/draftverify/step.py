"""One verified forward on any Runner: feed a `Proposal`, verify it, roll the cache back, return a `Step`.

The round (`round.rounds`) runs it on the target; a drafter may run it on its own model (Ouroboros
checks the pool's phrases against the draft model this way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftverify.backend.feed import Feed, Forward
from draftverify.backend.ops import argmax_rows
from draftverify.models import Runner
from draftverify.session import Session
from draftverify.tree import Layout, Tree, build_tree, layout
from draftverify.verify import Verdict, fit_vocab, verify_tree


@dataclass
class Proposal:
    """Candidates for one verification.

    paths: token lists continuing the root, merged into one trie (a chain is one path; none =
        verify nothing, i.e. one autoregressive step). The first path's tokens are nodes
        1..len(paths[0]) of the trie.
    q: [g, V] for sampled decoding: the first path's first g tokens were sampled from these
        draft distributions (rejection sampling); every other token is a deterministic guess
        (multi-draft rejection sampling). None: all deterministic.
    rows: Jacobi window rows fed in the same forward (lookahead; `tree.layout`).
    lead: tokens before the root that the verifying runner's cache has not seen yet.
    hidden: return the hidden states of the emitted tokens.
    expected: the drafter's own estimate of how many of its candidates the target will accept (a feature
        head's calibrated chances, summed), when it has one; `auto` prices it by that rather than by one
        round's count.
    kind: what sort of offer this is, where a drafter's offers differ in worth by something it can tell in
        advance (a prompt lookup's match length); `auto` keeps a candidate's figures per kind and prices each offer
        by its own kind's. "" = one kind.
    """

    paths: list[list[int]] = field(default_factory=list)
    q: torch.Tensor | None = None
    rows: list[list[int]] = field(default_factory=list)
    lead: list[int] = field(default_factory=list)
    hidden: bool = False
    expected: float | None = None
    kind: str = ""

    @property
    def chain(self) -> list[int]:
        """The first path: what a chain drafter drafted (nodes 1..len of the trie)."""
        return self.paths[0] if self.paths else []


@dataclass
class Step:
    """What one verified forward produced."""

    tree: Tree  # the candidate trie that was verified (node 0 = the root)
    verdict: Verdict  # the accepted path and the tokens to emit (accepted + the next one)
    node_logits: torch.Tensor  # [n, V] the model's logits after each tree node
    probs: torch.Tensor | None  # [len(tokens), V] distribution each emitted token was drawn from (sampling)
    hidden: torch.Tensor | None  # [len(tokens), H] hidden state that produced each emitted token
    window_out: list[int] | None  # argmax after each cell of the window's last row

    @property
    def tokens(self) -> list[int]:
        return self.verdict.tokens

    @property
    def accepted(self) -> int:
        return self.verdict.accepted

    @property
    def drafted(self) -> int:
        return self.tree.size - 1

    def accepted_of(self, chain: list[int]) -> int:
        """How many tokens of `chain` were accepted, where every path starts with it (a chain lengthened
        by suffixes): accepted tokens beyond it came from the suffixes."""
        return min(self.accepted, len(chain))

    @property
    def producers(self) -> list[int]:
        """The node whose distribution gave each emitted token (the root, then the accepted path)."""
        return [0] + self.verdict.path


@dataclass
class Prepared:
    """A proposal laid out for one forward: what to feed and what `finish_step` needs to read the result."""

    tree: Tree
    feed: Feed
    base: int  # the runner's cache length before the forward
    lay: Layout | None = None  # the tree's layout; None: a chain, fed causally without a mask

    @property
    def chain(self) -> bool:
        return self.lay is None


def verify_step(runner: Runner, s: Session, root: int, proposal: Proposal) -> Step:
    """Feed proposal.lead + root + tree (+ window) to `runner`, accept what it agrees with, roll back.

    The cache must hold everything before the lead; afterwards it holds lead, root and the
    accepted candidate tokens (not the returned next token). A chain with no window and no lead
    is fed causally, without a mask. `prepare_step` and `finish_step` are its two halves, for a
    caller that runs the forward itself (several sequences in one forward: `batch.Batch`).
    """
    prepared = prepare_step(runner, root, proposal)
    return finish_step(runner, s, proposal, prepared, runner.run(prepared.feed))


def prepare_step(runner: Runner, root: int, proposal: Proposal) -> Prepared:
    tree = build_tree(root, proposal.paths)
    rows, lead = proposal.rows, proposal.lead
    base = runner.length
    if not rows and not lead and all(p == i for i, p in enumerate(tree.parents, start=-1)):
        return Prepared(tree, Feed(tree.tokens, hidden=proposal.hidden), base)
    lay = layout(tree, rows, lead)
    positions = torch.tensor(lay.offsets) + base + len(lead)
    return Prepared(tree, Feed(lay.tokens, positions, lay.mask, lay.keep, proposal.hidden), base, lay)


def finish_step(
    runner: Runner, s: Session, proposal: Proposal, prepared: Prepared, out: Forward, process: bool = False
) -> Step:
    """Verify the forward's output `out` against the prepared tree and roll the cache back.
    `process`: the runner is the request's target and the root ends `s.output`, so the session's
    `logits.Processor` processes each node's logits for its prefix before verification."""
    tree, base, lay = prepared.tree, prepared.base, prepared.lay
    # node i's logits and state are row i of the output: a chain is fed alone, and `layout` lays the tree's nodes out
    # together, in node order, as the first of the rows it keeps (the window's last row follows them)
    node_logits = out.logits[: tree.size]  # [n, V]
    if process and s.processor is not None:
        node_logits = s.processor.tree(s.output, tree.tokens, tree.parents, node_logits)  # [n, V]
    tokens = tree.tokens  # a list: the verifier reads them as ints, so no tensor is made of them
    if s.sampling.greedy:
        probs = None
        verdict = verify_tree(tokens, tree.parents, node_logits, greedy=True)
    else:
        probs = s.sampling.probs(node_logits)  # [n, V]
        q, sampled = None, None
        if proposal.q is not None:  # the first path's first g tokens (nodes 1..g) were sampled from q
            g = proposal.q.shape[0]
            q = torch.zeros_like(probs)
            q[1 : g + 1] = fit_vocab(proposal.q, probs.shape[-1]).to(probs.device)
            sampled = [0 < i <= g for i in range(tree.size)]
        verdict = verify_tree(tokens, tree.parents, probs, q, sampled, s.generator(runner.device), greedy=False)
    producers = [0] + verdict.path
    if prepared.chain:
        runner.crop(base + len(producers))
    else:
        runner.select(base, [base + i for i in lay.lead + [lay.tree[node] for node in producers]])
    window_out = None
    if proposal.rows:
        window_out = argmax_rows(out.logits[[lay.row(i) for i in lay.window[-1]]])  # [W]
    return Step(
        tree=tree,
        verdict=verdict,
        node_logits=node_logits,
        probs=None if probs is None else probs[producers],
        hidden=None if out.hidden is None else out.hidden[producers],
        window_out=window_out,
    )
