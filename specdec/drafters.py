"""Drafters: what proposes the tokens of a round of speculative decoding.

A drafter keeps its own state across rounds (a KV cache) and answers the calls of the round loop
(``decoder.speculative_generate``):

- ``prefill(tokens, valid)`` reads the prompts; returns what the target can reuse of that work
  (the hidden states of a draft made of the target's first layers), or None;
- ``propose(sequences, budget, options, generator)`` drafts up to ``budget[b]`` tokens for each
  sequence, with the distributions ``q`` they were drawn from (a ``Proposal``);
- ``observe(verification, kept)`` receives what the target's forward produced (its logits, and the
  hidden states of the target layers named in the drafter's ``feature_layers``) and which of its
  input rows hold committed tokens; called after the prefill and after every acceptance, before
  rollback, so that a drafter can condition its next round on the target's own features;
- ``rollback(keep)`` forgets all but the first ``keep[b]`` tokens of each sequence;
- ``select(rows)`` keeps only those batch rows (finished sequences leave the batch);
- ``propose_tree`` / ``commit_tree``: the same for token-tree rounds (``tree_drafting``), batch 1.

``LMDrafter`` (a standalone causal LM with its own cache) is here. Other kinds of draft build
their own (verifier, drafter) pair: a draft model that satisfies ``PairedDraft`` is asked for it
by the decoder (a draft sharing the target's cache, a head reading the target's hidden states).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers import PreTrainedModel

from draftsmith.specdec.compiled import make_stream
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.proposal import Proposal, draft_chain, draft_step, stack_proposal
from draftsmith.specdec.stream import Verification
from draftsmith.specdec.tree import TreeShape
from draftsmith.specdec.tree_drafting import Tree, draft_tree, keep_draft_path
from draftsmith.specdec.verify import Verifier

__all__ = [
    "Drafter",
    "LMDrafter",
    "PairedDraft",
    "Proposal",
    "Verification",
    "draft_chain",
    "draft_step",
    "round_forwards",
    "stack_proposal",
]


class Drafter(Protocol):
    feature_layers: tuple[int, ...]  # target layers whose hidden states ``observe`` receives; () for none
    # Optional ``takes_guesses = True``: rounds may verify lookup guesses (``lookup``: in a round it sat
    # out, or after its chain), so committed tokens it never proposed may follow x_n or its drafts; a
    # drafter whose verifier reuses its own states for the verified tokens (``Proposal.reusable``) leaves it out.

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None: ...

    def propose(
        self,
        sequences: list[list[int]],
        budget: torch.Tensor,
        options: DecodeOptions,
        generator: torch.Generator | None,
    ) -> Proposal: ...

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        """``kept`` (B, Q) bool: the input rows of the target's forward that hold committed tokens
        (prefill: the prompt tokens; a chain round: x_n and the accepted drafts; a tree round: x_n
        and the accepted path), in order; ``verification`` covers all Q rows."""
        ...

    def rollback(self, keep: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...

    def propose_tree(self, sequence: list[int], shape: TreeShape, max_depth: int) -> Tree:
        """A token tree of at most ``max_depth`` levels after the one sequence's committed tokens."""
        ...

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        """Keep only the accepted ``path`` (node indices) of the last tree in the drafter's state."""
        ...


@runtime_checkable
class PairedDraft(Protocol):
    """A draft model that decodes with its own (verifier, drafter) pair instead of ``LMDrafter`` on a
    ``verify.TargetVerifier``: it shares the target's cache, or reads the target's hidden states.

    ``decoding_pair`` builds both sides for ``batch_size`` sequences of up to ``capacity`` tokens;
    ``decodes_compiled`` says whether those sides run compiled steps with ``options`` (refusing
    ``options.compile`` where they cannot); ``round_forwards`` is the draft forwards a chain round of
    ``gamma`` proposals costs (``distill.drafts.kind.DraftModel`` has the defaults)."""

    def decoding_pair(
        self, target: PreTrainedModel, batch_size: int, capacity: int, options: DecodeOptions
    ) -> tuple[Verifier, Drafter]: ...

    def decodes_compiled(self, target: PreTrainedModel, options: DecodeOptions) -> bool: ...

    def round_forwards(self, gamma: int) -> int: ...


def round_forwards(draft: torch.nn.Module, gamma: int) -> int:
    """The draft forwards a chain round of ``gamma`` proposals costs: a ``PairedDraft`` says
    (one per proposal, unless it proposes several tokens per forward); a standalone LM, one per proposal."""
    return draft.round_forwards(gamma) if isinstance(draft, PairedDraft) else gamma


class LMDrafter:
    """A standalone causal LM as drafter, on its own cache (a ``ModelStream``; ``compiled``: a
    ``compiled.CompiledStream``).

    The draft's cache lags behind the committed tokens: by one (x_n) after a round with a
    rejection, by two after a fully accepted round (it never read d_gamma). Each round starts by
    feeding it what it has not read.
    """

    feature_layers: tuple[int, ...] = ()  # it reads nothing of the target's
    takes_guesses = True  # rounds may verify lookup guesses: it reads committed tokens as they come

    def __init__(self, model: torch.nn.Module, batch_size: int, capacity: int, cache_kind: str, compiled: bool = False):
        self.stream = make_stream(model, batch_size, capacity, cache_kind, role="draft", compiled=compiled)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self.stream.forward(tokens, valid, logits_to_keep=1)

    def observe(self, verification: Verification, kept: torch.Tensor) -> None:
        """Nothing: a standalone LM reads only the committed tokens."""

    def propose(
        self,
        sequences: list[list[int]],
        budget: torch.Tensor,
        options: DecodeOptions,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Up to ``budget[b]`` tokens per sequence, one draft forward per token (``draft_chain``).
        Sequences that stop early (budget, dynamic gamma) feed padding, so that the batch stays dense."""
        unread = self._unread(sequences, budget)

        def next_logits(token: torch.Tensor | None, active: torch.Tensor) -> torch.Tensor:
            step_in, step_valid = unread if token is None else (token[:, None], active[:, None])
            return self.stream.forward(step_in, step_valid, logits_to_keep=1)[:, -1]  # (B, V)

        return draft_chain(next_logits, budget, options, generator)

    def _unread(self, sequences: list[list[int]], budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed tokens the cache has not read, left-padded (B, W), and their validity (B, W)."""
        pending = [seq[length:] for seq, length in zip(sequences, self.stream.lengths, strict=True)]
        width = max(len(p) for p in pending)
        tokens = torch.zeros(len(pending), width, dtype=torch.long)
        valid = torch.zeros(len(pending), width, dtype=torch.bool)
        for row, (unread, allowed) in enumerate(zip(pending, budget.tolist(), strict=True)):
            tokens[row, width - len(unread) :] = torch.tensor(unread)
            valid[row, width - len(unread) :] = allowed > 0  # a sequence with nothing to draft reads nothing
        return tokens.to(budget.device), valid.to(budget.device)

    def rollback(self, keep: torch.Tensor) -> None:
        self.stream.rollback(keep)

    def select(self, rows: torch.Tensor) -> None:
        self.stream.select(rows)

    def propose_tree(self, sequence: list[int], shape: TreeShape, max_depth: int) -> Tree:
        return draft_tree(self.stream, sequence, shape, max_depth)

    def commit_tree(self, tree: Tree, path: list[int]) -> None:
        keep_draft_path(self.stream, tree, path)
