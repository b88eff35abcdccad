"""The one verifier: which drafted tokens the target accepts, and the token that follows.

Pure tensors, no model. Drafts form a tree (a chain is a tree with one child per node):
node 0 is the root (the last emitted token, already accepted) and node i > 0 holds a
candidate token whose parent is `parents[i]`. `p[i]` is the target's distribution for the
token after node i (so `p[parent]` judges node i). A node is either *sampled* from the
draft distribution `q[i]` (Leviathan et al. / Chen et al.: accept with min(1, p/q), else
continue from the residual norm(max(p - q, 0))) or a *deterministic* guess, such as an
n-gram from a pool (treated as one-hot q: accept with probability p(x), else continue from p
with x removed and renormalised). Trying a node's children in turn this way is multi-draft
rejection sampling (SpecInfer / lookahead decoding); every step leaves the output
distributed exactly as p. When the walk ends at a node, the next token is drawn from that
node's current distribution: the residual after a rejection, or the untouched p after a
full accept (the bonus token). Greedy decoding accepts the child equal to argmax p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftverify.backend.ops import argmax_rows


@dataclass
class Verdict:
    path: list[int]  # accepted nodes (excluding the root), root to leaf
    tokens: list[int]  # their tokens followed by the next token (correction or bonus)

    @property
    def accepted(self) -> int:
        """Number of drafted tokens accepted (excluding the next token)."""
        return len(self.path)


def children_of(parents: list[int], sampled: list[bool] | None = None) -> list[list[int]]:
    """Children of each node, sampled children first, then in index order."""
    kids: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents[1:], start=1):
        kids[parent].append(i)
    if sampled is not None:
        kids = [sorted(k, key=lambda i: not sampled[i]) for k in kids]
    return kids


def verify_tree(
    tokens: torch.Tensor | list[int],  # [n] node tokens; tokens[0] (the root) is not judged
    parents: list[int],  # [n] parent node of each node, parents[0] = -1, parents[i] < i
    p: torch.Tensor,  # [n, V] target distribution after each node (greedy: logits will do)
    q: torch.Tensor | None = None,  # [n, V] draft distribution node i was sampled from (row 0 unused)
    sampled: list[bool] | None = None,  # [n] which nodes were sampled from q; None = all deterministic
    generator: torch.Generator | None = None,
    greedy: bool = True,
) -> Verdict:
    toks = tokens if isinstance(tokens, list) else tokens.tolist()
    if greedy:
        best = argmax_rows(p)  # one host sync for the whole tree
        kids = children_of(parents)
        node, path = 0, []
        while True:
            match = next((c for c in kids[node] if toks[c] == best[node]), None)
            if match is None:
                return Verdict(path, [toks[c] for c in path] + [best[node]])
            path.append(match)
            node = match

    sampled = sampled if sampled is not None else [False] * len(parents)
    kids = children_of(parents, sampled)
    node, path = 0, []
    while True:
        dist = p[node].float()
        for child in kids[node]:
            x = toks[child]
            r = torch.rand((), generator=generator, device=dist.device)
            if sampled[child]:
                qx = q[child, x].float()
                if dist[x] > 0 and r * qx <= dist[x]:  # accept with min(1, p(x)/q(x)); never a token p forbids
                    break
                dist = _normalise((dist - q[child].float()).clamp_min(0), fallback=dist)
            else:
                if r < dist[x]:  # accept with p(x)
                    break
                dist = _normalise(dist.index_fill(0, torch.tensor([x], device=dist.device), 0.0), fallback=dist)
        else:  # no child accepted (or a leaf): draw the next token from what is left
            nxt = int(torch.multinomial(dist, 1, generator=generator).item())
            return Verdict(path, [toks[c] for c in path] + [nxt])
        path.append(child)
        node = child


def _normalise(dist: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = dist.sum()
    return dist / total if total > 0 else fallback


def fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities [..., Vd] -> [..., vocab], the target's vocabulary: zeros for the tokens the
    draft lacks, or a padded draft vocabulary cut to the target's (tokenizers are checked equal)."""
    if q.shape[-1] >= vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


def chain_parents(k: int) -> list[int]:
    """Parents of a chain root -> d1 -> ... -> dk."""
    return [-1] + list(range(k))


def verify_chain(
    root: int,
    draft: torch.Tensor,  # [k] drafted tokens
    p: torch.Tensor,  # [k + 1, V] target distributions after root, d1, ..., dk
    q: torch.Tensor | None = None,  # [k, V] draft distributions d1..dk were sampled from; None = one-hot
    generator: torch.Generator | None = None,
    greedy: bool = True,
) -> Verdict:
    """Speculative decoding / sampling over one chain of drafted tokens."""
    k = draft.shape[0]
    tokens = torch.cat([draft.new_tensor([root]), draft])
    if greedy:
        return verify_tree(tokens, chain_parents(k), p, greedy=True)
    q_nodes = None if q is None else torch.cat([q[:1], q])  # row 0 unused
    sampled = [False] + [q is not None] * k
    return verify_tree(tokens, chain_parents(k), p, q_nodes, sampled, generator, greedy=False)
