"""LM heads applied where the loss needs them: at the loss rows only, and over a cut draft's tokens only.

A small draft of a 49 k-vocabulary target spends most of a training step in LM heads: the ``(H, V)``
matmuls, their backward, and the softmax and loss over ``V``, at every position of a padded batch
although only the answer tokens count (1.8 positions per loss token on the shipped data). So the
trainer gathers the final hidden states of the M loss rows before any head, and applies the heads
there:

- the draft's, through its own forward (a DDP/FSDP or peft wrapper still sees a normal forward call):
  ``loss_rows_head`` swaps the model's output embedding for a ``RowsHead`` that maps the hidden
  states (B, T, H) to the logits of the loss rows (M, n);
- the frozen target's, by running its decoder and applying the head to the gathered rows
  (``target_rows``, ``head_log_probs``); its full-vocabulary normalizer, where a loss needs it, is
  computed at the loss rows only, in chunks of rows.

Decoding with the draft's head cut to the ``N`` most frequent tokens of the training answers
(``specdec/draft_vocab.py``) gives every other token draft probability 0, so the cut draft also trains
that way: its head computes the kept rows of the weight only (``ids``), the target's log-probs are
taken on the same tokens (normalized over its full vocabulary), and ``losses.row_losses`` compares
the two. The model's weights and state dict are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from draftsmith.specdec.errors import DraftsmithError

# rows * vocabulary of one chunk of target logits when the full normalizer is taken (float32: 32 MB),
# small enough to stay in the allocator's reuse and large enough for an efficient matmul
CHUNK_ELEMENTS = 1 << 23

# weight -> (ids, weight version, dtype, copy): a frozen head's kept rows, copied once instead of at
# every forward; keyed by the Parameter's identity and dropped with it
_KEPT_ROWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def kept_rows(weight: torch.Tensor, ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``ids`` of a head weight (V, H) -> (N, H) in ``dtype`` (all V rows for ``ids`` None).

    A weight that takes gradients is gathered at every call (autograd scatters the gradient back into
    the kept rows). A frozen one is copied once and reused until it changes in place (its version
    counter moves: a load or an optimizer step), so neither the gather nor an autocast cast of the
    head runs at every forward."""
    if weight.requires_grad and torch.is_grad_enabled():
        return (weight if ids is None else weight.index_select(0, ids)).to(dtype)
    cached = _KEPT_ROWS.get(weight)
    if cached is not None and cached[0] is ids and cached[1] == weight._version and cached[2] == dtype:
        return cached[3]
    with torch.no_grad():
        copy = (weight if ids is None else weight.index_select(0, ids)).to(dtype)
    _KEPT_ROWS[weight] = (ids, weight._version, dtype, copy)
    return copy


def loss_rows(mask: torch.Tensor) -> torch.Tensor:
    """The flat indices (M,) of the True positions of ``mask`` (B, T), in row-major order: the loss rows."""
    return mask.flatten().nonzero().squeeze(1)


class RowsHead(nn.Module):
    """A bias-free linear head at chosen rows and columns: hidden (B, T, H) -> logits (M, N).

    rows (M,): flat indices into B x T; ids (N,): the kept columns
    (None: all V). Reads the full layer's own weight when it runs (the same Parameter, so a tied or
    frozen head stays so, and a trained one receives gradients in the kept rows only; under FSDP, the
    whole weight its forward gathered, not the shard it held when the head was swapped)."""

    def __init__(self, full: nn.Linear, rows: torch.Tensor, ids: torch.Tensor | None):
        super().__init__()
        object.__setattr__(self, "full", full)  # not a submodule: its parameter stays registered where it is
        self.rows, self.ids = rows, ids

    @property
    def weight(self) -> torch.Tensor:
        return self.full.weight  # (V, H)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.flatten(0, -2).index_select(0, self.rows)  # (M, H)
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        return F.linear(hidden, kept_rows(self.weight, self.ids, dtype))


