"""One round of tree speculative decoding for one sequence: draft a token tree, verify it in one
target forward, accept a path, commit it to both caches (``tree`` holds the pure tree functions).

1. draft   the draft reads the committed tokens it has not read, then drafts the tree level by
           level: each level is ONE draft forward over that level's nodes, each node seeing the
           context and its own ancestors only, at position ``depth`` after ``x_n``. A node's
           children are the draft's most likely tokens after it (deterministic candidates, as in
           SpecInfer, Miao et al. 2024). Dynamic shapes (EAGLE-2, Li et al. 2024) expand only the
           ``expand`` frontier nodes of highest path probability and keep the ``budget`` best nodes.
           The last level is never fed to the draft: it catches up next round, like d_gamma in a chain.
2. verify  the target scores ``[x_n, node_0 .. node_{N-1}]`` in ONE forward with the ancestor mask.
3. accept  ``tree.accept_tree_greedy`` / ``tree.accept_tree_sampled`` (recursive rejection over the
           siblings with the residual renormalized after each rejection; exact for the target).
4. commit  only the accepted path's keys and values stay in both caches: the path's slots are copied
           down to follow the context, the rest of the tree is cropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.specdec.sampling import SamplingParams, process_logits
from draftsmith.specdec.stream import ModelStream, Verification
from draftsmith.specdec.tree import (
    ROOT,
    TreeShape,
    accept_tree_greedy,
    accept_tree_sampled,
    ancestor_matrix,
    depths,
    path_to,
    reindex,
    top_nodes,
)


@dataclass
class Tree:
    """A drafted token tree below ``x_n``, nodes in topological order (``tree`` module docstring)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    path_logprob: list[float] = field(default_factory=list)  # draft log-probability of root -> node
    slots: dict[int, int] = field(default_factory=dict)  # node -> its slot in the draft's cache, if fed
    steps: int = 0  # draft forwards, the catch-up one included


def draft_tree(stream: ModelStream, sequence: list[int], shape: TreeShape, max_depth: int) -> Tree:
    """Draft a tree of at most ``max_depth`` levels after the committed ``sequence`` (x_n last) on the
    draft's ``stream`` (batch 1), whose cache holds a prefix of ``sequence``."""
    tree = Tree()
    if max_depth < 1:
        return tree
    unread = torch.tensor([sequence[stream.lengths[0] :]], device=stream.device)  # (1, U), x_n included
    logits = stream.forward(unread, torch.ones_like(unread, dtype=torch.bool), logits_to_keep=1)[0]  # (1, V)
    tree.steps = 1
    frontier = [ROOT]
    for depth in range(max_depth):
        level = add_children(tree, frontier, logits, shape.branching[depth])
        if depth + 1 == max_depth:
            break
        frontier = level
        if shape.budget:  # EAGLE-2: grow only below the likeliest frontier nodes
            frontier = sorted(sorted(level, key=lambda i: -tree.path_logprob[i])[: shape.expand])
        logits = _feed_level(stream, tree, frontier, base=len(sequence))  # (F, V)
        tree.steps += 1
    if shape.budget:
        prune(tree, shape.budget)
    return tree


def add_children(tree: Tree, frontier: list[int], logits: torch.Tensor, branching: int) -> list[int]:
    """Append the top ``branching`` draft tokens after each frontier node (logits (F, V)) as its
    children, in order of draft preference; return the new nodes."""
    top = logits.float().log_softmax(-1).topk(branching, dim=-1)  # (F, b)
    values, indices = top.values.tolist(), top.indices.tolist()
    level = []
    for row, parent in enumerate(frontier):
        above = 0.0 if parent == ROOT else tree.path_logprob[parent]
        for logprob, token in zip(values[row], indices[row], strict=True):
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.path_logprob.append(above + logprob)
            level.append(len(tree.tokens) - 1)
    return level


