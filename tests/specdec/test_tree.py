"""Token trees: the mask each verification input sees, and exact acceptance over siblings."""

import pytest
import torch

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.tree import (
    ROOT,
    TreeShape,
    accept_tree_greedy,
    accept_tree_sampled,
    ancestor_matrix,
    depths,
    reindex,
    top_nodes,
)
from tests.helpers import chi_square_z

# root -> a(0), b(1); a -> c(2), d(3); c -> e(4)
PARENTS = [ROOT, ROOT, 0, 0, 2]


def test_each_input_sees_the_root_its_ancestors_and_itself():
    visible = ancestor_matrix(PARENTS).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0],  # x_n
        [1, 1, 0, 0, 0, 0],  # a
        [1, 0, 1, 0, 0, 0],  # b
        [1, 1, 0, 1, 0, 0],  # c (below a)
        [1, 1, 0, 0, 1, 0],  # d (below a)
        [1, 1, 0, 1, 0, 1],  # e (below c)
    ]
    assert depths(PARENTS) == [1, 1, 2, 2, 3]


def _logits_choosing(choices: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return logits


def test_greedy_follows_the_matching_child_and_corrects_below_it():
    tokens = [3, 4, 5, 6, 7]  # a=3 b=4 c=5 d=6 e=7
    # the target wants 3 after x_n (a), then 6 after a (d), then 2 after d (no child: correction)
    logits = _logits_choosing([3, 6, 0, 0, 2, 0])
    assert accept_tree_greedy(tokens, PARENTS, logits) == ([0, 3], 2)


def test_greedy_bonus_after_a_fully_accepted_leaf():
    tokens = [3, 4, 5, 6, 7]
    logits = _logits_choosing([3, 5, 0, 7, 0, 1])  # a, c, e accepted; after e the target says 1
    assert accept_tree_greedy(tokens, PARENTS, logits) == ([0, 2, 4], 1)


def test_greedy_accepts_nothing_when_no_root_child_matches():
    logits = _logits_choosing([2, 0, 0, 0, 0, 0])
    assert accept_tree_greedy([3, 4, 5, 6, 7], PARENTS, logits) == ([], 2)


def _emitted_pairs(tokens, parents, probs, n, renormalize=True):
    """Counts of the first emitted token, and of the second given that the first was node 0's token."""
    gen = torch.Generator().manual_seed(0)
    vocab = probs.shape[-1]
    first = torch.zeros(vocab)
    second_after_a = torch.zeros(vocab)
    for _ in range(n):
        path, nxt = accept_tree_sampled(tokens, parents, probs, gen, renormalize=renormalize)
        emitted = [tokens[i] for i in path] + [nxt]
        first[emitted[0]] += 1
        if path[:1] == [0]:
            second_after_a[emitted[1]] += 1
    return first, second_after_a


@pytest.fixture
def tree_probs():
    gen = torch.Generator().manual_seed(3)
    vocab = 6
    probs = torch.softmax(torch.randn(len(PARENTS) + 1, vocab, generator=gen) * 1.5, -1)
    tokens = [2, 0, 1, 5, 4]  # a=2, b=0 below the root; c=1, d=5 below a; e=4 below c
    return tokens, probs


def test_sampled_tree_output_is_distributed_as_the_target(tree_probs):
    tokens, probs = tree_probs
    first, second = _emitted_pairs(tokens, PARENTS, probs, 20000)
    assert chi_square_z(first, probs[0]) < 4
    # after a (node 0, input 1) the next token follows the target's distribution after a
    assert second.sum() > 500
    assert chi_square_z(second, probs[1]) < 4


def test_siblings_tested_without_renormalizing_fail_the_same_fit(tree_probs):
    tokens, probs = tree_probs
    first, _ = _emitted_pairs(tokens, PARENTS, probs, 20000, renormalize=False)
    assert chi_square_z(first, probs[0]) > 10


def test_a_candidate_the_target_gives_probability_zero_is_never_accepted():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        path, nxt = accept_tree_sampled([0, 3], [ROOT, ROOT], probs, gen)
        assert path == [] and nxt in (1, 2)


def test_dynamic_tree_keeps_the_likeliest_paths_closed_under_ancestors():
    parents = [ROOT, ROOT, 0, 0, 1, 2]
    logprob = [-0.1, -2.0, -0.3, -3.0, -2.5, -0.4]
    keep = top_nodes(parents, logprob, 3)
    assert keep == [0, 2, 5]
    assert reindex(parents, keep) == [ROOT, 0, 1]
    # a tie at the cut pulls in the ancestor it needs
    assert top_nodes(parents, [-0.1, -0.2, -0.3, -9, -0.2, -9], 2) == [0, 1]


def test_tree_shape_parsing_and_errors():
    assert TreeShape.parse("3,2,1,1") == TreeShape((3, 2, 1, 1))
    assert TreeShape.parse("3,2,1,1").max_nodes == 3 + 6 + 6 + 6
    assert TreeShape.parse("4,2:10") == TreeShape((4, 2), budget=10)
    assert TreeShape.parse("4,2:10").max_nodes == 10
    with pytest.raises(DraftsmithError, match="branching per depth"):
        TreeShape.parse("3,x")
    with pytest.raises(DraftsmithError, match=">= 1"):
        TreeShape.parse("3,0")
