"""Trees as data: the trie of candidates, and the layout (tokens, positions, mask, indices) of
lead + tree + lookahead window, checked by hand on small cases and against chain forwards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftverify.models import Runner
from draftverify.tree import build_tree, layout

R = 99  # the root token


def as_lists(mask: torch.Tensor) -> list[list[int]]:
    return mask.int().tolist()


def test_trie_by_hand():
    tree = build_tree(R, [[1, 2], [1, 3], [4], [1, 2]])
    assert tree.tokens == [R, 1, 2, 3, 4]
    assert tree.parents == [-1, 0, 1, 1, 0]
    assert tree.depth == [0, 1, 2, 2, 1]
    assert tree.paths == [[1, 2], [1, 3], [4], [1, 2]]  # the duplicate candidate shares nodes
    assert as_lists(tree.mask()) == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 0, 0, 0, 1],
    ]


def test_draft_plus_suffixes_share_the_draft():
    # Ouroboros: draft [5, 6] lengthened by suffixes [7, 8] and [7, 9]: one chain, then a fork
    tree = build_tree(R, [[5, 6, 7, 8], [5, 6, 7, 9]])
    assert tree.tokens == [R, 5, 6, 7, 8, 9]
    assert tree.parents == [-1, 0, 1, 2, 3, 3]
    assert tree.paths[1][2:] == [3, 5]  # retrieval indices of the second suffix


def test_empty_candidates():
    tree = build_tree(R, [])
    assert tree.tokens == [R] and tree.paths == [] and as_lists(tree.mask()) == [[1]]
    assert build_tree(R, [[]]).paths == [[]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=6))
def test_trie_properties(candidates):
    tree = build_tree(R, candidates)
    mask = tree.mask()
    prefixes = {tuple(c[:j]) for c in candidates for j in range(1, len(c) + 1)}
    assert tree.size == 1 + len(prefixes)  # one node per distinct prefix
    for cand, path in zip(candidates, tree.paths):
        assert [tree.tokens[node] for node in path] == cand
        assert [tree.depth[node] for node in path] == list(range(1, len(cand) + 1))
        assert all(tree.parents[b] == a for a, b in zip([0] + path, path))
    for i in range(1, tree.size):
        assert tree.parents[i] < i and tree.depth[i] == tree.depth[tree.parents[i]] + 1
        ancestors, j = {i}, i
        while j > 0:
            j = tree.parents[j]
            ancestors.add(j)
        assert {j for j in range(tree.size) if mask[i, j]} == ancestors


def test_layout_with_lead_and_window_by_hand():
    tree = build_tree(R, [[1]])
    rows = [[0, 20, 21], [22, 23, 24]]  # rows[0][0] stands for the root
    lay = layout(tree, rows, lead=[30, 31])
    # order: lead, window row 0 (without the root), tree, window last row
    assert lay.tokens == [30, 31, 20, 21, R, 1, 22, 23, 24]
    assert lay.offsets == [-2, -1, 1, 2, 0, 1, 1, 2, 3]
    assert lay.lead == [0, 1] and lay.tree == [4, 5]
    assert lay.window == [[4, 2, 3], [6, 7, 8]]
    assert lay.keep == 5 and lay.row(4) == 0 and lay.row(8) == 4
    assert as_lists(lay.mask) == [
        # 30 31 20 21  R  1 22 23 24
        [1, 0, 0, 0, 0, 0, 0, 0, 0],  # lead 30
        [1, 1, 0, 0, 0, 0, 0, 0, 0],  # lead 31
        [1, 1, 1, 0, 1, 0, 0, 0, 0],  # (0,1): root, itself
        [1, 1, 1, 1, 1, 0, 0, 0, 0],  # (0,2): root, (0,1), itself
        [1, 1, 0, 0, 1, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 1, 1, 0, 0, 0],  # tree node 1
        [1, 1, 0, 0, 1, 0, 1, 0, 0],  # (1,0): root, itself
        [1, 1, 1, 0, 1, 0, 0, 1, 0],  # (1,1): root, (0,1), itself
        [1, 1, 1, 1, 1, 0, 0, 0, 1],  # (1,2): root, (0,1), (0,2), itself
    ]


def test_layout_single_row_window():
    lay = layout(build_tree(R, []), [[0, 7, 8]])
    assert lay.tokens == [R, 7, 8] and lay.offsets == [0, 1, 2] and lay.window == [[0, 1, 2]]
    assert lay.keep == 3 and as_lists(lay.mask) == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary and learned absolute positions
def test_layout_forward_equals_chains(tiny, arch):
    model = tiny(arch).model
    prefix, lead = [5, 6, 7, 8], [30, 31]
    tree = build_tree(R % 90, [[10, 11], [10, 12], [13]])
    root = tree.tokens[0]
    rows = [[0, 20, 21], [22, 23, 24], [25, 26, 27]]
    lay = layout(tree, rows, lead)
    run = Runner(model)
    run.forward(prefix)
    out = run.forward(
        lay.tokens, positions=torch.tensor(lay.offsets) + len(prefix) + len(lead), tree_mask=lay.mask, last=lay.keep
    ).logits

    def chain_logits(tokens):
        ref = Runner(model)
        ref.forward(prefix + lead)
        return ref.forward(tokens).logits

    for cand, path in zip([[10, 11], [10, 12], [13]], tree.paths):
        got = out[[lay.row(lay.tree[node]) for node in [0] + path]]
        torch.testing.assert_close(got, chain_logits([root] + cand), atol=1e-4, rtol=1e-4)
    for i in range(3):  # each window column reads as one sentence: root, row 0 up to i, then down column i
        column = [root] + rows[0][1 : i + 1] + [rows[1][i], rows[2][i]]
        torch.testing.assert_close(out[lay.row(lay.window[2][i])], chain_logits(column)[-1], atol=1e-4, rtol=1e-4)
