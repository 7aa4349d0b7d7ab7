"""Drafting a whole round in ONE draft forward: what the parallel (PARD) and DFlash drafters share.

Their draft gives, from one forward, a distribution for each of the next positions: q_1 for the
token after a sequence's last, q_k for the token k places on, without the tokens in between
(PARD's masks, DFlash's block). A chain round draws its tokens from q_1 .. q_gamma in order
(``specdec.drafters.draft_chain``: the argmax, or a sample from the processed q_k, which the
acceptance rule gets), so the output is the target's exactly. A token tree's level k is the top of
q_k below every node of level k-1 (``tree_from_levels``): a node's candidates do not depend on its
parent, so tree acceptance stays exact, and no node is ever fed back to the draft.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Generator

from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.proposal import Proposal, draft_chain, stack_proposal
from draftsmith.specdec.tree import ROOT, TreeShape, reindex, top_nodes
from draftsmith.specdec.tree_drafting import Tree


@dataclass
class OneForwardProposal(Proposal):
    """A ``Proposal`` whose tokens all came from ``forwards`` draft forwards (1; 0 when none was drafted)."""

    forwards: int = 1

    @classmethod
    def of(cls, proposal: Proposal, forwards: int = 1) -> OneForwardProposal:
        """``proposal`` (every field it has) as the work of ``forwards`` draft forwards."""
        return cls(**{f.name: getattr(proposal, f.name) for f in fields(Proposal)}, forwards=forwards)

    @property
    def steps(self) -> int:
        return self.forwards


def tree_from_levels(logprobs: torch.Tensor, shape: TreeShape) -> Tree:
    """The token tree whose level d holds the top ``shape.branching[d]`` tokens of row d of
    ``logprobs`` (D, V) below every node of level d-1 (or, for a dynamic shape, below the
    ``shape.expand`` likeliest of them, keeping the ``shape.budget`` likeliest nodes overall)."""
    tree = Tree()
    frontier = [ROOT]
    for depth in range(logprobs.shape[0]):
        top = logprobs[depth].topk(shape.branching[depth])
        level = []
        for parent in frontier:
            above = 0.0 if parent == ROOT else tree.path_logprob[parent]
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                tree.tokens.append(token)
                tree.parents.append(parent)
                tree.path_logprob.append(above + logprob)
                level.append(len(tree.tokens) - 1)
        frontier = level
        if shape.budget:  # EAGLE-2: grow only below the likeliest frontier nodes
            frontier = sorted(sorted(level, key=lambda i: -tree.path_logprob[i])[: shape.expand])
    if shape.budget:
        keep = top_nodes(tree.parents, tree.path_logprob, shape.budget)
        tree.parents = reindex(tree.parents, keep)
        tree.tokens = [tree.tokens[i] for i in keep]
        tree.path_logprob = [tree.path_logprob[i] for i in keep]
    return tree


class OneForwardDrafter:
    """A drafter (``specdec.drafters.Drafter``) that drafts a round in one forward: a subclass writes
    ``round_logits`` (and its cache's ``prefill``, ``observe``, ``rollback`` and ``select``)."""

    takes_guesses = True  # rounds may verify lookup guesses: it takes the committed rows as they come

    def round_logits(self, sequences: list[list[int]], reading: torch.Tensor, width: int) -> torch.Tensor:
        """ONE draft forward after each sequence's committed tokens: logits (B, width, V), row k the
        draft's distribution for the token k+1 places after the last. reading (B,) bool: the sequences
        that draft this round (the others may be left out of the forward)."""
        raise NotImplementedError(f"{type(self).__name__} does not draft")

    def propose(
        self, sequences: list[list[int]], budget: torch.Tensor, options: DecodeOptions, generator: Generator | None
    ) -> OneForwardProposal:
        """Up to ``budget[b]`` tokens per sequence from one draft forward: token k drawn from q_k (its
        argmax when drafting greedily). With a confidence threshold a chain stops after its first
        token whose ``max q_k`` is below it (dynamic gamma)."""
        width = int(budget.max())
        if width == 0:  # no sequence may draft (each can emit only the target's next token)
            return OneForwardProposal.of(stack_proposal([], [], torch.zeros_like(budget)), forwards=0)
        rows = iter(self.round_logits(sequences, budget > 0, width).unbind(1))  # (B, V) each: q_1 .. q_width
        proposal = draft_chain(lambda token, active: next(rows), budget, options, generator)
        return OneForwardProposal.of(proposal)

    def propose_tree(self, sequence: list[int], shape: TreeShape, max_depth: int) -> Tree:
        """A tree of at most ``max_depth`` levels from one forward (``tree_from_levels``)."""
        if max_depth < 1:
            return Tree()
        logits = self.round_logits([sequence], torch.tensor([True]), max_depth)[0]  # (D, V)
        tree = tree_from_levels(logits.float().log_softmax(-1), shape)
        tree.steps = 1
        return tree

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        """Nothing: no node was fed to the draft (the accepted path is committed text like any other)."""
