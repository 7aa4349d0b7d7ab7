"""Drafting a round in one forward: the chain drawn from the rows of one forward, and the tree built
from them (the parallel and DFlash drafters' shared part)."""

import torch

from draftsmith.distill.drafts.one_forward import OneForwardDrafter, tree_from_levels
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.tree import TreeShape

# Row k of one forward: the draft's logits for the token k+1 places on (V = 5), the same for every sequence.
ROWS = torch.tensor(
    [
        [0.0, 3.0, 1.0, 0.0, 0.0],  # argmax 1
        [2.0, 0.0, 0.0, 4.0, 0.0],  # argmax 3
        [0.0, 0.0, 0.0, 0.0, 5.0],  # argmax 4
    ]
)


class Rows(OneForwardDrafter):
    """A drafter whose one forward gives ``ROWS`` for every sequence, counting its forwards."""

    feature_layers = ()

    def __init__(self):
        self.calls: list[tuple[int, list[bool], int]] = []

    def round_logits(self, sequences, reading, width):
        self.calls.append((len(sequences), reading.tolist(), width))
        return ROWS[:width].expand(len(sequences), -1, -1)


def test_a_greedy_chain_takes_each_rows_argmax_from_one_forward():
    drafter = Rows()
    proposal = drafter.propose([[7, 8], [9]], torch.tensor([3, 1]), DecodeOptions(gamma=3), None)
    assert proposal.tokens.tolist() == [[1, 3, 4], [1, 3, 4]]  # the second row's entries after 1 are not proposed
    assert proposal.counts.tolist() == [3, 1]
    assert proposal.steps == 1  # one draft forward, whatever the gamma
    assert drafter.calls == [(2, [True, True], 3)]


def test_no_forward_runs_when_no_sequence_may_draft():
    drafter = Rows()
    proposal = drafter.propose([[7], [9]], torch.tensor([0, 0]), DecodeOptions(gamma=3), None)
    assert proposal.tokens.shape == (2, 0)
    assert proposal.counts.tolist() == [0, 0]
    assert proposal.steps == 0
    assert drafter.calls == []


def test_a_sequence_without_budget_is_not_reading():
    drafter = Rows()
    proposal = drafter.propose([[7], [9]], torch.tensor([0, 2]), DecodeOptions(gamma=2), None)
    assert proposal.counts.tolist() == [0, 2]
    assert drafter.calls == [(2, [False, True], 2)]


def test_a_tree_level_holds_the_top_k_of_its_row_below_every_parent():
    logprobs = torch.tensor([[0.0, -1.0, -3.0, -2.0], [-2.0, -4.0, 0.0, -1.0]])  # (D=2, V=4)
    tree = tree_from_levels(logprobs, TreeShape((2, 2)))
    assert tree.tokens == [0, 1, 2, 3, 2, 3]
    assert tree.parents == [-1, -1, 0, 0, 1, 1]
    assert tree.path_logprob == [0.0, -1.0, 0.0, -1.0, -1.0, -2.0]


def test_a_proposed_tree_is_one_forward_deep_at_most_max_depth():
    drafter = Rows()
    tree = drafter.propose_tree([7, 8], TreeShape((1, 2, 1)), max_depth=2)
    assert drafter.calls == [(1, [True], 2)]
    assert tree.steps == 1
    assert tree.tokens == [1, 3, 0]  # level 1: row 0's argmax; level 2: row 1's top two below it
    assert tree.parents == [-1, 0, 0]
    assert drafter.propose_tree([7], TreeShape((1,)), max_depth=0).tokens == []
    assert len(drafter.calls) == 1  # an empty tree runs no forward
