"""Ouroboros drafting (Zhao et al. 2024): a draft model drafts phrase by phrase over a shared pool.

Draft and target share one phrase pool (`PhrasePool`: per first token at most G phrases of N
tokens, LRU). Each round:
1. *phrase drafting*: the draft model runs lookahead decoding over the pool (Jacobi window +
   the pool's phrases for its last token, checked against itself in one forward by
   `step.verify_step`) and appends what it accepts, until the draft-length policy stops it.
   Off: one token per draft forward. Sampled decoding: the draft's tokens are exact samples of
   the draft model, with their q;
2. *inspiration*: windows of N - 1 tokens in the discarded part of the draft that match the
   target's predictions become phrases.
Lengthening by pool suffixes and refinement are the `Lengthened` combinator around this drafter.
"""

from __future__ import annotations

import torch

from draftverify.backend.ops import argmax_rows
from draftverify.drafters.base import Drafter, Proposal, add
from draftverify.drafters.lookahead import JacobiWindow, window_for
from draftverify.drafters.pool import PhrasePool, inspirations
from draftverify.models import Runner
from draftverify.policies import DraftPolicy
from draftverify.session import Session
from draftverify.step import verify_step


class Phrases(Drafter):
    label = "draft-model"  # the draft model's phrase drafting over the pool

    def __init__(self, draft: Runner, pool: PhrasePool, policy: DraftPolicy, config):
        self.draft, self.pool, self.policy, self.c = draft, pool, policy, config  # config: OuroborosConfig
        self.window: JacobiWindow | None = None

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        self.draft.reset()
        self.window = window_for(s, self.c.W, self.c.N) if self.c.phrase_drafting else None

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        draft, q = self.draft_sentence(s, seq, room)
        return Proposal([draft], q)

    def draft_sentence(self, s: Session, seq: list[int], room: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft phrase by phrase after `seq` until the policy stops or `room` tokens are drafted.

        Returns the draft d_1..d_g and (sampling) the draft distributions q [g, V] they were
        drawn from. Afterwards the draft cache holds seq + d_1..d_{g-1}.
        """
        c, runner, policy = self.c, self.draft, self.policy
        draft: list[int] = []
        qs: list[torch.Tensor] = []
        going = True
        policy.start_round(len(seq))
        while going and len(draft) < min(policy.max_length(), room):
            context = seq + draft
            left = room - len(draft) - 1  # candidate tokens that could still be used
            guesses = [g[:left] for g in self.pool.get(context[-1], c.G)] if c.phrase_drafting and left > 0 else []
            rows = self.window.for_root(context[-1]) if self.window is not None and left > c.W + c.N else []
            step = verify_step(
                runner,
                s,
                context[-1],
                Proposal(guesses, rows=rows, lead=context[runner.length : -1], hidden=policy.needs_hidden),
            )
            grams = self.window.advance(context[-1], step.window_out) if step.window_out is not None else []
            s.stats.draft_forwards += 1
            add(s.stats.extra, window_ngrams=self.pool.insert_all(grams), phrase_tokens=step.accepted)
            for j, token in enumerate(step.tokens):
                draft.append(token)
                if step.probs is not None:
                    qs.append(step.probs[j])
                hidden = None if step.hidden is None else step.hidden[j]
                logits = step.node_logits[step.producers[j]]
                if len(draft) >= room or not policy.keep_drafting(len(draft), logits, hidden):
                    going = False
                    break
        runner.crop(min(runner.length, len(seq) + len(draft) - 1))
        return draft, (torch.stack(qs) if qs else None)

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step) -> None:
        c, draft = self.c, proposal.chain
        accepted = step.accepted_of(draft)  # of the sentence draft (the rest came from suffixes)
        if c.inspiration and accepted < len(draft):
            predicted = argmax_rows(step.node_logits[: len(draft) + 1])  # the target's token after root, d_1..d_g
            add(s.stats.extra, inspired=self.pool.insert_all(inspirations(draft, predicted, accepted, c.N)))
        add(s.stats.extra, draft_tokens=len(draft), draft_accepted=accepted, suffix_accepted=step.accepted - accepted)
        self.policy.observe(len(draft), accepted)
        self.draft.crop(min(self.draft.length, len(seq) + accepted))
