"""Training a draft with its LM head cut to the tokens it will decode with (frequency-ranked drafting).

A small draft of a 49 k-vocabulary target spends most of a training step in its LM head: the
``(H, V)`` matmul, its backward, and the softmax and loss over ``V``. Decoding with the head cut to
the ``N`` most frequent tokens of the training answers (``specdec/draft_vocab.py``) makes every
other token's draft probability 0, so training the same cut draft loses nothing it would use:
``head_cut_to`` computes the logits of the kept rows only, ``teacher_log_probs`` gives the target's
log-probs on the same tokens (normalized over its full vocabulary), and
``losses.subset_token_losses`` compares the two. The model's weights and state dict are unchanged:
the kept rows are selected from the full head on every forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.specdec.errors import DraftsmithError


class SubsetLinear(nn.Module):
    """The rows ``ids`` of a bias-free linear layer: (..., H) -> (..., N).

    Holds the full layer's own weight (the same Parameter, so a tied or frozen head stays so, and a
    trained one receives gradients in the kept rows only)."""

    def __init__(self, full: nn.Linear, ids: torch.Tensor):
        super().__init__()
        self.weight = full.weight  # (V, H)
        self.register_buffer("ids", ids, persistent=False)  # (N,)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight.index_select(0, self.ids))


@contextlib.contextmanager
def head_cut_to(model: nn.Module, ids: torch.Tensor) -> Iterator[None]:
    """Within the block, ``model``'s forward returns logits over ``ids`` only: (B, T, N) instead of (B, T, V).

    ``model`` is the unwrapped causal LM; a wrapper around it (DDP) calls the same head. The
    backward may run after the block: the graph keeps what it needs."""
    full = model.get_output_embeddings()
    if not isinstance(full, nn.Linear) or full.bias is not None:
        raise DraftsmithError("train_draft_vocab needs a draft with a plain (bias-free) linear LM head")
    model.set_output_embeddings(SubsetLinear(full, ids))
    try:
        yield
    finally:
        model.set_output_embeddings(full)


def teacher_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The target's log-probs at ``temperature`` on the tokens ``ids``: (B, T, V) logits -> (B, T, N).

    Normalized over the full vocabulary (what ``losses.subset_token_losses`` expects), without a
    (B, T, V) log-softmax: the kept logits minus their log-normalizer."""
    scaled = logits.float() / temperature  # (B, T, V)
    return scaled.index_select(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def subset_labels(labels: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token labels (B, T) as columns of the cut head (B, T); -100 where ignored or outside ``ids``."""
    column = torch.full((vocab_size,), -100, dtype=torch.long, device=ids.device)
    column[ids] = torch.arange(len(ids), device=ids.device)
    return torch.where(labels >= 0, column[labels.clamp(min=0)], -100)