def plain_head(model: nn.Module) -> nn.Linear:
    """``model``'s output embedding, which must be a bias-free linear layer."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise DraftsmithError("training at the loss rows needs a model with a plain (bias-free) linear LM head")
    return head


@contextlib.contextmanager
def loss_rows_head(model: nn.Module, rows: torch.Tensor, ids: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, ``model``'s forward returns the logits of the loss rows only: (M, N or V)
    instead of (B, T, V). rows (M,) flat indices of (B, T) (``loss_rows``);
    ids (N,) the kept tokens of a cut head (None: the full head).

    ``model`` is the unwrapped model, with ``get_output_embeddings`` / ``set_output_embeddings``; a
    wrapper around it (DDP, FSDP, peft) calls the same head. The backward may run after the block:
    the graph keeps what it needs."""
    full = plain_head(model)
    model.set_output_embeddings(RowsHead(full, rows, ids))
    try:
        yield
    finally:
        model.set_output_embeddings(full)


@dataclass
class TargetRows:
    """The frozen target at a batch's loss rows, from one forward of its decoder."""

    hidden: torch.Tensor  # (M, H) final (normed) hidden states at the loss rows
    layers: dict[int, torch.Tensor] | None = None  # (B, T, H) hidden states of the layers asked for, else None


def target_rows(target: nn.Module, batch: dict, rows: torch.Tensor, hidden_layers: Sequence[int] = ()) -> TargetRows:
    """Run the target's decoder over a batch (input_ids, attention_mask (B, T)) and gather the loss rows.

    hidden_layers: also return those layers' hidden states (``output_hidden_states`` indexing: 0 the
    embeddings), for a draft fed the target's features (EAGLE-3 style)."""
    out = target.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        use_cache=False,
        output_hidden_states=bool(hidden_layers),
    )
    last = out.last_hidden_state  # (B, T, H): on the target's last device when it is spread
    hidden = last.flatten(0, 1).index_select(0, rows.to(last.device))  # (M, H)
    layers = {i: out.hidden_states[i] for i in hidden_layers} if hidden_layers else None
    return TargetRows(hidden, layers)


def head_log_probs(
    target: nn.Module,
    hidden: torch.Tensor,
    ids: torch.Tensor | None,
    temperature: float = 1.0,
    full_normalizer: bool = True,
) -> torch.Tensor:
    """The target's log-probs at ``temperature`` at the loss rows: hidden (M, H) -> (M, N or V) float32.

    ids (N,): on those tokens only (None: all V). With ``full_normalizer`` they are normalized over
    the full vocabulary, computed a chunk of rows at a time (no (M, V) tensor when cut); without it
    they are the kept logits at temperature, off by a per-row constant: enough for forward KL, which
    renormalizes over the kept tokens, and the head runs on the kept rows only."""
    weight = plain_head(target).weight  # (V, H)
    hidden = hidden.to(weight.device)
    if ids is not None and not full_normalizer:
        return F.linear(hidden, kept_rows(weight, ids.to(weight.device), weight.dtype)).float() / temperature
    if ids is None:
        return F.log_softmax(F.linear(hidden, weight).float() / temperature, dim=-1)
    ids = ids.to(weight.device)
    chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
    parts = []
    for start in range(0, len(hidden), chunk):
        scaled = F.linear(hidden[start : start + chunk], weight).float() / temperature  # (C, V)
        parts.append(scaled.index_select(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True))
    return torch.cat(parts) if parts else hidden.new_zeros(0, len(ids), dtype=torch.float32)


def head_argmax(target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target head's most probable token over its full vocabulary at each row: hidden (M, H) ->
    (M,) ids, a chunk of rows at a time (no (M, V) tensor)."""
    weight = plain_head(target).weight  # (V, H)
    chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
    hidden = hidden.to(weight.device, weight.dtype)
    best = [F.linear(part, weight).argmax(-1) for part in hidden.split(chunk)]
    return torch.cat(best) if best else torch.zeros(0, dtype=torch.long, device=weight.device)


def teacher_log_probs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The target's log-probs at ``temperature`` on the tokens ``ids``: (B, T, V) logits -> (B, T, N).

    Normalized over the full vocabulary (what ``losses.subset_token_losses`` expects), without a
    (B, T, V) log-softmax: the kept logits minus their log-normalizer."""
    scaled = logits.float() / temperature  # (B, T, V)
    return scaled.index_select(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def subset_labels(labels: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token labels (any shape) as columns of the cut head (same shape); -100 where ignored or outside ``ids``."""
    column = torch.full((vocab_size,), -100, dtype=torch.long, device=ids.device)
    column[ids] = torch.arange(len(ids), device=ids.device)
    return torch.where(labels >= 0, column[labels.clamp(min=0)], -100)
