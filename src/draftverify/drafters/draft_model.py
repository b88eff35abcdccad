"""A draft model drafts a chain autoregressively (Leviathan et al. 2023; Chen et al. 2023).

Up to `policy.max_length()` tokens, one draft forward each, greedy or sampled from the draft's
q with the target's temperature / top-k / top-p; the policy may stop earlier after any token.
The draft's cache holds a prefix of the sequence and is fed the rest before drafting; after
verification it is cropped to the accepted prefix. `vocab` (FR-Spec, Zhao et al. 2025): draft only from
these token ids, the target's most frequent (`Method.draft_vocab`), so that each draft forward reads that many
rows of the LM head instead of all of them; the target still verifies against its whole vocabulary.
"""

from __future__ import annotations

import torch

from draftverify.backend.feed import Feed
from draftverify.backend.ops import argmax_rows
from draftverify.costs import prefill
from draftverify.costs.curves import waiting_curves
from draftverify.drafters.base import Drafter, Proposal
from draftverify.logits import draft_logits
from draftverify.models import Runner
from draftverify.policies import DraftPolicy
from draftverify.sampling import sample
from draftverify.session import Session


class DraftModel(Drafter):
    label = "draft-model"

    def __init__(self, draft: Runner, policy: DraftPolicy, skip=None, vocab: torch.Tensor | None = None):
        self.draft, self.policy, self.skip, self.vocab = draft, policy, skip, vocab

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        self.draft.reset()
        if self.skip is None and waiting_curves(self.draft, all_logits=False):  # the policy's draft curve: timed in
            prefill.forward(self.draft, Feed(seq[:-1], last=1), all_logits=False)  # the prompt's parts, not apart

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        self.policy.start_round(len(seq))
        drafts, qs = self.chain(s, seq[self.draft.length :], min(self.policy.max_length(), room))
        return Proposal([drafts], torch.stack(qs) if qs else None)

    def chain(self, s: Session, feed: list[int], k: int) -> tuple[list[int], list[torch.Tensor]]:
        """Feed `feed` and draft up to `k` tokens; sampled decoding also returns each q [V]."""
        drafts, qs = [], []
        for n in range(1, k + 1):
            out = self.draft.forward(feed, last=1, hidden=self.policy.needs_hidden, skip=self.skip, vocab=self.vocab)
            s.stats.draft_forwards += 1
            logits = draft_logits(s, drafts, out.logits[-1])  # [V], processed as the target's would be here
            if s.sampling.greedy:
                drafts.append(argmax_rows(logits)[0])
            else:
                qs.append(s.sampling.probs(logits))
                drafts.append(sample(qs[-1], s.generator(self.draft.device)))
            feed = drafts[-1:]
            if not self.policy.keep_drafting(n, logits, None if out.hidden is None else out.hidden[-1]):
                break
        return drafts, qs

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step) -> None:
        accepted = step.accepted_of(proposal.chain)
        self.draft.crop(min(self.draft.length, len(seq) + accepted))
        self.policy.observe(len(proposal.chain), accepted)
