"""The models of a run: the frozen target (the teacher) and the trainable draft, and the dtypes they use.

Evaluation and publishing load a run's target from here too (``load_target``), without the trainer.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill.drafts import kind_named
from draftsmith.distill.drafts.kind import TargetParts
from draftsmith.distill.tiny import tiny_target
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_model_files, load_model, load_tokenizer, resolve_dtype, resolve_model
from draftsmith.specdec.partial_model import cast_parameters, load_partial, load_whole
from draftsmith.train.config import DistillConfig, draft_settings, load_run_config


def load_target(
    cfg: DistillConfig, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(target, tokenizer) of a run: the frozen teacher (``tiny`` is rebuilt from its config and seed)."""
    if cfg.target == "tiny":
        target, tokenizer = tiny_target(seed=cfg.seed, **cfg.tiny_target)
        target = target.to(device=device, dtype=dtype)
    else:
        tokenizer = load_tokenizer(cfg.target)
        placement = teacher_placement(cfg.teacher.device_map, *launcher_ranks(), gpu_memory())
        target = load_model(cfg.target, device, dtype, placement.device_map, placement.max_memory)
    return target.requires_grad_(False).eval(), tokenizer


@dataclass(frozen=True)
class TeacherPlacement:
    """How the frozen target is loaded: transformers' ``device_map`` and ``max_memory`` ({GPU: bytes})."""

    device_map: str | None
    max_memory: dict[int, int] | None = None


def teacher_placement(
    device_map: str | None, local_rank: int, local_processes: int, gpu_memory: list[int], share: float = 0.9
) -> TeacherPlacement:
    """Where this process's copy of the teacher goes. ``auto`` under N processes on a machine: only onto
    this process's own GPUs, local ranks r, r + N, r + 2N, ... of the visible ones (so its own
    ``cuda:r``, where accelerate puts its draft, is among them), each up to ``share`` of its memory;
    without that every process would spread its copy over all the GPUs. gpu_memory: each visible
    GPU's total bytes."""
    if device_map != "auto" or local_processes == 1:
        return TeacherPlacement(device_map)
    if len(gpu_memory) < local_processes or len(gpu_memory) % local_processes:
        raise DraftsmithError(
            f"teacher.device_map: auto under {local_processes} processes needs a multiple of {local_processes} "
            f"visible GPUs (each process's copy on its own share), found {len(gpu_memory)}; launch "
            "--num_processes to divide them, or use the feature store (teacher_cache: true)"
        )
    own = range(local_rank, len(gpu_memory), local_processes)
    return TeacherPlacement("auto", {gpu: int(gpu_memory[gpu] * share) for gpu in own})


def launcher_ranks() -> tuple[int, int]:
    """(local rank, processes on this machine) as ``accelerate launch`` / ``torchrun`` set them."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def gpu_memory() -> list[int]:
    """Each visible CUDA device's total memory in bytes ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]


@dataclass
class RunModels:
    """A run's config, tokenizer and target, loaded once and shared by the stages of one command
    (``quickstart``: training, eval-run and publish). A stage run alone starts from ``for_run``.
    The target is loaded once per device; another dtype is a cast copy of it, not a second load."""

    cfg: DistillConfig
    tokenizer: PreTrainedTokenizerBase | None = None
    targets: dict[tuple[str, torch.dtype], PreTrainedModel] = field(default_factory=dict)

    @classmethod
    def for_run(cls, run_dir: Path) -> RunModels:
        return cls(load_run_config(run_dir))

    def target(self, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
        """The frozen target on ``device`` in ``dtype``."""
        key = (str(device), dtype)
        if key not in self.targets:
            same_device = [model for (where, _), model in self.targets.items() if where == str(device)]
            if same_device:
                load_whole(same_device[0])  # a training run's target may hold only what its draft read
                self.targets[key] = cast_parameters(copy.deepcopy(same_device[0]), dtype)
            else:
                self.targets[key], self.tokenizer = load_target(self.cfg, device, dtype)
        load_whole(self.targets[key])
        return self.targets[key]


def teacher_dtype(cfg: DistillConfig, device: torch.device) -> torch.dtype:
    """The dtype the frozen target runs in as teacher (the kind may keep float32: an early-exit draft
    shares its layers)."""
    return kind_named(cfg.draft.kind).teacher_dtype(draft_settings(cfg), resolve_dtype(cfg.teacher.dtype, device))


def mixed_precision(cfg: DistillConfig, device: torch.device) -> str:
    """accelerate's optim.mixed_precision for the draft; ``auto``: bf16 where the device has native bfloat16."""
    if cfg.optim.mixed_precision != "auto":
        return cfg.optim.mixed_precision
    return "bf16" if resolve_dtype("auto", device) == torch.bfloat16 else "no"


def build_models(cfg: DistillConfig, device: torch.device):
    """(target, tokenizer, draft): the frozen teacher and the trainable draft.

    The draft is built from the target's tensors in float32 (the dtype it trains in). With
    ``teacher.load_parts`` only the tensors its kind reads are loaded (``target_parts``): the rest of
    the target loads the first time the target runs (``specdec.partial_model``), directly in the
    teacher's dtype, so a run fed by a feature store never holds the target's layers. A target placed
    with ``teacher.device_map`` (too large for one device) loads whole in the teacher's dtype, and the
    draft built from it is cast to float32. Otherwise (``teacher.load_parts`` false, the tiny target)
    the whole target loads in float32 and is then cast to ``teacher.dtype``.
    """
    teaching = teacher_dtype(cfg, device)
    if cfg.teacher.device_map is not None and cfg.target != "tiny":
        target, tokenizer = load_target(cfg, device, teaching)
        return target, tokenizer, build_draft(cfg, target, tokenizer, device).float()
    if cfg.target == "tiny" or not cfg.teacher.load_parts:
        target, tokenizer = load_target(cfg, device)
        draft = build_draft(cfg, target, tokenizer, device)
        return cast_parameters(target, teaching), tokenizer, draft
    tokenizer = load_tokenizer(cfg.target)
    source = resolve_model(cfg.target)
    if Path(source).is_dir():
        check_model_files(Path(source))
    partial = load_partial(source, device, teaching)
    target = partial.model
    parts = kind_named(cfg.draft.kind).target_parts(draft_settings(cfg), len(target.get_decoder().layers))
    partial.load(part_modules(target, parts), torch.float32)
    draft = build_draft(cfg, target, tokenizer, device)
    return cast_parameters(target, teaching), tokenizer, draft


def part_modules(target: PreTrainedModel, parts: TargetParts) -> list[torch.nn.Module]:
    """The modules of ``target`` that hold ``parts``."""
    if parts.whole:
        return [target]
    decoder = target.get_decoder()
    shared = [target.get_input_embeddings(), target.get_output_embeddings(), decoder.norm]
    return shared + [decoder.layers[i] for i in parts.layers]


def build_draft(cfg: DistillConfig, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: torch.device):
    """The draft ``cfg`` describes (its kind builds it), in training mode, with only its trainable
    parameters requiring grad."""
    return kind_named(cfg.draft.kind).build(draft_settings(cfg), target, tokenizer, device)


def in_dtype_of(draft, target: PreTrainedModel):
    """The draft as it will decode next to ``target``: a copy cast to the target's dtype when they differ."""
    dtype = next(draft.parameters()).dtype
    return draft if dtype == target.dtype else copy.deepcopy(draft).to(target.dtype)
