"""Speculative decoding and speculative sampling with a draft model.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"). Each round:
1. the draft proposes up to K tokens autoregressively (K chosen by a draft-length policy: by
   default `cost`, the K with the most expected tokens per second under the measured cost
   curves of target and draft, possibly 0 when no draft pays; see policies.CostAware),
   sampling them from q with the same temperature/top-k/top-p as the target;
2. the target scores root + drafts in one forward, giving p at every drafted position;
3. the verifier accepts drafts (greedy: while they equal argmax p; sampling: with
   min(1, p/q), resampling a rejection from norm(max(p - q, 0))), plus one more token;
4. both caches are cropped back to the accepted prefix.
Drafting is `drafters.draft_model.DraftModel`; steps 2-4 are the shared round (`round.rounds`).

With a feature head (`--draft` a folder made by `make-draft --kind head`) the head drafts
instead (`drafters.feature.FeatureHeadDrafter`): an EAGLE-2 dynamic tree of depth up to k whose size
follows the target's measured cost curve (`width=1`, preset `chain`: one chain).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftverify.drafters.base import Drafter
from draftverify.drafters.draft_model import DraftModel
from draftverify.drafters.feature import DRAFT_VOCAB, WIDTH, FeatureHeadDrafter
from draftverify.errors import require
from draftverify.methods.base import Artifact, Drafts, Method, register
from draftverify.policies import POLICIES, DraftPolicy, make_policy
from draftverify.session import Session


@dataclass(frozen=True)
class SpeculativeConfig:
    policy: str = "cost"  # cost (the measured cost curve) | constant | heuristic | confidence
    k: int = 8  # cap (cost, confidence), draft length (constant) or start length (heuristic)
    threshold: float = 0.4  # confidence: stop when the draft's top probability is below it
    # feature head: children per expanded node and nodes expanded per level (1 = a chain; not `top_k`, which is the
    # sampling setting)
    width: int = WIDTH
    nodes: int = 0  # feature head: draft tree size (0 = the most expected tokens/s under the cost curve)
    # draft only the `vocab` most frequent reply tokens (FR-Spec; 0 = all): a feature head's own ranking, a draft
    # model's from the engine's feature head (`Method.draft_vocab`)
    vocab: int = DRAFT_VOCAB

    def __post_init__(self):
        require(self.policy in POLICIES, f"unknown draft policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        require(1 <= self.k <= 64, f"k={self.k} must lie in 1..64")
        require(0 <= self.threshold <= 1, f"threshold={self.threshold} must lie in [0, 1]")
        require(1 <= self.width <= 64, f"width={self.width} must lie in 1..64")
        require(0 <= self.nodes <= 256, f"nodes={self.nodes} must lie in 0..256")
        require(self.vocab >= 0, f"vocab={self.vocab} must be >= 0")


@register
class Speculative(Method):
    name = "speculative"
    Config = SpeculativeConfig
    drafts_with = Drafts((Artifact.FEATURE_HEAD, Artifact.DRAFT_MODEL), required=True)
    presets = {
        "k2": {"policy": "constant", "k": 2},
        "k4": {"policy": "constant", "k": 4},
        "k6": {"policy": "constant", "k": 6},
        "heuristic": {"policy": "heuristic", "k": 5},
        "confidence": {"policy": "confidence", "k": 10, "threshold": 0.4},
        "chain": {"width": 1},  # feature head: one chain instead of a tree
    }

    def make_policy(self) -> DraftPolicy:
        return make_policy(self.config.policy, self.config.k, self.config.threshold, self.target, self.draft_model())

    def drafter(self, s: Session) -> Drafter:
        if self.draft_source is Artifact.FEATURE_HEAD:
            return FeatureHeadDrafter(
                self.draft,
                self.target,
                depth=self.config.k,
                width=self.config.width,
                nodes=self.config.nodes,
                vocab=self.config.vocab,
            )
        return DraftModel(self.draft, self.make_policy(), vocab=self.draft_vocab(self.config.vocab))
