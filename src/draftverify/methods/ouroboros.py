"""Ouroboros: a draft model drafts phrase by phrase, phrases lengthen the draft, verification feeds the pool.

Zhao et al. 2024, "Ouroboros: Generating Longer Drafts Phrase by Phrase for Faster Speculative
Decoding" (v1: "Speculative Decoding with Large Model Enhanced Drafting"). Draft and target
share one phrase pool (`PhrasePool`: per first token at most G phrases of N tokens, LRU).
Each round:
1. *phrase drafting*: the draft model runs lookahead decoding over the shared pool (Jacobi
   window + the pool's phrases for the last token, one forward, `speculate`) and appends the
   phrase it accepts, until the draft-length policy stops it (default `phrases`: whole
   phrases until the sentence draft has >= gamma tokens). Off: one draft token per forward.
   Sampling: the draft's tokens are exact samples of the draft model, with their q;
2. *lengthening*: the K newest phrases starting with the draft's last token are appended as
   alternative suffixes; draft + suffixes form one trie, scored by ONE target forward;
3. `verify_tree` accepts: greedy matching, or rejection sampling for the draft's sampled
   tokens and multi-draft rejection sampling for the deterministic suffixes; a fully accepted
   draft continues into the best-matching suffix, and the next token is always added;
4. *inspiration*: windows of N - 1 tokens in the discarded part of the draft that match the
   target's predictions become phrases; *refinement*: every verified suffix is replaced in
   the pool by the target's version of it, whether or not the draft was accepted;
5. both caches roll back to the accepted tokens. The pool outlives the request (`reuse`).
Drafting is `drafters.phrases.Phrases` (1, inspiration) inside `drafters.lengthened.Lengthened`
(2, refinement); the rest is the shared round (`round.rounds`).

With a feature head (the default model's default, or `--draft` a head folder) step 1 is
the head's EAGLE-2 tree (`drafters.feature.FeatureHeadDrafter`) instead of phrase drafting on a draft
model: its best chain is lengthened by the pool's suffixes (2), refinement keeps the pool (4),
and the pool is fed the request's own n-grams (as `lookahead:context`: the prompt's, then the
output's). Phrase drafting over the head: the head reads no pool, so the K newest phrases that
start with the root ride beside its tree as branches of their own, verified in the same forward
(`Lengthened`'s `from_root`), so a phrase the text repeats is tried where the head's first token is
wrong. Suffixes and the root's phrases are priced against the rows they add (the cost curve).
Inspiration and the draft's Jacobi window need a draft model and are not used.

N and K default by the draft (`PHRASES`): over a feature head the pool holds the request's own n-grams, and longer
phrases with one suffix paid on the development prompts once a verified row got cheap (docs/ouroboros.md); a draft
model keeps the shorter phrases and two suffixes it was tuned with.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from draftverify.drafters.base import Drafter
from draftverify.drafters.feature import FeatureHeadDrafter
from draftverify.drafters.lengthened import Lengthened
from draftverify.drafters.phrases import Phrases
from draftverify.drafters.pool import PhrasePool
from draftverify.errors import require
from draftverify.methods.base import Artifact, Drafts, register
from draftverify.methods.lookahead import PoolMethod
from draftverify.policies import POLICIES, DraftPolicy, make_policy
from draftverify.session import Session


@dataclass(frozen=True)
class OuroborosConfig:
    """Ouroboros settings, with the papers' symbols.

    gamma: sentence draft length: the draft model drafts whole phrases until it has at least
           gamma tokens (the `phrases` policy; another policy decides differently).
    W:     Jacobi window width of the draft's lookahead decoding: guessed columns advanced per
           draft forward, each yielding a new phrase (0 = no window: phrases come only from
           verification and history).
    N:     phrase length (beta in the papers, lookahead's n-gram size): a phrase is a first
           token and N - 1 more; the window keeps N - 1 rows of guesses.
    G:     phrases kept per first token (the papers' W for the pool, lookahead's guess set
           size); the draft verifies all of them for its last token in every forward.
    K:     candidate suffixes: the K newest phrases starting with the draft's last token are
           verified with the draft in the target's one forward (over a feature head, with
           phrase drafting, also the K newest phrases starting with the root, beside its tree).
    policy/threshold: the draft-length policy (see policies.POLICIES) and its threshold.
    phrase_drafting, lengthening, inspiration, refinement, reuse: each component on or off.
    pool_file: JSON pool to start from and (with reuse) to save to after each request.
    A draft forward feeds W*(N-1) window tokens (the first is the root) and up to G*(N-1)
    guesses; a target forward 1 + (draft length) + up to K*(N-1) tokens.
    """

    gamma: int = 4
    W: int = 2
    N: int | None = None  # None: by the draft (`PHRASES`)
    G: int = 2
    K: int | None = None  # None: by the draft (`PHRASES`)
    policy: str = "phrases"
    threshold: float = 0.4
    phrase_drafting: bool = True
    lengthening: bool = True
    inspiration: bool = True
    refinement: bool = True
    reuse: bool = True
    pool_file: str | None = None

    def __post_init__(self):
        require(1 <= self.gamma <= 64, f"gamma={self.gamma} must lie in 1..64")
        require(0 <= self.W <= 64, f"window width W={self.W} must lie in 0..64")
        require(self.N is None or 2 <= self.N <= 16, f"phrase length N={self.N} must lie in 2..16")
        require(1 <= self.G <= 64, f"phrases per token G={self.G} must lie in 1..64")
        require(self.K is None or 0 <= self.K <= self.G, f"suffixes K={self.K} must lie in 0..G={self.G}")
        require(self.policy in POLICIES, f"unknown draft policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        require(0 <= self.threshold <= 1, f"threshold={self.threshold} must lie in [0, 1]")


# N and K where the request leaves them unset, by the draft source (`Method.draft_source`; Ouroboros needs a draft).
PHRASES = {Artifact.FEATURE_HEAD: {"N": 4, "K": 1}, Artifact.DRAFT_MODEL: {"N": 3, "K": 2}}


@register
class Ouroboros(PoolMethod):
    name = "ouroboros"
    Config = OuroborosConfig
    drafts_with = Drafts((Artifact.FEATURE_HEAD, Artifact.DRAFT_MODEL), required=True)
    presets = {
        "cpu": {},  # the defaults: small trees and drafts, for a CPU where each verified row costs a share of a step
        "specbench": {"gamma": 6, "W": 15, "N": 5, "G": 15, "K": 3},  # reference Spec-Bench script
        "humaneval": {"gamma": 12, "W": 20, "N": 8, "G": 20, "K": 3},  # v2 Table 11, Yi-34B/6B
        "gsm8k": {"gamma": 4, "W": 15, "N": 7, "G": 15, "K": 3},  # v2 Table 11, Yi-34B/6B
    }

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        unset = {key: value for key, value in PHRASES[self.draft_source].items() if getattr(self.config, key) is None}
        self.config = replace(self.config, **unset)

    def make_policy(self) -> DraftPolicy:
        return make_policy(self.config.policy, self.config.gamma, self.config.threshold)

    def pool_drafter(self, s: Session, pool: PhrasePool) -> Drafter:
        c = self.config
        # the head's tree, the root's phrases beside it, lengthened by suffixes
        if self.draft_source is Artifact.FEATURE_HEAD:
            head = FeatureHeadDrafter(self.draft, self.target)
            if not (c.lengthening or c.phrase_drafting):
                return head
            suffixes, roots = (c.K if c.lengthening else 0), (c.K if c.phrase_drafting else 0)
            return Lengthened(head, pool, suffixes, c.refinement, True, head.costs, from_root=roots)
        phrases = Phrases(self.draft_model(), pool, self.make_policy(), c)
        return Lengthened(phrases, pool, c.K, c.refinement) if c.lengthening else phrases
