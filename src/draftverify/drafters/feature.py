"""Drafting with a feature head (`feature_head.FeatureHead`): EAGLE-2's dynamic draft tree.

The head reads the target's own final hidden states, which the target's verification forward
returns anyway (`Proposal.hidden`), so drafting costs only the head's small forwards. Each round:

1. the head catches up on the positions the target accepted last round (true features, one
   forward of those rows into its KV cache; at most the latest `CATCH_UP` of them, so a long
   prompt costs little) and predicts the feature at the root;
2. expansion (EAGLE-2, Li et al. 2024): the children of a node are the head's `width` most
   likely tokens, each valued by the chance that the target accepts the whole path: the product
   along it of each token's *calibrated* draft probability (below); up to `depth - 1` times, the
   `width` most valuable nodes of the newest level are fed to the head together, in one
   tree-masked forward of its own (expansion stops early once even the best new node's best
   child, guessed as worth that node's value times its own calibrated chance, would save less, in
   expected accepted tokens times a target forward, than the measured time of one more expansion
   plus the time its row adds to the verification: the row after those of the nodes worth at least
   as much, read off the cost curve, on which the rows are not equally cheap (pricing every node at
   the cheapest row's cost grows nodes that the tree then leaves out);
3. reranking: of all nodes, the n most valuable form the tree (a child is never worth more than
   its parent, so they form a tree), n chosen from the target's measured cost curve: the n with
   the most expected tokens per second, (1 + sum of the n values) / t_target(n + 1) (or a fixed
   `nodes`; 0 = by the curve).

Calibration. EAGLE-2 takes the draft's probability of a token as its chance of acceptance. A
head trained to match the target's whole distribution is underconfident for greedy decoding,
which accepts the target's argmax however flat the distribution (top guesses are accepted far
more often than their probability says), and a raw probability then says no tree pays. So
every round is scored: each node the head valued (kept
in the tree or not) whose parent lies on the emitted tokens counts, in the bin of the head's
probability for it, as right if it is the emitted token that follows its parent, or wrong. The
emitted tokens are the target's (greedy: its argmax; sampling: distributed as its distribution,
so a token's chance of being emitted is its chance of being accepted), so nodes that were never
verified are scored as truly as verified ones. Scoring only the verified nodes would let a bin
that starts unlucky stay shut: its nodes would not be drafted again, so never scored again. A
node's chance is its bin's rate (starting from the probability itself, 4 rounds' worth). The
counts are kept per head and sampling setting in the engine's `models.Shared` (`acceptance`).

With a `policy` (SpecDec++ over the head, `methods.specdec_pp`) the head drafts one chain of its most likely
tokens instead, and the policy alone says when to stop: after each draft it is handed the feature that produced
it (`AcceptanceHeadPolicy.judge`).

The candidates are deterministic guesses (no q): greedy decoding accepts the child that equals
the target's argmax, sampled decoding verifies them by multi-draft rejection sampling
(`verify.verify_tree`), so both stay exact. `width = 1` drafts a chain.
"""

from __future__ import annotations

import bisect
import time

import torch

from draftverify.costs import at_context, curve, marginal_times
from draftverify.drafters.acceptance_head import AcceptanceHeadPolicy
from draftverify.drafters.base import Drafter, Proposal, Step
from draftverify.feature_head import FeatureHead
from draftverify.feature_head_cache import HeadCache
from draftverify.models import Runner
from draftverify.session import Session

