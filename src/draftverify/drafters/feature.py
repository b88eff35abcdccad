"""Drafting with a feature head (`feature_draft.FeatureDraft`): EAGLE-2's dynamic draft tree.

The head reads the target's own final hidden states, which the target's verification forward
returns anyway (`Proposal.hidden`), so drafting costs only the head's small forwards. Each round:

1. the head catches up on the positions the target accepted last round (true features, one
   forward of those rows into its KV cache) and predicts the feature at the root;
2. expansion (EAGLE-2, Li et al. 2024): the children of a node are the head's `top_k` most
   likely tokens, scored by the product of draft probabilities along the path (the draft's
   confidence, which tracks acceptance); up to `depth - 1` times, the `top_k` best-scoring nodes
   of the newest level are fed to the head together, in one tree-masked forward of its own
   (expansion stops early once even the likeliest new node is worth less, in expected accepted
   tokens times a target forward, than the measured time of one more expansion);
3. reranking: of all nodes, the n best-scoring form the tree (a child never outscores its
   parent, so they form a tree), n chosen from the target's measured cost curve: the n with the
   most expected tokens per second, (1 + sum of the n confidences) / t_target(n + 1) (or a fixed
   `nodes`; 0 = by the curve).

The candidates are deterministic guesses (no q): greedy decoding accepts the child that equals
the target's argmax, sampled decoding verifies them by multi-draft rejection sampling
(`verify.verify_tree`), so both stay exact. `top_k = 1` drafts a chain.
"""

from __future__ import annotations

import math
import time

import torch

from draftverify.costs import curve, forward_time
from draftverify.drafters.base import Drafter, Proposal, Step
from draftverify.feature_draft import FeatureDraft, HeadCache
from draftverify.models import Runner
from draftverify.session import Session

TREE_WIDTHS = (1, 2, 4, 8, 16, 32)


