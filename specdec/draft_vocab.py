"""A draft whose LM head scores only the tokens the target actually writes (frequency-ranked drafting).

With a 49k-token vocabulary the LM head is the largest part of a small draft's step. Most of those
tokens almost never appear in what the target writes, and a draft token the target would not
choose is rejected anyway, so the draft can score only the ``N`` tokens most frequent in the
target's own outputs (Zhao et al. 2025, FR-Spec). The others get probability 0 in ``q``.

This changes nothing about exactness: ``q`` is still exactly the distribution the draft token is
drawn from (zero outside the list), and the target verifies with its full vocabulary. The draft
model itself keeps its full head, so any other serving stack loads it as is.
``draft_vocab.json`` in a run folder holds the ranking, counted on the training answers. A run
trained with the same cut (``draft.vocab``) also writes the cut part of the ranking into each
checkpoint folder, so that a checkpoint decodes with the head it was trained with.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from draftsmith.specdec.errors import DraftsmithError

FILE = "draft_vocab.json"


def rank_tokens(examples: list[dict]) -> list[int]:
    """Token ids by how often they are a learned (loss-masked) next token in ``examples``, most frequent first."""
    counts: Counter[int] = Counter()
    for example in examples:
        ids, mask = example["input_ids"], example["loss_mask"]
        counts.update(ids[t + 1] for t in range(len(ids) - 1) if mask[t])
    return [token for token, _ in counts.most_common()]


def kept_ids(token_ids: list[int], always: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The ids a head cut to ``token_ids`` scores: those, then ``always`` (e.g. the EOS ids), each once."""
    return list(dict.fromkeys([*token_ids, *sorted(always)]))


def save_ranking(folder: Path, ranking: list[int]) -> None:
    tmp = folder / f".{FILE}.tmp"
    tmp.write_text(json.dumps({"token_ids": ranking}))
    tmp.replace(folder / FILE)


def load_ranking(folder: Path, size: int | None = None) -> list[int]:
    """The run's token ranking, most frequent first; only the first ``size`` when given."""
    if size is not None and size < 0:
        raise DraftsmithError(f"--draft-vocab must be >= 0, got {size}")
    path = folder / FILE
    if not path.is_file():
        raise DraftsmithError(
            f"{path} not found: the draft vocabulary is ranked on a run's training answers; "
            "train with this version first, or leave out --draft-vocab"
        )
    try:
        ranking = [int(t) for t in json.loads(path.read_text())["token_ids"]]
    except (ValueError, KeyError, TypeError) as err:
        raise DraftsmithError(f"{path}: expected {{'token_ids': [int, ...]}} ({err})") from err
    return ranking[:size]


class SubsetHeadDraft(nn.Module):
    """``draft`` with its LM head cut to ``token_ids`` (plus ``always``, e.g. the EOS ids); logits
    of every other token are -inf. Decodes with the same calls as a ``transformers`` causal LM."""

    def __init__(self, draft: nn.Module, token_ids: list[int], always: set[int] | frozenset[int] = frozenset()):
        super().__init__()
        head = draft.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None:
            raise DraftsmithError("a reduced draft vocabulary needs a draft with a plain (bias-free) LM head")
        keep = kept_ids(token_ids, always)
        vocab = head.weight.shape[0]
        if not keep or max(keep) >= vocab or min(keep) < 0:
            raise DraftsmithError(f"draft vocabulary ids must lie in 0..{vocab - 1}")
        self.draft = draft
        self.config = draft.config
        self.vocab_size = vocab
        self.register_buffer("ids", torch.tensor(keep, device=head.weight.device), persistent=False)
        # A copy of the kept rows, as a layer of its own so that it decodes in the form its model's
        # other layers take (``matmul.use_column_products``).
        self.head = nn.Linear(
            head.weight.shape[1], len(keep), bias=False, device=head.weight.device, dtype=head.weight.dtype
        )
        self.head.weight = nn.Parameter(head.weight.detach()[self.ids], requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """(kept tokens, H) the cut head's rows."""
        return self.head.weight

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def forward(self, input_ids, logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        hidden = self.draft.get_decoder()(input_ids=input_ids, **kwargs).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        batch, rows, width = hidden.shape
        scores = self.head(hidden.reshape(batch * rows, width))
        logits = scores.new_full((batch * rows, self.vocab_size), float("-inf"))
        logits.index_copy_(1, self.ids, scores)
        return CausalLMOutputWithPast(logits=logits.view(batch, rows, self.vocab_size))