TREE_WIDTHS = (1, 2, 4, 8, 16, 32)
# Children per expanded node and nodes expanded per level, unless told otherwise: two, chosen on the development
# prompts in q8 (docs/make-draft.md): a wider level feeds the head more rows a forward and finds few nodes worth a
# verified row where rows are not nearly free.
WIDTH = 2
# FR-Spec: draft from the head's most frequent tokens (a prefix of its vocabulary) unless told otherwise: a drafting
# forward that reads fewer LM-head rows, at about the same acceptance (`speculative[vocab=0]`: all of them).
DRAFT_VOCAB = 4096
# The most positions one catch-up feeds the head: the head attends over what it was fed, and the target's features
# it reads already carry the whole context, so a long prompt is fed only its last positions (a choice, not tuned).
# `auto`'s head feeds fewer (`methods.auto.HEAD_CATCH_UP`): it sits out rounds and comes back often.
CATCH_UP = 128
BINS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8)  # upper edges of the draft-probability bins (the last runs to 1)


class Acceptance:
    """How often the head's token is the target's after a parent on the target's path, by bin of the head's
    probability for it."""

    def __init__(self, prior: float = 4.0, memory: float = 400.0):
        edges = (0.0, *BINS, 1.0)
        self.hits = [prior * (lo + hi) / 2 for lo, hi in zip(edges, edges[1:])]  # the probability itself, at first
        self.trials = [prior] * len(self.hits)
        self.memory = memory  # a bin's older rounds fade once it has this many

    def __call__(self, p: float) -> float:
        b = bisect.bisect_left(BINS, p)
        return self.hits[b] / self.trials[b]

    def record(self, p: float, accepted: bool) -> None:
        b = bisect.bisect_left(BINS, p)
        keep = min(1.0, self.memory / (self.trials[b] + 1))
        self.hits[b] = keep * self.hits[b] + accepted
        self.trials[b] = keep * self.trials[b] + 1


def acceptance(head: FeatureHead, target: Runner, s: Session) -> Acceptance:
    """The head's calibration for this request's sampling setting, kept in the target runner's `Shared` (its
    engine's: requests of one engine learn from each other, another engine keeps its own)."""
    key = (s.sampling.greedy, s.sampling.temperature, s.sampling.top_k, s.sampling.top_p)
    return target.shared.calibration.setdefault(head, {}).setdefault(key, Acceptance())


