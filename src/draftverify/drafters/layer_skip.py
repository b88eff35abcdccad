"""The target drafts for itself with some sub-layers skipped (Draft & Verify, Zhang et al. 2024).

Drafting runs on the target's own runner and cache, from the verified prefix, with the skip
set's attention / MLP sub-layers bypassed; before the target verifies, the cache is cropped
back to the verified prefix in every layer, and the verifying forward rewrites them all.
"""

from __future__ import annotations

from draftverify.drafters.base import Proposal
from draftverify.drafters.draft_model import DraftModel
from draftverify.session import Session


class LayerSkip(DraftModel):
    label = "layer-skip"

    def start(self, s: Session, seq: list[int], hidden=None) -> None:
        pass  # the target's cache: the round has just filled it

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        base = self.draft.length  # every token but the root
        proposal = super().propose(s, seq, room)
        self.draft.crop(base)
        return proposal

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step) -> None:
        self.policy.observe(len(proposal.chain), step.accepted_of(proposal.chain))  # the round rolled the cache back
