"""Self-speculative decoding: the target drafts for itself by skipping some of its sub-layers.

Zhang et al. 2024, "Draft & Verify: Lossless Large Language Model Acceleration via
Self-Speculative Decoding" (ACL). No second model, no extra memory. Each round:
1. with the skip set's attention / MLP sub-layers bypassed (`Runner.forward(skip=...)`), the
   model drafts up to K tokens from the verified prefix in its own KV cache,
   greedily or by sampling from its skip-draft distribution q (Alg. 4); the adaptive draft
   exit stops once the draft's top probability falls below gamma (Sec. 3.4);
2. the cache is rolled back to the verified prefix in every layer (skipped layers wrote nothing,
   the others wrote K/V computed from draft hidden states) and the full model scores root +
   drafts in one forward, which rewrites every layer;
3. the verifier accepts drafts (greedy: while equal to argmax p; sampling: min(1, p/q), a
   rejection resampled from norm(max(p - q, 0))), plus one more token;
4. the cache is cropped to the accepted prefix and the policy updates gamma.
Drafting is `drafters.layer_skip.LayerSkip`; steps 2-4 are the shared round (`round.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

from draftverify.drafters.layer_skip import LayerSkip
from draftverify.drafters.skipsets import STRATEGIES, SkipSet, load_skip_set, make_skip_set, stored_skip_set
from draftverify.errors import MissingDrafts, require
from draftverify.loading import model_identity
from draftverify.loading.hf import model_source
from draftverify.loading.store import missing
from draftverify.methods.base import Artifact, Drafts, Method, register
from draftverify.models import Runner
from draftverify.policies import POLICIES, AdaptiveThreshold, DraftPolicy, make_policy
from draftverify.round import Rounds, rounds
from draftverify.session import Session


@dataclass(frozen=True)
class SelfSpeculativeConfig:
    """Which sub-layers the draft skips:
    strategy     searched (the skip set found by `draftverify search-layers`: skip_file, else the
                 draft store's for this model and arithmetic, `loading.store`), heuristic (paper-like,
                 ~45% of the sub-layers), first / middle / last / random (as many sub-layers as the
                 searched set skips, the paper's Appendix D comparison), or none (draft = the full model)
    skip_file    a skip-set JSON from `draftverify search-layers` (refused on another model)
    skip         a SkipSet object (Python API); overrides strategy and skip_file
    n_attention, n_mlp   first/middle/last/random: how many attention / MLP sub-layers to skip
    layer_seed   random: which random layers (not `seed`, the sampling seed)
    How long each draft is (Sec. 3.4):
    policy       adaptive (gamma adapts toward alpha), confidence (static threshold gamma),
                 constant (always k tokens) or heuristic (transformers' schedule)
    k            K, the most tokens per draft (the fixed K of constant)
    gamma        gamma_0 of adaptive, the threshold of confidence: stop once the draft's top
                 probability falls below it
    alpha        adaptive: target acceptance rate (the paper tunes it per task, 0.7..0.9)
    epsilon      adaptive: threshold step
    beta1, beta2 adaptive: smoothing of the acceptance rate and of the threshold
    vocab        draft only from the target's `vocab` most frequent reply tokens (FR-Spec, `Method.draft_vocab`;
                 0, the default = all of them): a drafting forward then reads that many rows of the LM head, not
                 all. Off by default: a skip draft's head is a small part of its forward, and the tokens outside
                 the vocabulary cost more acceptance than the rows save (docs/self-speculative.md)
    """

    strategy: str = "searched"
    skip_file: str | None = None
    skip: SkipSet | None = None
    n_attention: int | None = None  # None: as many as the searched skip set (or the heuristic one)
    n_mlp: int | None = None
    layer_seed: int = 0
    policy: str = "adaptive"
    k: int = 12
    gamma: float = 0.6
    alpha: float = 0.85
    epsilon: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    vocab: int = 0

    def __post_init__(self):
        require(self.vocab >= 0, f"vocab={self.vocab} must be >= 0")
        require(
            self.strategy in STRATEGIES, f"unknown skip strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}"
        )
        require(self.policy in POLICIES, f"unknown draft policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        require(1 <= self.k <= 64, f"k={self.k} must lie in 1..64")
        AdaptiveThreshold(self.gamma, self.alpha, self.epsilon, self.beta1, self.beta2, self.k)  # validates the rest


@register
class SelfSpeculative(Method):
    name = "self-speculative"
    Config = SelfSpeculativeConfig
    drafts_with = Drafts(beside=(Artifact.SKIP_SET,))  # the target itself drafts, its skip set's sub-layers bypassed
    # Draft & Verify, Table 6 (alpha per task), Table 3 (fixed K), Table 4 (static gamma), App. D (strategies)
    presets = {
        "code": {"alpha": 0.9},
        "chat": {"alpha": 0.85},
        "summarization": {"alpha": 0.9},
        "k2": {"policy": "constant", "k": 2},
        "k4": {"policy": "constant", "k": 4},
        "k8": {"policy": "constant", "k": 8},
        "static": {"policy": "confidence", "gamma": 0.6},
        "static-0.4": {"policy": "confidence", "gamma": 0.4},
        "static-0.8": {"policy": "confidence", "gamma": 0.8},
        "first": {"strategy": "first"},
        "middle": {"strategy": "middle"},
        "last": {"strategy": "last"},
        "random": {"strategy": "random"},
        "heuristic": {"strategy": "heuristic"},
    }

    def __init__(self, target: Runner, draft: Runner | None = None, config=None, feature_head=None):
        super().__init__(target, draft, config, feature_head)
        c = self.config
        if c.skip is not None:
            self.skip = c.skip
        else:
            searched = (
                load_skip_set(c.skip_file, model_identity(target.model)) if c.skip_file else stored_skip_set(target)
            )
            if searched is None and c.strategy == "searched":
                raise MissingDrafts(missing("skipset", model_source(target.model)))
            self.skip = make_skip_set(c.strategy, target.model, searched, c.n_attention, c.n_mlp, c.layer_seed)

    def make_policy(self) -> DraftPolicy:
        c = self.config
        if c.policy == "adaptive":
            return AdaptiveThreshold(c.gamma, c.alpha, c.epsilon, c.beta1, c.beta2, max_k=c.k)
        return make_policy(c.policy, c.k, c.gamma)

    def rounds(self, s: Session) -> Rounds:
        policy = self.make_policy()
        s.stats.extra.update(skipped_attention=len(self.skip.attention), skipped_mlp=len(self.skip.mlp))
        try:
            drafter = LayerSkip(self.target, policy, skip=self.skip, vocab=self.draft_vocab(self.config.vocab))
            yield from rounds(s, self.target, drafter)
        finally:
            if isinstance(policy, AdaptiveThreshold):
                s.stats.extra["final_gamma"] = policy.gamma
