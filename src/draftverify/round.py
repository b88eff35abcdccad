"""The one decoding loop: draft -> one target forward -> verify -> roll back -> emit.

Every method runs `rounds(s, target, drafter)` (through `Method.rounds`): a generator that yields
each target forward as a `backend.Feed` and is sent its `backend.Forward`. `drive` runs the forwards
one by one for one request (`decode` is `drive` over `rounds`); `batch.Batch` stacks the forwards of
several requests (each on its own cache) into one. The prologue prefills the prompt (all but the
longest prefix an earlier request left in the engine's `prefix_cache`, where the target's rows are exact in any
forward) and emits the first token (the *root*: the last emitted token, which the target's cache does not hold yet);
a request that ends normally leaves its prompt and reply's keys and values there.
Then each round:

1. the drafter proposes candidates after the root (`Drafter.propose` -> `Proposal`): a tree of
   candidate paths (a chain is one path, no drafter or an empty proposal is plain
   autoregressive decoding), with the draft distributions of the tokens it sampled, and
   optionally Jacobi window rows that ride in the same forward;
2. `step.prepare_step` lays root + tree (+ window) out as ONE `Feed` (a tree mask where the
   candidates branch); `step.finish_step` runs the one verifier on its output (`verify.verify_tree`:
   greedy matching, rejection sampling for sampled tokens, multi-draft rejection sampling for
   deterministic ones) and rolls the target's cache back to root + accepted path;
3. the drafter is told what happened (`Drafter.observe`: roll back its own state, feed its pool,
   update its draft length) and the tokens go out through `Session.emit`, which applies the
   stopping rules per token.

`step.verify_step` runs both halves on any Runner: Ouroboros's draft model uses it to check the
pool's phrases against itself while drafting.
"""

from __future__ import annotations

from typing import Generator

import torch

from draftverify.backend.feed import Feed, Forward
from draftverify.backend.ops import argmax_rows
from draftverify.costs import prefill
from draftverify.drafters.base import Drafter
from draftverify.models import Runner
from draftverify.prefix_cache import keep, prefill_start
from draftverify.sampling import sample
from draftverify.session import Session
from draftverify.step import Proposal, finish_step, prepare_step

Rounds = Generator[Feed, Forward, None]  # yields each target forward's feed, is sent its output


def decode(s: Session, target: Runner, drafter: Drafter | None = None) -> None:
    """Decode one request with `drafter` proposing (None: autoregressive decoding)."""
    drive(rounds(s, target, drafter), target)


def drive(request: Rounds, runner: Runner) -> None:
    """Run one request's rounds to the end, each forward on `runner` (one sequence: no batch). The first, the
    prefill, measures in its parts a cost curve that waits for one (`costs.prefill`: a model this machine has not
    timed); alone, a forward's time is its own."""
    try:
        feed = request.send(prefill.forward(runner, next(request)))
        while True:
            feed = request.send(runner.run(feed))
    except StopIteration:
        pass


def rounds(s: Session, target: Runner, drafter: Drafter | None = None) -> Rounds:
    """The request's prologue and rounds as a generator that hands out each target forward instead of running
    it, so that one caller runs it alone (`drive`) and another stacks several requests' forwards into one
    (`batch.Batch`). `target` is the request's own runner: its cache is the request's."""
    hidden = drafter is not None and drafter.needs_hidden
    reused, states = prefill_start(s, target, hidden)  # a prefix held by the prefix cache is not prefilled again
    with s.stats.timer("verify"):  # the prefill: logits for the first new token, the prompt's hidden states if asked
        first = yield Feed(s.prompt[reused:], last=1, hidden="all" if hidden else False)
    s.stats.target_forwards += 1
    if hidden:
        states = first.hidden if states is None else torch.cat([states, first.hidden])
    root = pick(first.logits[-1], s, target.device)
    if not s.emit([root]):
        return keep(s, target, states)
    seq = s.prompt + [root]
    if drafter is not None:
        drafter.start(s, seq, states)
    limit = target.max_length or 1 << 30
    try:
        while True:
            room = min(s.remaining - 1, limit - len(seq))  # candidate tokens worth verifying
            if s.step_rows:  # in a batch under a gap budget: no deeper than the rows its share of the step allows
                room = min(room, s.step_rows - 1)
            proposal = Proposal()
            if drafter is not None:
                with s.stats.timer("draft"):
                    proposal = drafter.propose(s, seq, room)
            with s.stats.timer("verify"):
                prepared = prepare_step(target, root, proposal)
                out = yield prepared.feed
                step = finish_step(target, s, proposal, prepared, out, process=True)
            s.stats.verified(step.drafted, step.accepted, len(step.tokens))
            if drafter is not None:
                drafter.observe(s, seq, proposal, step)
            if s.processor is not None:
                s.processor.record(step.node_logits[step.producers], step.tokens)
            if s.provenance:  # the accepted drafted tokens lead the chunk; the one after them is the target's
                s.drafted_by = drafter.sources(proposal, step) if step.accepted else []
            if not s.emit(step.tokens):
                return keep(s, target, states)  # what the cache holds, for a later request (`prefix_cache`)
            seq += step.tokens
            root = seq[-1]
    finally:
        if drafter is not None:
            drafter.finish(s)


def pick(logits: torch.Tensor, s: Session, device: torch.device) -> int:
    """Next token from logits [V]: argmax when greedy, else a sample after the shared processing."""
    if s.processor is not None:  # the first token: nothing generated before it
        logits = s.processor.rows(s.output, [[]], logits[None])[0]
    if s.sampling.greedy:
        token = argmax_rows(logits)[0]
    else:
        token = sample(s.sampling.probs(logits), s.generator(device))
    if s.processor is not None:
        s.processor.record(logits[None], [token])
    return token
