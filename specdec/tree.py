"""Token trees: several candidate continuations verified in one target forward, output still exact.

A tree hangs below the last committed token ``x_n`` (the root). Its nodes are draft tokens, kept in
topological order (a parent before its children) with siblings ordered by the draft's preference.
``parents[i]`` is the index of node i's parent, or ``ROOT`` (-1) for a child of ``x_n``.

Verification feeds ``[x_n, node_0, .., node_{N-1}]`` to the target in one forward; each input sees
the context and its own ancestors only (``ancestor_matrix``), at position ``depth`` after ``x_n``, so
input ``1 + i`` gets exactly the logits a one-token step along node i's path would get. Row 0 of
the target's output is the distribution after ``x_n``; row ``1 + i`` the one after node i.

Acceptance walks down from the root:

- greedy: move to the child whose token is the target's argmax; when no child matches, emit the
  argmax (the correction, or the bonus below a leaf);
- sampling (SpecInfer, Miao et al. 2024; multi-draft speculative sampling, Chen et al. 2024): the
  candidates of a node are chosen by the draft deterministically (its most likely tokens), so each
  sibling is a draft "distribution" that is one-hot at its token. Sibling ``c_k`` is accepted with
  probability ``p_k(c_k)``; after a rejection the target distribution becomes the residual
  ``p_{k+1} = normalize(max(0, p_k - onehot(c_k)))`` = ``p_k`` with ``c_k`` removed and
  renormalized. When every sibling is rejected one token is drawn from the last residual. For any
  token x this gives exactly ``p(x)``: it is sampling from ``p`` by asking "is it c_1? if not, is it
  c_2? ..." with each question answered by the conditional probability. Skipping the
  renormalization (testing ``c_2`` against the original ``p``) breaks it, which the tests show.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.specdec.errors import DraftsmithError

ROOT = -1


@dataclass(frozen=True)
class TreeShape:
    """How a round's tree is drafted.

    ``branching``: fixed shape, the number of children of every node at each depth (``(3, 2, 1, 1)``:
    3 children of the root, 2 of each of those, ...). ``budget``: dynamic shape (EAGLE-2, Li et al.
    2024): expand ``branching[d]`` children per frontier node as above, but only for the
    ``expand`` frontier nodes with the highest path probability, then keep the ``budget`` nodes with
    the highest path probability overall. ``budget = 0`` keeps the fixed shape.
    """

    branching: tuple[int, ...]
    budget: int = 0
    expand: int = 4

    def __post_init__(self) -> None:
        if not self.branching or any(b < 1 for b in self.branching):
            raise DraftsmithError(f"tree branching must be a list of counts >= 1, got {list(self.branching)}")
        if self.budget < 0 or self.expand < 1:
            raise DraftsmithError(f"tree budget must be >= 0 and expand >= 1, got {self.budget}, {self.expand}")

    @classmethod
    def parse(cls, text: str, option: str = "--tree") -> TreeShape:
        """``"3,2,1,1"`` (fixed) or ``"3,2,1,1:16"`` (dynamic, at most 16 nodes); errors name ``option``."""
        shape, dynamic, budget = text.partition(":")
        try:
            branching, size = tuple(int(b) for b in shape.split(",")), int(budget) if budget else 0
        except ValueError as err:
            raise DraftsmithError(
                f"{option} takes branching per depth, e.g. 3,2,1,1, optionally :BUDGET for a dynamic tree; got {text!r}"
            ) from err
        try:
            nodes = cls(branching).max_nodes
        except DraftsmithError as err:  # a count below 1: said with the option and the value given
            raise DraftsmithError(f"{option} {text}: {err}, e.g. 3,2,1,1") from err
        if dynamic and not 1 <= size < nodes:
            # 0 would keep no node, and a budget of the whole shape or more is the fixed tree.
            raise DraftsmithError(
                f"{option} {text}: a dynamic tree's budget must be 1 to {nodes - 1} (the shape {shape} has {nodes} "
                f"nodes); for the fixed tree leave out :{budget}"
            )
        return cls(branching, size)

    @property
    def text(self) -> str:
        """The shape as ``parse`` reads it: ``"3,2,1,1"`` or ``"3,2,2,1:12"``."""
        branching = ",".join(map(str, self.branching))
        return f"{branching}:{self.budget}" if self.budget else branching

    @property
    def depth(self) -> int:
        return len(self.branching)

    @property
    def max_nodes(self) -> int:
        """Nodes of the fixed shape (an upper bound for the dynamic one)."""
        total, width = 0, 1
        for b in self.branching:
            width *= b
            total += width
        return total if not self.budget else min(total, self.budget)


def depths(parents: list[int]) -> list[int]:
    """Depth of every node (a child of the root has depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent == ROOT else out[parent] + 1)
    return out


