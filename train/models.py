"""The models of a run: the frozen target (the teacher) and the trainable draft, and the dtypes they use.

Evaluation and publishing load a run's target from here too (``load_target``), without the trainer.
"""

from __future__ import annotations

import copy
import difflib

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill.draft_init import add_lora, new_config_draft, truncate_target
from draftsmith.distill.early_exit import EarlyExitDraft
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_compatible, load_model, load_tokenizer, resolve_dtype
from draftsmith.train.config import DistillConfig


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
    """The dtype the frozen target runs in as teacher (early-exit drafts share its layers: float32)."""
    if cfg.draft_init == "early_exit":
        return torch.float32
    return resolve_dtype(cfg.teacher_dtype, device)


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
    """The draft ``cfg.draft_init`` describes, in training mode, with only its trainable parameters requiring grad."""
    if cfg.draft_init == "truncate":
        draft = truncate_target(target, cfg.draft_layers)
    elif cfg.draft_init == "early_exit":
        draft = EarlyExitDraft(target, early_exit_layers(cfg.draft_layers), adapter=cfg.early_exit_adapter)
        return draft.train()  # its shared layers, embeddings and head are the target's, frozen
    elif cfg.draft_init == "config":
        check_draft_config(target.config, cfg.draft_config)
        draft = new_config_draft(target, cfg.draft_config)
    else:
        draft = load_model(cfg.draft_model, device, torch.float32)
        check_compatible(tokenizer, load_tokenizer(cfg.draft_model), target.config.vocab_size, draft.config.vocab_size)
    draft.requires_grad_(True).train()
    if cfg.freeze_embeddings:
        draft.get_input_embeddings().requires_grad_(False)
        draft.get_output_embeddings().requires_grad_(False)
    if cfg.lora_r:
        draft = add_lora(draft, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules)
    return draft


def check_draft_config(target_config, overrides: dict) -> None:
    """Refuse ``draft_config`` keys that the target's config class does not have (a typo would be ignored)."""
    known = set(type(target_config)().to_dict()) | set(target_config.to_dict())
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise DraftsmithError(
                f"draft_config: {key!r} is not a field of {type(target_config).__name__}; {hint}"
                "fix the key (nested keys are the target's config fields, e.g. num_hidden_layers)"
            )


def early_exit_layers(layers: str) -> int:
    """k, the target layers an early-exit draft shares, from ``draft_layers``."""
    try:
        return int(layers)
    except ValueError as err:
        raise DraftsmithError(f"draft_init early_exit takes draft_layers as a layer count k, got {layers!r}") from err


def in_dtype_of(draft, target: PreTrainedModel):
    """The draft as it will decode next to ``target``: a copy cast to the target's dtype when they differ."""
    dtype = next(draft.parameters()).dtype
    return draft if dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)