class FeatureHead(Drafter):
    needs_hidden = True

    def __init__(self, head: FeatureDraft, target: Runner, depth: int = 6, top_k: int = 8, nodes: int = 0, max_nodes: int = 48, vocab: int = 0):
        self.head, self.depth, self.top_k, self.nodes, self.max_nodes = head.pack(), depth, top_k, nodes, max_nodes
        n = vocab or head.vocab.numel()  # FR-Spec: the head's vocabulary is most frequent first, so a prefix is a smaller head
        self.vocab = head.vocab[:n]
        self.logits = head.logits if n == head.vocab.numel() else lambda out: out @ head.lm_head[:n].T
        self.expand_s = 0.0  # seconds one expansion step takes (a running mean)
        self.costs = curve(target, widths=TREE_WIDTHS)
        self.device = head.fc.weight.device
        self.cache: HeadCache | None = None
        self.pending: tuple[torch.Tensor, list[int], int] | None = None  # features, next tokens, first position

    def start(self, s: Session, seq: list[int], hidden: torch.Tensor | None = None) -> None:
        self.cache = HeadCache(self.head, capacity=len(seq) + 64)
        self.pending = (hidden, seq[1:], 0)  # prompt position t holds f_t and token t + 1 (the last is the root)

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        features, tokens, first = self.pending
        ids = torch.tensor(tokens, device=self.device)
        out = self.cache.forward(features.to(self.head.fc.weight.dtype), ids, torch.arange(first, first + len(tokens), device=self.device))
        s.stats.draft_forwards += 1
        committed = self.cache.length
        paths = self.expand(s, out[-1], len(seq) - 1, min(room, self.depth)) if room > 0 else []
        self.cache.crop(committed)
        return Proposal(paths, hidden=True)

    @torch.inference_mode()
    def expand(self, s: Session, root_feature: torch.Tensor, root: int, depth: int) -> list[list[int]]:
        """Candidate paths after the root (at position `root`), EAGLE-2 style; see the module docstring."""
        cache = self.cache
        k = min(self.top_k, self.vocab.numel())
        committed = cache.length
        tokens: list[int] = []  # per draft node (the root excluded)
        parents: list[int] = []  # -1: the root
        scores: list[float] = []  # log of the product of draft probabilities along the path
        slot: dict[int, int] = {}  # node -> its entry in the head cache, once fed
        feature = {-1: root_feature}  # node -> the head's predicted feature after it, once fed

        def children(out: torch.Tensor, nodes: list[int]) -> list[int]:
            """Add the k best children of each fed node (its row of `out` [m, H]); return the new nodes."""
            logp = torch.log_softmax(self.logits(out).float(), dim=-1)  # [m, N]
            top, idx = logp.topk(k, dim=-1)
            top = (top + torch.tensor([scores[n] if n >= 0 else 0.0 for n in nodes], device=top.device)[:, None]).tolist()
            new = []
            for row, node in enumerate(nodes):
                for token, score in zip(self.vocab[idx[row]].tolist(), top[row]):
                    tokens.append(token)
                    parents.append(node)
                    scores.append(score)
                    new.append(len(tokens) - 1)
            return new

        level = children(root_feature[None], [-1])
        for d in range(1, depth):
            chosen = sorted(level, key=lambda i: -scores[i])[:k]
            if math.exp(scores[chosen[0]]) * forward_time(self.costs, 1) < self.expand_s:
                break  # even the likeliest new node is worth less than the forward that would grow it
            t0 = time.perf_counter()
            base = cache.length
            slot.update({node: base + j for j, node in enumerate(chosen)})
            mask = torch.zeros(len(chosen), base - committed + len(chosen), dtype=torch.bool, device=self.device)
            for j, node in enumerate(chosen):  # each node sees its ancestors' entries and its own
                for a in [node, *_ancestors(node, parents)]:
                    mask[j, slot[a] - committed] = True
            out = cache.forward(
                torch.stack([feature[parents[n]] for n in chosen]),
                torch.tensor([tokens[n] for n in chosen], device=self.device),
                torch.full((len(chosen),), root + d - 1, device=self.device),  # a depth-d node is read at root + d - 1
                mask,
            )
            s.stats.draft_forwards += 1
            feature.update({node: out[j] for j, node in enumerate(chosen)})
            level = children(out, chosen)
            self.expand_s = 0.8 * self.expand_s + 0.2 * (time.perf_counter() - t0)
        return self.best_paths(tokens, parents, scores)

    def best_paths(self, tokens: list[int], parents: list[int], scores: list[float]) -> list[list[int]]:
        """The best n nodes as root-to-leaf token paths, n the most expected tokens per second of the target."""
        order = sorted(range(len(tokens)), key=lambda i: -scores[i])[: self.nodes or self.max_nodes]
        gain, best, best_rate = 1.0, 0, 1.0 / forward_time(self.costs, 1)
        for n, node in enumerate(order if not self.nodes else [], start=1):
            gain += math.exp(min(0.0, scores[node]))  # the draft's confidence stands for the chance it is accepted
            rate = gain / forward_time(self.costs, n + 1)
            if rate > best_rate:
                best, best_rate = n, rate
        keep = set(order[: self.nodes or best])
        keep = {n for n in keep if all(a in keep for a in _ancestors(n, parents))}
        leaves = [n for n in keep if not any(parents[c] == n for c in keep)]
        return [[tokens[n] for n in [leaf, *_ancestors(leaf, parents)][::-1]] for leaf in sorted(leaves, key=lambda n: -scores[n])]

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        self.pending = (step.hidden, step.tokens, len(seq) - 1)  # the root's position and the accepted nodes'

    def finish(self, s: Session) -> None:
        self.cache = self.pending = None


def _ancestors(node: int, parents: list[int]) -> list[int]:
    out = []
    while parents[node] != -1:
        node = parents[node]
        out.append(node)
    return out