def children(parents: list[int], node: int) -> list[int]:
    """The children of ``node`` (``ROOT`` for the root's), in sibling order."""
    return [i for i, parent in enumerate(parents) if parent == node]


def ancestor_matrix(parents: list[int], device: torch.device | None = None) -> torch.Tensor:
    """(N+1, N+1) bool: entry [i, j] is True when verification input j is input i or one of its ancestors.

    Input 0 is the root ``x_n``, input ``1 + k`` is node k; the root is everyone's ancestor.
    """
    n = len(parents)
    visible = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    visible[:, 0] = True
    visible[0, 0] = True
    for node, parent in enumerate(parents):
        row = 1 + node
        if parent != ROOT:
            visible[row] = visible[1 + parent]
        visible[row, row] = True
    return visible.to(device) if device is not None else visible


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root's child down to ``node``, inclusive."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def accept_tree_greedy(tokens: list[int], parents: list[int], target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy tree verification: (accepted node indices, root to leaf; the next token).

    target_logits (N+1, V): row 0 after ``x_n``, row ``1 + i`` after node i.
    """
    choice = target_logits.argmax(-1).tolist()  # (N+1,)
    path: list[int] = []
    node = ROOT
    while True:
        wanted = choice[1 + node]  # row 0 for the root
        match = next((c for c in children(parents, node) if tokens[c] == wanted), None)
        if match is None:
            return path, wanted
        path.append(match)
        node = match


def accept_tree_sampled(
    tokens: list[int],
    parents: list[int],
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    renormalize: bool = True,
) -> tuple[list[int], int]:
    """Recursive rejection over siblings: (accepted node indices; the next token), exact for ``p``.

    target_probs (N+1, V): processed target distributions, row 0 after ``x_n``, row ``1 + i`` after
    node i. ``renormalize=False`` is the broken rule (siblings tested against the unchanged ``p``),
    kept only so the tests can show that it fails the fit.
    """
    path: list[int] = []
    node = ROOT
    while True:
        p = target_probs[1 + node].double()  # (V,) float64: the residuals are renormalized repeatedly
        accepted = None
        for child in children(parents, node):
            token = tokens[child]
            r = float(torch.rand((), generator=generator, device=target_probs.device, dtype=torch.float64))
            mass = float(p[token])
            if r < mass:
                accepted = child
                break
            if renormalize:
                # residual after rejecting a one-hot candidate: p without the token, renormalized
                p = p.clone()
                p[token] = 0.0
                p = p / p.sum()  # mass < 1 here: a token of mass 1 is always accepted
        if accepted is None:
            if float(p.sum()) <= 0:  # every token of p's support was a candidate and rejected: impossible
                raise RuntimeError("tree acceptance left an empty residual")
            token = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            return path, token
        path.append(accepted)
        node = accepted


def top_nodes(parents: list[int], path_logprob: list[float], budget: int) -> list[int]:
    """The ``budget`` nodes with the highest path log-probability, closed under ancestors, in order.

    Path probabilities only fall along a path, so the best nodes form a subtree except where ties
    fall on the cut; ancestors of a kept node are added back to keep it a tree.
    """
    ranked = sorted(range(len(parents)), key=lambda i: (-path_logprob[i], i))[:budget]
    keep = set()
    for node in ranked:
        keep.update(path_to(parents, node))
    return sorted(keep)


def reindex(parents: list[int], keep: list[int]) -> list[int]:
    """Parents of the kept nodes (sorted, ancestor-closed) in the new numbering."""
    new_index = {old: new for new, old in enumerate(keep)}
    return [ROOT if parents[old] == ROOT else new_index[parents[old]] for old in keep]