def _feed_level(stream: ModelStream, tree: Tree, nodes: list[int], base: int) -> torch.Tensor:
    """One draft forward over ``nodes`` (one level), each seeing the context (``base`` committed
    slots) and its fed ancestors; returns their logits (F, V)."""
    for node in nodes:
        tree.slots[node] = base + len(tree.slots)
    visible = torch.zeros(len(nodes), base + len(tree.slots), dtype=torch.bool)  # (F, S)
    visible[:, :base] = True
    positions = []
    for row, node in enumerate(nodes):
        path = path_to(tree.parents, node)
        visible[row, [tree.slots[n] for n in path]] = True
        positions.append(base - 1 + len(path))  # x_n sits at base - 1
    tokens = torch.tensor([[tree.tokens[n] for n in nodes]], device=stream.device)  # (1, F)
    position_ids = torch.tensor([positions], device=stream.device)
    return stream.forward_tree(tokens, position_ids, visible.to(stream.device)).logits[0]


def prune(tree: Tree, budget: int) -> None:
    """Keep the ``budget`` nodes of highest path probability (closed under ancestors)."""
    keep = top_nodes(tree.parents, tree.path_logprob, budget)
    tree.parents = reindex(tree.parents, keep)
    tree.tokens = [tree.tokens[i] for i in keep]
    tree.path_logprob = [tree.path_logprob[i] for i in keep]
    tree.slots = {new: tree.slots[old] for new, old in enumerate(keep) if old in tree.slots}


def verify_tree(stream: ModelStream, last: int, tree: Tree, layers: tuple[int, ...] = ()) -> Verification:
    """The target's forward over ``[x_n, nodes...]`` in one pass: logits (1, N+1, V), row 0 after
    ``x_n``, row ``1 + i`` after node i, and the hidden states entering ``layers`` at those rows.
    The target's cache holds the committed tokens before ``x_n``."""
    if not tree.tokens:
        step = torch.tensor([[last]], device=stream.device)
        return stream.forward_features(step, torch.ones_like(step, dtype=torch.bool), layers)
    base = stream.lengths[0]
    inputs = torch.tensor([[last, *tree.tokens]], device=stream.device)  # (1, N+1)
    positions = torch.tensor([[base + d for d in [0, *depths(tree.parents)]]], device=stream.device)
    visible = torch.cat([torch.ones(len(tree.tokens) + 1, base, dtype=torch.bool), ancestor_matrix(tree.parents)], 1)
    return stream.forward_tree(inputs, positions, visible.to(stream.device), layers)


def kept_rows(tree: Tree, path: list[int]) -> torch.Tensor:
    """(1, N+1) bool: the rows of ``verify_tree``'s forward that hold committed tokens, x_n and the path."""
    kept = torch.zeros(1, len(tree.tokens) + 1, dtype=torch.bool)
    kept[0, [0, *(1 + node for node in path)]] = True
    return kept


def accept_tree(
    tree: Tree, target_logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """(accepted path of node indices, the target's next token); target_logits (N+1, V). Sampling
    processes the target's logits with temperature, top-k and top-p as for chains."""
    if sampling.greedy:
        return accept_tree_greedy(tree.tokens, tree.parents, target_logits)
    probs = process_logits(target_logits, sampling)  # (N+1, V)
    return accept_tree_sampled(tree.tokens, tree.parents, probs, generator=generator)


def keep_target_path(target: ModelStream, tree: Tree, path: list[int]) -> None:
    """Keep only ``x_n`` and the accepted path in the target's cache."""
    base = target.lengths[0]
    if tree.tokens:
        target.keep_slots([base, *(base + 1 + node for node in path)])


def keep_draft_path(draft: ModelStream, tree: Tree, path: list[int]) -> None:
    """Keep the path's fed nodes in the draft's cache (a prefix of the path: a fed node's ancestors were fed)."""
    draft.keep_slots([tree.slots[node] for node in path if node in tree.slots])
