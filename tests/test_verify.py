"""Table-driven cases for the verifier: greedy, rejection sampling, multi-draft, bonus token."""

from __future__ import annotations

import pytest
import torch

from draftverify.verify import children_of, verify_chain, verify_tree

V = 5


def onehot_logits(*best: int) -> torch.Tensor:
    """Logit rows whose argmax is each of `best`."""
    rows = torch.zeros(len(best), V)
    for i, b in enumerate(best):
        rows[i, b] = 5.0
    return rows


@pytest.mark.parametrize(
    "draft, target_best, accepted, tokens",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [1, 0, 3, 4], 1, [1, 0]),  # first mismatch at 2 -> correction
        ([1, 2, 3], [4, 2, 3, 4], 0, [4]),  # nothing accepted
        ([], [2], 0, [2]),  # no draft: a plain decoding step
        (
            [0, 1],
            [0, 1, 2],
            2,
            [0, 1, 2],
        ),  # an EOS id (0) inside the accepted chunk is still returned; emit stops there
    ],
)
def test_greedy_chain(draft, target_best, accepted, tokens):
    v = verify_chain(9, torch.tensor(draft, dtype=torch.long), onehot_logits(*target_best), greedy=True)
    assert v.accepted == accepted and v.tokens == tokens


def test_greedy_tree_picks_matching_branch():
    # root -> {1 (node 1), 2 (node 2)}; node 2 -> 3 (node 3)
    tokens = torch.tensor([9, 1, 2, 3])
    parents = [-1, 0, 0, 2]
    p = onehot_logits(2, 0, 3, 4)  # after root: 2; after node 2: 3; after node 3: 4
    v = verify_tree(tokens, parents, p, greedy=True)
    assert v.path == [2, 3] and v.tokens == [2, 3, 4]


def test_children_sampled_first():
    assert children_of([-1, 0, 0, 0], sampled=[False, False, True, False]) == [[2, 1, 3], [], [], []]


def dist(*probs):
    return torch.tensor(probs, dtype=torch.float)


def test_sampling_certain_accept_and_bonus():
    # p = q = one-hot on the drafted tokens: always accepted, bonus drawn from p[k]
    p = torch.stack([dist(0, 1, 0, 0, 0), dist(0, 0, 1, 0, 0), dist(0, 0, 0, 0, 1)])
    q = p[:2].clone()
    g = torch.Generator().manual_seed(0)
    v = verify_chain(9, torch.tensor([1, 2]), p, q, g, greedy=False)
    assert v.tokens == [1, 2, 4]


def test_sampling_impossible_token_rejected_and_residual_used():
    # target gives the drafted token 1 no mass: reject, resample from norm(max(p - q, 0)) = token 3
    p = torch.stack([dist(0, 0, 0, 1, 0), dist(0.2, 0.2, 0.2, 0.2, 0.2)])
    q = dist(0, 1, 0, 0, 0).unsqueeze(0)
    v = verify_chain(9, torch.tensor([1]), p, q, torch.Generator().manual_seed(0), greedy=False)
    assert v.accepted == 0 and v.tokens == [3]


def test_deterministic_guess_removed_on_rejection():
    # two deterministic guesses (tokens 1 and 2) at the root; p puts no mass on either -> next token from p
    tokens = torch.tensor([9, 1, 2])
    p = torch.stack([dist(0, 0, 0, 0.5, 0.5), dist(*[0.2] * 5), dist(*[0.2] * 5)])
    for seed in range(20):
        v = verify_tree(tokens, [-1, 0, 0], p, generator=torch.Generator().manual_seed(seed), greedy=False)
        assert v.accepted == 0 and v.tokens[0] in (3, 4)
