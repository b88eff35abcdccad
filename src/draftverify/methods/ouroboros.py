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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.errors import require
from draftverify.methods.base import register
from draftverify.methods.lookahead import JacobiWindow, PoolMethod, add, speculate
from draftverify.methods.speculative import _fit_vocab
from draftverify.policies import POLICIES, DraftPolicy, make_policy
from draftverify.pool import PhrasePool, inspirations
from draftverify.session import Session
from draftverify.tree import build_tree, layout
from draftverify.verify import verify_tree


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
           verified with the draft in the target's one forward.
    policy/threshold: the draft-length policy (see policies.POLICIES) and its threshold.
    phrase_drafting, lengthening, inspiration, refinement, reuse: each component on or off.
    pool_file: JSON pool to start from and (with reuse) to save to after each request.
    A draft forward feeds W*(N-1) window tokens (the first is the root) and up to G*(N-1)
    guesses; a target forward 1 + (draft length) + up to K*(N-1) tokens.
    """

    gamma: int = 4
    W: int = 2
    N: int = 3
    G: int = 2
    K: int = 2
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
        require(2 <= self.N <= 16, f"phrase length N={self.N} must lie in 2..16")
        require(1 <= self.G <= 64, f"phrases per token G={self.G} must lie in 1..64")
        require(0 <= self.K <= self.G, f"suffixes K={self.K} must lie in 0..G={self.G}")
        require(self.policy in POLICIES, f"unknown draft policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        require(0 <= self.threshold <= 1, f"threshold={self.threshold} must lie in [0, 1]")


@register
class Ouroboros(PoolMethod):
    name = "ouroboros"
    Config = OuroborosConfig
    needs_draft = True
    presets = {
        "cpu": {},  # the defaults: small trees for a CPU, where a 16-token forward costs 3.5 single ones
        "specbench": {"gamma": 6, "W": 15, "N": 5, "G": 15, "K": 3},  # reference Spec-Bench script
        "humaneval": {"gamma": 12, "W": 20, "N": 8, "G": 20, "K": 3},  # v2 Table 11, Yi-34B/6B
        "gsm8k": {"gamma": 4, "W": 15, "N": 7, "G": 15, "K": 3},  # v2 Table 11, Yi-34B/6B
    }

    def make_policy(self) -> DraftPolicy:
        return make_policy(self.config.policy, self.config.gamma, self.config.threshold)

    def decode(self, s: Session, pool: PhrasePool) -> None:
        cfg, target, stats = self.config, self.target, s.stats
        policy = self.make_policy()
        logits = self.prefill(s)
        root = self.pick(logits, s, target.device)
        if not s.emit([root]):
            return
        seq = s.prompt + [root]
        self.draft.reset()
        window = self.window_for(s) if cfg.phrase_drafting else None
        while True:
            room = min(s.remaining - 1, self.ahead(s))  # drafted tokens worth verifying
            # 1. the sentence draft, phrase by phrase
            with stats.timer("draft"):
                draft, q = self.draft_sentence(s, seq, pool, window, policy, room)
            # 2. lengthen it with the K newest phrases of its last token
            key = draft[-1] if draft else root
            suffixes = [c[: room - len(draft)] for c in pool.get(key, cfg.K)] if cfg.lengthening and room > len(draft) else []
            tree = build_tree(root, [draft + list(c) for c in suffixes] or [draft])  # draft = nodes 1..g
            # 3. one target forward over root + draft + suffixes, then verify
            base = target.length
            with stats.timer("verify"):
                lay = layout(tree)
                tlogits = target.forward(lay.tokens, positions=torch.tensor(lay.offsets) + base, tree_mask=lay.mask).logits
                verdict = self.verify(s, tree.tokens, tree.parents, tlogits, q)
            target.select(base, [base + node for node in [0] + verdict.path])
            accepted = min(verdict.accepted, len(draft))  # of the sentence draft
            # 4. feed the pool from the verification
            predicted = tlogits.argmax(-1).tolist()  # [n] the target's next token after each node
            if cfg.inspiration and accepted < len(draft):
                add(stats.extra, inspired=pool.insert_all(inspirations(draft, predicted[: len(draft) + 1], accepted, cfg.N)))
            if cfg.refinement:
                for old, path in zip(suffixes, tree.paths):
                    if len(old) == cfg.N - 1:
                        fixed = [predicted[node] for node in [len(draft)] + path[len(draft) : -1]]
                        add(stats.extra, refined=int(pool.replace(key, old, fixed)))
            # 5. bookkeeping, rollback, emit
            stats.verified(tree.size - 1, verdict.accepted, len(verdict.tokens))
            add(stats.extra, draft_tokens=len(draft), draft_accepted=accepted, suffix_accepted=verdict.accepted - accepted)
            policy.observe(len(draft), accepted)
            self.draft.crop(min(self.draft.length, len(seq) + accepted))
            if not s.emit(verdict.tokens):
                return
            seq += verdict.tokens
            root = seq[-1]

    def draft_sentence(
        self, s: Session, seq: list[int], pool: PhrasePool, window: JacobiWindow | None, policy: DraftPolicy, room: int
    ) -> tuple[list[int], torch.Tensor | None]:
        """Draft phrase by phrase after `seq` until the policy stops or `room` tokens are drafted.

        Returns the draft d_1..d_g and (sampling) the draft distributions q [g, V] they were
        drawn from. Afterwards the draft cache holds seq + d_1..d_{g-1}.
        """
        cfg, runner, stats = self.config, self.draft, s.stats
        draft: list[int] = []
        qs: list[torch.Tensor] = []
        going = True
        while going and len(draft) < min(policy.max_length(), room):
            context = seq + draft
            left = room - len(draft) - 1  # candidate tokens that could still be used
            guesses = [c[:left] for c in pool.get(context[-1], cfg.G)] if cfg.phrase_drafting and left > 0 else []
            use_window = window if left > cfg.W + cfg.N else None
            step = speculate(runner, s, context[-1], context[runner.length : -1], guesses, use_window, policy.needs_hidden)
            stats.draft_forwards += 1
            add(stats.extra, window_ngrams=pool.insert_all(step.grams), phrase_tokens=step.accepted)
            for j, token in enumerate(step.tokens):
                draft.append(token)
                if step.probs is not None:
                    qs.append(step.probs[j])
                hidden = None if step.hidden is None else step.hidden[j]
                if len(draft) >= room or not policy.keep_drafting(len(draft), step.logits[j], hidden):
                    going = False
                    break
        runner.crop(min(runner.length, len(seq) + len(draft) - 1))
        return draft, (torch.stack(qs) if qs else None)

    def verify(self, s: Session, tokens: list[int], parents: list[int], tlogits: torch.Tensor, q: torch.Tensor | None):
        """verify_tree over root + draft (nodes 1..g, sampled from q [g, V]) + suffixes (deterministic)."""
        node_tokens = torch.tensor(tokens, device=tlogits.device)
        if s.sampling.greedy:
            return verify_tree(node_tokens, parents, tlogits, greedy=True)
        p = s.sampling.probs(tlogits)  # [n, V]
        g = 0 if q is None else q.shape[0]
        q_nodes = torch.zeros_like(p)
        if g:
            q_nodes[1 : g + 1] = _fit_vocab(q, p.shape[-1]).to(p.device)
        sampled = [0 < i <= g for i in range(len(tokens))]
        return verify_tree(node_tokens, parents, p, q_nodes, sampled, s.generator(self.target.device), greedy=False)