class FeatureHeadDrafter(Drafter):
    needs_hidden = True
    label = "feature-head"

    def __init__(
        self,
        head: FeatureHead,
        target: Runner,
        depth: int = 6,
        width: int = WIDTH,
        nodes: int = 0,
        max_nodes: int = 48,
        vocab: int = DRAFT_VOCAB,
        policy: AcceptanceHeadPolicy | None = None,
        catch_up: int | None = None,
    ):
        self.policy = policy  # SpecDec++'s stopping rule: a chain instead of a tree (the module docstring)
        self.catch_up = catch_up or CATCH_UP  # the most positions one catch-up feeds
        self.head, self.depth, self.width, self.nodes, self.max_nodes = head.pack(), depth, width, nodes, max_nodes
        self.target = target
        # FR-Spec: the head's vocabulary is most frequent first, so a prefix is a smaller head (0: all)
        self.vocab = head.vocab[: vocab or head.vocab.numel()]
        self.expand_s = 0.0  # seconds one expansion step takes (a running mean)
        # the target's cost curve, which the tree's size reads; a chain's length is the policy's alone
        self.costs = curve(target, widths=TREE_WIDTHS) if policy is None else None
        self.device, self.dtype = head.fc.weight.device, head.fc.weight.dtype
        self.cache: HeadCache | None = None
        self.pending: list[tuple[torch.Tensor, list[int], int]] = []  # rounds not fed: features, tokens, position
        self.valued: dict[tuple[int, ...], list[tuple[int, float]]] = {}  # parent's path -> (token, head's prob.)
        self.expected = 0.0  # this round's tree: the tokens the target is expected to accept (its nodes' values)
        self.calibration: Acceptance | None = None

    def start(self, s: Session, seq: list[int], hidden: torch.Tensor | None = None) -> None:
        self.cache = HeadCache(self.head, capacity=min(len(seq), self.catch_up) + 64)
        self.calibration = acceptance(self.head, self.target, s)
        self.pending = [(hidden, seq[1:], 0)]  # prompt position t holds f_t and token t + 1 (the last is the root)

    def propose(self, s: Session, seq: list[int], room: int) -> Proposal:
        first = self.pending[0][2]  # the pending rounds follow one another (`observe`)
        features = self.pending[0][0] if len(self.pending) == 1 else torch.cat([f for f, _, _ in self.pending])
        ids = [t for _, tokens, _ in self.pending for t in tokens]
        self.pending = []
        if len(ids) > self.catch_up:  # a long prompt, or many rounds sat out: only the latest positions (CATCH_UP)
            first += len(ids) - self.catch_up
            features, ids = features[-self.catch_up :], ids[-self.catch_up :]
        ids = torch.tensor(ids, device=self.device)
        out = self.cache.forward(features.to(self.dtype), ids, range(first, first + len(ids)))
        s.stats.draft_forwards += 1
        committed = self.cache.length
        self.expected = 0.0
        grow = self.expand if self.policy is None else self.chain
        paths = grow(s, out[-1], len(seq) - 1, min(room, self.depth)) if room > 0 else []
        self.cache.crop(committed)
        return Proposal(paths, hidden=True, expected=self.expected)

    @torch.inference_mode()
    def expand(self, s: Session, root_feature: torch.Tensor, root: int, depth: int) -> list[list[int]]:
        """Candidate paths after the root (at position `root`), EAGLE-2 style; see the module docstring."""
        cache = self.cache
        costs = at_context(self.costs, root + 1)  # the verifying forward reads this many cached tokens
        k = min(self.width, self.vocab.numel())
        committed = cache.length
        tokens: list[int] = []  # per draft node (the root excluded)
        parents: list[int] = []  # -1: the root
        values: list[float] = []  # the chance the target accepts the path: calibrated draft probabilities, multiplied
        local: list[float] = []  # the head's probability for the node's token after its parent
        paths: list[tuple[int, ...]] = []  # the tokens from the root's first child to the node
        slot: dict[int, int] = {}  # node -> its entry in the head cache, once fed
        feature = {-1: root_feature}  # node -> the head's predicted feature after it, once fed

        def children(out: torch.Tensor, nodes: list[int]) -> list[int]:
            """Add the k best children of each fed node (its row of `out` [m, H]); return the new nodes."""
            new = []
            for node, row_tokens, row_probs in zip(nodes, *self.head.top(out, self.vocab.numel(), k)):
                above, path = (values[node], paths[node]) if node >= 0 else (1.0, ())
                guesses = self.valued.setdefault(path, [])
                for token, p in zip(row_tokens, row_probs):
                    tokens.append(token)
                    parents.append(node)
                    local.append(p)
                    paths.append(path + (token,))
                    guesses.append((token, p))
                    values.append(above * self.calibration(p))
                    new.append(len(tokens) - 1)
            return new

        most = min(self.max_nodes, k + (depth - 1) * k * k)  # the nodes this round can make at most
        times = marginal_times(costs, most + 1, s.others)  # t(w) for a forward of w rows (in a batch: added)
        step = times[0]  # what an accepted token saves: a target forward
        level = children(root_feature[None], [-1])
        for d in range(1, depth):
            chosen = sorted(level, key=lambda i: -values[i])[:k]
            best = chosen[0]  # its best child's worth, guessed: its own value times its own calibrated chance
            guess = values[best] * self.calibration(local[best])
            ahead = min(sum(v >= guess for v in values), len(times) - 2)  # nodes kept before it: it is row ahead + 2
            if guess * step < self.expand_s + times[ahead + 1] - times[ahead]:
                break  # even that child would not pay for the head forward that grows it and its verification
            t0 = time.perf_counter()
            base = cache.length
            slot.update({node: base + j for j, node in enumerate(chosen)})
            out = cache.forward(
                torch.stack([feature[parents[n]] for n in chosen]),
                torch.tensor([tokens[n] for n in chosen], device=self.device),
                [root + d - 1] * len(chosen),  # a depth-d node is read at root + d - 1
                torch.tensor(_level_mask(chosen, parents, slot, base - committed, committed), device=self.device),
            )
            s.stats.draft_forwards += 1
            feature.update({node: out[j] for j, node in enumerate(chosen)})
            level = children(out, chosen)
            self.expand_s = 0.8 * self.expand_s + 0.2 * (time.perf_counter() - t0)
        keep = self.best_nodes(parents, values, times)
        self.expected = sum(values[n] for n in keep)
        leaves = [n for n in keep if not any(parents[c] == n for c in keep)]
        return [list(paths[leaf]) for leaf in sorted(leaves, key=lambda n: -values[n])]

    @torch.inference_mode()
    def chain(self, s: Session, feature: torch.Tensor, root: int, depth: int) -> list[list[int]]:
        """One chain after the root: each draft the head's most likely token, drafted on until the policy says stop
        (or `depth`); the policy reads the feature that produced each draft."""
        drafts: list[int] = []
        for n in range(1, depth + 1):
            tokens, probs = self.head.top(feature[None], self.vocab.numel(), 1)
            token, p = tokens[0][0], probs[0][0]
            self.valued.setdefault(tuple(drafts), []).append((token, p))  # scored for the calibration as the tree's
            drafts.append(token)
            if n == depth or not self.policy.judge(n, feature):
                break
            feature = self.cache.forward(feature[None], torch.tensor([token], device=self.device), [root + n - 1])[0]
            s.stats.draft_forwards += 1
        return [drafts]

    def best_nodes(self, parents: list[int], values: list[float], times: list[float]) -> set[int]:
        """The n most valuable nodes (a tree), n the most expected tokens per second of the target or `nodes`;
        `times[w - 1]`: the seconds a forward of w rows takes (at this context; in a batch, the time the rows
        add to a forward that carries the other requests' rows)."""
        order = sorted(range(len(values)), key=lambda i: -values[i])[: self.nodes or self.max_nodes]
        gain, best, best_rate = 1.0, 0, 1.0 / times[0]
        for n, node in enumerate(order if not self.nodes else [], start=1):
            gain += values[node]
            rate = gain / times[n]
            if rate > best_rate:
                best, best_rate = n, rate
        keep = set(order[: self.nodes or best])
        return {n for n in keep if all(a in keep for a in _ancestors(n, parents))}

    def observe(self, s: Session, seq: list[int], proposal: Proposal, step: Step) -> None:
        """Queue the round's true features (the root's position and the accepted nodes'), whoever drafted it: a
        round the head sat out (`auto` chose another drafter) is fed with the next one it drafts. Score the nodes
        the head valued for the calibration: each whose parent lies on the emitted tokens, right or wrong."""
        self.pending.append((step.hidden, step.tokens, len(seq) - 1))
        emitted = tuple(step.tokens)
        for d, token in enumerate(emitted):  # the children of each emitted prefix (the root's first)
            for guess, p in self.valued.get(emitted[:d], ()):
                self.calibration.record(p, guess == token)
        self.valued = {}

    def finish(self, s: Session) -> None:
        self.cache, self.pending = None, []


def _level_mask(chosen: list[int], parents: list[int], slot: dict[int, int], before: int, committed: int) -> list:
    """[len(chosen), before + len(chosen)] bool rows over the head cache's draft entries: each chosen node sees
    its ancestors' entries and its own (`before` draft entries precede this level's)."""
    rows = [[False] * (before + len(chosen)) for _ in chosen]
    for j, node in enumerate(chosen):
        for a in [node, *_ancestors(node, parents)]:
            rows[j][slot[a] - committed] = True
    return rows


def _ancestors(node: int, parents: list[int]) -> list[int]:
    out = []
    while parents[node] != -1:
        node = parents[node]
        out.append(node)
    return out
