"""Trees as data: candidate lists -> the tokens, mask, positions and indices of one forward.

Pure functions, no model. `build_tree` merges candidate continuations of a root token into a
trie (a shared prefix is one set of nodes, so it is scored once). `layout` lays a tree out for
one forward, optionally together with

- a *lead*: tokens the cache has not seen yet that come before the root (a causal chain that
  everything else attends), and
- a lookahead *window* (Fu et al. 2023): L rows of W Jacobi guesses, cell (l, i) sitting
  i + l positions after the root; cell (0, 0) is the root itself. Cell (l, i) attends the
  cells (0, 0..i) of the first row and (1..l, i) of its own column, so each column reads as
  one contiguous guessed sentence and the last row predicts the token after it.

Feeding order: lead, the window's rows 0..L-2, the tree (root first), the window's last row, so
that the logits a method needs (tree nodes and last row) are the last `keep` rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Tree:
    tokens: list[int]  # [n] node tokens; node 0 is the root
    parents: list[int]  # [n] parent node; parents[0] = -1 and parents[i] < i
    depth: list[int]  # [n] distance from the root (its position offset)
    paths: list[list[int]]  # per candidate: the node holding each of its tokens (retrieval indices)

    @property
    def size(self) -> int:
        return len(self.tokens)

    def mask(self) -> torch.Tensor:
        """[n, n] bool: True where node i may attend node j (j is i or one of its ancestors)."""
        return torch.tensor(self.mask_rows(), dtype=torch.bool)

    def mask_rows(self) -> list[list[bool]]:
        """`mask` as lists (a few nodes: lists cost less than a tensor op a row)."""
        rows: list[list[bool]] = []
        for i, parent in enumerate(self.parents):
            row = list(rows[parent]) if i else [False] * self.size  # parents come first: their rows are complete
            row[i] = True
            rows.append(row)
        return rows


def build_tree(root: int, candidates: Sequence[Sequence[int]]) -> Tree:
    """A trie of `candidates` (token lists continuing `root`), nodes numbered in insertion order."""
    tokens, parents, depth = [int(root)], [-1], [0]
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    paths = []
    for cand in candidates:
        node, path = 0, []
        for token in cand:
            key = (node, int(token))
            if key not in child:
                child[key] = len(tokens)
                tokens.append(int(token))
                parents.append(node)
                depth.append(depth[node] + 1)
            node = child[key]
            path.append(node)
        paths.append(path)
    return Tree(tokens, parents, depth, paths)


@dataclass(frozen=True)
class Layout:
    tokens: list[int]  # [m] tokens to feed, in feeding order
    offsets: list[int]  # [m] position of each relative to the root (the lead is negative)
    mask: torch.Tensor  # [m, m] bool, True = may attend
    lead: list[int]  # [len(lead)] flat index of each lead token
    tree: list[int]  # [n] flat index of each tree node: consecutive, the first of the kept rows (`row` 0..n-1)
    window: list[list[int]]  # [L][W] flat index of each window cell; window[0][0] is the root's
    keep: int  # the tree and the window's last row are the last `keep` tokens

    def row(self, flat: int) -> int:
        """Row of the logits returned for `last=keep` that belongs to flat index `flat`."""
        first = len(self.tokens) - self.keep
        assert flat >= first, "asked for the logits of a token outside the kept rows"
        return flat - first


def layout(tree: Tree, rows: Sequence[Sequence[int]] = (), lead: Sequence[int] = ()) -> Layout:
    """Lay out lead + tree + lookahead window `rows` (L rows of W tokens) for one forward.

    `rows[0][0]` stands for the root whatever it holds; all rows must have the same width.
    """
    width = len(rows[0]) if rows else 0
    assert all(len(r) == width for r in rows), "all window rows need the same width"
    levels = len(rows)
    tokens: list[int] = []
    offsets: list[int] = []

    def put(token: int, offset: int) -> int:
        tokens.append(int(token))
        offsets.append(offset)
        return len(tokens) - 1

    lead_index = [put(t, j - len(lead)) for j, t in enumerate(lead)]
    window = [[-1] * width for _ in range(levels)]
    for level in range(levels - 1):
        for i in range(width):
            if (level, i) != (0, 0):
                window[level][i] = put(rows[level][i], i + level)
    tree_index = [put(t, d) for t, d in zip(tree.tokens, tree.depth)]
    if levels:
        window[0][0] = tree_index[0]
        for i in range(width):
            if (levels - 1, i) != (0, 0):
                window[levels - 1][i] = put(rows[levels - 1][i], i + levels - 1)
    keep = len(tokens) - tree_index[0]

    # the mask as bytes, row after row, made one tensor at the end: cheaper than a tensor op a row or a cell
    m, body = len(tokens), len(lead_index)
    flat = bytearray(m * m)
    for r in range(m):  # everything attends the whole lead, which is causal itself
        flat[r * m : r * m + min(r + 1, body)] = b"\1" * min(r + 1, body)
    for a, node_row in zip(tree_index, tree.mask_rows()):
        for b, seen in zip(tree_index, node_row):
            flat[a * m + b] = seen
    for level in range(levels):
        for i in range(width):
            cell = window[level][i]
            if level == 0 and i == 0:
                continue  # the root: a tree node already
            for seen in [window[0][j] for j in range(i + 1)] + [window[r][i] for r in range(1, level + 1)]:
                flat[cell * m + seen] = 1
    mask = torch.frombuffer(flat, dtype=torch.uint8).view(m, m).bool()  # a copy: `flat` may go
    return Layout(tokens, offsets, mask, lead_index, tree_index, window, keep)
