"""What a drafter kind is: the calls every kind module answers, and the settings it is built from.

A *kind* is everything that makes one family of drafts: how it is built from a target and the run's
settings, its setting checks, how it is saved, recognised and loaded, its training forward (what it
needs from the teacher), the (verifier, drafter) pair it decodes with (a draft model that is a
``specdec.drafters.PairedDraft`` builds its own; any other is a standalone LM to the decoder), and
how it is exported for serving. The trainer, checkpoints, eval, eval-run, publish and the command
line ask the kind (``distill.drafts.kind_named``, ``kind_of_folder``, ``kind_of_model``); none of them
tests for a particular kind.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.errors import DraftsmithError


@dataclass(frozen=True)
class Serving:
    """What a published draft carries of its measurement: the best gamma (draft tokens per round)
    and the fastest token-tree shape when one beat the chain (draftsmith's decoder reads it)."""

    gamma: int
    tree: str | None = None


@dataclass(frozen=True)
class DraftSettings:
    """How a run's draft is made: the run config's draft fields as plain values (``train.config``).

    kind: the kind's name (``lm``, ``early_exit``, ...). init, layers, config, model, lora_*:
    how a standalone LM starts (truncated target, new config, pretrained, LoRA); ``layers`` is also
    the shared layer count k of an early-exit draft. options: the kind's own settings
    (``kind_options``), checked by the kind. train_draft_vocab: the head cut to the N most
    frequent tokens (0: the full head). teacher_dtype: the run's ``teacher_dtype``. loss: the run's
    loss (a kind whose predictions reach several steps ahead may refuse ``accepted_length``, whose
    windows assume one prediction per position).
    """

    kind: str = "lm"
    init: str = "truncate"
    layers: str = "2"
    config: dict = field(default_factory=dict)
    model: str | None = None
    lora_r: int = 0
    lora_alpha: int = 16
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    freeze_embeddings: bool = True
    options: dict = field(default_factory=dict)
    train_draft_vocab: int = 0
    teacher_dtype: str = "auto"
    loss: str = "tvd"


@dataclass
class Batch:
    """A training micro-batch as a kind's training forward sees it.

    input_ids, attention_mask, loss_mask: (B, T). rows: (M,) the flat indices into (B, T) of the
    loss positions, row-major (the teacher's distributions come at these rows, in this order).
    head_ids: (N,) the tokens of a cut head (``train_draft_vocab``), None for the full head; the
    logits then cover those N tokens. teacher_hidden: {layer i: (B, T, H)} the residual stream
    entering target layer i at every position, for the layers ``teacher_layers`` named, from the
    same target forward that gives the teacher's distributions ({} when none were asked for).
    teacher_log_probs: (M, N or V) the teacher's log-probs at the loss rows as the loss reads them
    (``train.examples.TeacherRows``), for a kind that weights its predictions by them (None: not given).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rows: torch.Tensor
    head_ids: torch.Tensor | None = None
    teacher_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    teacher_log_probs: torch.Tensor | None = None


@dataclass
class Predictions:
    """What a kind's training forward predicts, compared with the teacher's distributions.

    logits: (R, N or V) the draft's logits. teacher_rows: (R,) for each prediction, the index into
    ``Batch.rows`` of the teacher distribution it is compared with (a kind that predicts several
    tokens ahead, or unrolls several steps, compares its j-th step with the teacher j positions
    on); None: R = M, one prediction per loss row, in order. With ``teacher_rows``, the first M
    predictions are still the next-token ones at the loss rows, in order (held-out alpha reads
    them). weights: (R,) each prediction's weight in the loss sum (None: 1 each); the loss is still
    divided by the count of loss tokens.
    """

    logits: torch.Tensor
    teacher_rows: torch.Tensor | None = None
    weights: torch.Tensor | None = None


class DraftKind(Protocol):
    """The calls a kind module answers (one object per module, registered in ``distill.drafts``)."""

    name: str
    standalone: bool  # its folder is a model transformers and serving engines load as is
    cuts_head: bool  # it can train and decode with its head cut to frequent tokens

    def check(self, settings: DraftSettings) -> None:
        """Refuse settings this kind does not take, by name (``DraftsmithError``)."""
        ...

    def teacher_dtype(self, settings: DraftSettings, resolved: torch.dtype) -> torch.dtype:
        """The target's dtype as teacher, given what ``teacher_dtype`` resolves to on the device."""
        ...

    def build(
        self, settings: DraftSettings, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> torch.nn.Module:
        """The trainable draft, in training mode, only its trainable parameters requiring grad."""
        ...

    def teacher_layers(self, draft: torch.nn.Module) -> tuple[int, ...]:
        """Target layers whose entering hidden states the training forward reads (() for none)."""
        ...

    def training_forward(self, draft: torch.nn.Module, model: torch.nn.Module, batch: Batch) -> Predictions:
        """The draft's predictions for a training batch, at its loss rows (``batch.rows``) only.

        draft: the draft as accelerate prepared it (call its forward through it, so that a DDP or FSDP
        wrapper takes part); model: the same draft unwrapped (to swap its head, e.g. with
        ``vocab_cut.loss_rows_head``)."""
        ...

    def save(self, draft: torch.nn.Module, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
        """Write the draft into ``folder`` (``state``: the full state dict of a sharded model, else None)."""
        ...

    def files(self) -> tuple[str, ...]:
        """The files a complete saved draft of this kind holds."""
        ...

    def recognises(self, folder: Path) -> bool:
        """Whether ``folder`` holds a draft of this kind."""
        ...

    def load(
        self, folder: Path, target: PreTrainedModel, device: torch.device, dtype: torch.dtype
    ) -> torch.nn.Module: ...

    def from_spec(self, spec: str, target: PreTrainedModel) -> torch.nn.Module | None:
        """An untrained draft named on the command line (``truncate:2``, ``early_exit:4``), or None."""
        ...

    def architecture(self, folder: Path) -> tuple[str, dict]:
        """(label, the config its step time depends on) of a saved draft, for sharing c between checkpoints."""
        ...

    def owns(self, draft: torch.nn.Module) -> bool:
        """Whether the model object ``draft`` is of this kind."""
        ...

    def check_export(self, folder: Path) -> None:
        """Refuse, saying why, a saved draft that cannot be published (before anything loads)."""
        ...

    def export(self, draft: torch.nn.Module, tokenizer, folder: Path, serving: Serving) -> None:
        """Write ``draft`` into ``folder`` in the format its serving engine loads, with the measured
        ``serving`` settings where the format carries them."""
        ...

    def engine_config(self, folder: Path) -> dict:
        """vLLM's ``speculative_config`` for the exported draft in ``folder``, without
        ``num_speculative_tokens`` (e.g. ``{"method": "draft_model", "model": folder}``)."""
        ...

    def decoding_report(self, target: PreTrainedModel, draft: torch.nn.Module, gamma: int, kv_reuse: bool) -> dict:
        """Figures ``draftsmith eval`` adds to its report for this kind ({} for none)."""
        ...


def check_options(kind: str, options: dict, known: dict[str, type]) -> None:
    """Refuse ``kind_options`` keys the kind does not have, or values of the wrong type, by name."""
    for key, value in options.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            names = ", ".join(sorted(known)) or "none"
            raise DraftsmithError(f"kind_options: {key!r} is not an option of {kind} drafts (known: {names}){hint}")
        if not isinstance(value, known[key]) or (known[key] is int and isinstance(value, bool)):
            raise DraftsmithError(f"kind_options: {key} must be a {known[key].__name__}, got {value!r}")


def layer_count(layers: str, kind: str) -> int:
    """A layer count from ``draft_layers`` (e.g. the k shared layers of an early-exit draft)."""
    try:
        return int(layers)
    except ValueError as err:
        raise DraftsmithError(f"{kind} drafts take draft_layers as a layer count, got {layers!r}") from err
