"""The models of a run: the frozen target (the teacher) and the trainable draft, and the dtypes they use.

Evaluation and publishing load a run's target from here too (``load_target``), without the trainer.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill.drafts import kind_named
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec.loading import load_model, load_tokenizer, resolve_dtype
from draftsmith.train.config import DistillConfig, draft_settings


def load_target(
    cfg: DistillConfig, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(target, tokenizer) of a run: the frozen teacher (``tiny`` is rebuilt from its config and seed)."""
    if cfg.target == "tiny":
        target, tokenizer = tiny_target(seed=cfg.seed, **cfg.tiny_target)
        target = target.to(device=device, dtype=dtype)
    else:
        tokenizer = load_tokenizer(cfg.target)
        target = load_model(cfg.target, device, dtype, device_map=cfg.teacher_device_map)
    return target.requires_grad_(False).eval(), tokenizer


def teacher_dtype(cfg: DistillConfig, device: torch.device) -> torch.dtype:
    """The dtype the frozen target runs in as teacher (the kind may keep float32: an early-exit draft
    shares its layers)."""
    return kind_named(cfg.draft_kind).teacher_dtype(draft_settings(cfg), resolve_dtype(cfg.teacher_dtype, device))


def mixed_precision(cfg: DistillConfig, device: torch.device) -> str:
    """accelerate's mixed_precision for the draft; ``auto``: bf16 where the device has native bfloat16."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    return "bf16" if resolve_dtype("auto", device) == torch.bfloat16 else "no"


def build_models(cfg: DistillConfig, device: torch.device):
    """(target, tokenizer, draft): the frozen teacher and the trainable draft.

    The draft is built from the float32 target; the teacher is then cast to ``teacher_dtype``.
    """
    target, tokenizer = load_target(cfg, device)
    draft = build_draft(cfg, target, tokenizer, device)
    return target.to(teacher_dtype(cfg, device)), tokenizer, draft


def build_draft(cfg: DistillConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device):
    """The draft ``cfg`` describes (its kind builds it), in training mode, with only its trainable
    parameters requiring grad."""
    return kind_named(cfg.draft_kind).build(draft_settings(cfg), target, tokenizer, device)


def in_dtype_of(draft, target: PreTrainedModel):
    """The draft as it will decode next to ``target``: a copy cast to the target's dtype when they differ."""
    dtype = next(draft.parameters()).dtype
    return draft if dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)
