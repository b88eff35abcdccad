"""Speculative decoding and speculative sampling with a draft model.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"). Each round:
1. the draft proposes up to K tokens autoregressively (K chosen by a draft-length policy: by
   default `cost`, the K with the most expected tokens per second under the measured cost
   curves of target and draft, possibly 0 when no draft pays; see policies.CostAware),
   sampling them from q with the same temperature/top-k/top-p as the target;
2. the target scores root + drafts in one forward, giving p at every drafted position;
3. `verify_chain` accepts drafts (greedy: while they equal argmax p; sampling: with
   min(1, p/q), resampling a rejection from norm(max(p - q, 0))), plus one more token;
4. both caches are cropped back to the accepted prefix.

Cache invariant: the target cache holds every token except the last emitted one (the root
of the next round); the draft cache holds a prefix of the sequence and is fed the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.errors import require
from draftverify.methods.base import Method, register
from draftverify.models import Runner
from draftverify.policies import POLICIES, DraftPolicy, make_policy
from draftverify.sampling import sample
from draftverify.session import Session
from draftverify.verify import Verdict, verify_chain


@dataclass(frozen=True)
class SpeculativeConfig:
    policy: str = "cost"  # cost (the measured cost curve) | constant | heuristic | confidence
    k: int = 8  # cap (cost, confidence), draft length (constant) or start length (heuristic)
    threshold: float = 0.4  # confidence: stop when the draft's top probability is below it

    def __post_init__(self):
        require(self.policy in POLICIES, f"unknown draft policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        require(1 <= self.k <= 64, f"k={self.k} must lie in 1..64")
        require(0 <= self.threshold <= 1, f"threshold={self.threshold} must lie in [0, 1]")


@register
class Speculative(Method):
    name = "speculative"
    Config = SpeculativeConfig
    needs_draft = True
    presets = {
        "k2": {"policy": "constant", "k": 2},
        "k4": {"policy": "constant", "k": 4},
        "k6": {"policy": "constant", "k": 6},
        "heuristic": {"policy": "heuristic", "k": 5},
        "confidence": {"policy": "confidence", "k": 10, "threshold": 0.4},
    }

    def make_policy(self) -> DraftPolicy:
        return make_policy(self.config.policy, self.config.k, self.config.threshold, self.target, self.draft)

    def run(self, s: Session, policy: DraftPolicy | None = None) -> None:
        policy = policy or self.make_policy()
        target, draft, stats = self.target, self.draft, s.stats
        greedy = s.sampling.greedy
        logits = self.prefill(s)
        root = self.pick(logits, s, target.device)
        if not s.emit([root]):
            return
        seq = s.prompt + [root]
        draft.reset()
        limit = target.max_length or 1 << 30
        while True:
            # 1. draft up to k tokens (never more than the output can still take, nor past the context)
            k_max = min(policy.max_length(), s.remaining - 1, limit - len(seq))
            drafts, qs = [], []
            feed = seq[draft.length :]  # what the draft cache has not seen yet
            with stats.timer("draft"):
                for n in range(1, k_max + 1):
                    out = draft.forward(feed, last=1, hidden=policy.needs_hidden)
                    stats.draft_forwards += 1
                    dlogits = out.logits[-1]
                    if greedy:
                        drafts.append(int(dlogits.argmax().item()))
                    else:
                        q = s.sampling.probs(dlogits)
                        drafts.append(sample(q, s.generator(draft.device)))
                        qs.append(q)
                    feed = drafts[-1:]
                    if not policy.keep_drafting(n, dlogits, None if out.hidden is None else out.hidden[-1]):
                        break
            # 2-4. score root + drafts with the target, verify, roll back to the accepted prefix and emit
            verdict = verify_round(s, target, root, drafts, qs, policy)
            draft.crop(min(draft.length, target.length))
            if not s.emit(verdict.tokens):
                return
            seq += verdict.tokens
            root = seq[-1]


def verify_round(s: Session, target: Runner, root: int, drafts: list[int], qs: list[torch.Tensor], policy: DraftPolicy) -> Verdict:
    """One verification: the target scores root + drafts in one forward (its cache holds everything
    before the root), `verify_drafts` accepts, the stats and the policy are told, and the target's
    cache is cropped to the accepted prefix (root + accepted drafts)."""
    base = target.length
    with s.stats.timer("verify"):
        tlogits = target.forward([root] + drafts).logits  # [k + 1, V]
        verdict = verify_drafts(s, root, drafts, qs, tlogits)
    s.stats.verified(len(drafts), verdict.accepted, len(verdict.tokens))
    policy.observe(len(drafts), verdict.accepted)
    target.crop(base + 1 + verdict.accepted)
    return verdict


def verify_drafts(s: Session, root: int, drafts: list[int], qs: list[torch.Tensor], tlogits: torch.Tensor) -> Verdict:
    """`verify_chain` of a chain of drafts against the target's logits [k + 1, V] over root + drafts.

    Greedy compares argmaxes; sampling accepts with min(1, p/q), q [V] per draft from `qs`.
    """
    device = tlogits.device
    draft_t = torch.tensor(drafts, dtype=torch.long, device=device)  # [k]
    if s.sampling.greedy:
        return verify_chain(root, draft_t, tlogits, greedy=True)
    p = s.sampling.probs(tlogits)
    q = _fit_vocab(torch.stack(qs), p.shape[-1]).to(device) if qs else None
    return verify_chain(root, draft_t, p, q, s.generator(device), greedy=False)


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities [k, Vd] -> [k, vocab] (pad with zeros or cut a padded draft vocabulary)."""
    if q.shape[-1] >= vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
