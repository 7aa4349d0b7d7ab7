"""Checkpoints: ``checkpoint-{step}/`` = a complete Hugging Face model folder of the draft plus
``state/`` (optimizer, scheduler, RNG: accelerate's ``save_state``) and ``draftsmith.json``;
``initial/`` = the draft before any step, without ``state/``.

Each is written to a hidden temporary folder and renamed into place, and ``draftsmith.json`` is
written last, so a folder without it is incomplete (an interrupted save). ``is_complete`` is the one
place that decides what a usable checkpoint holds; resume, eval-run and publish all ask it.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from draftsmith.distill.drafts import kind_of_folder, kind_of_model
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import replace, write_text
from draftsmith.specdec.loading import same_model
from draftsmith.train.config import DistillConfig, flat_settings

MARKER = "draftsmith.json"
INITIAL = "initial"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def missing_files(folder: Path) -> list[str]:
    """What ``folder`` lacks to be a complete checkpoint: the draft's files, then the marker written last."""
    kind = kind_of_folder(folder)
    if kind is None:
        return ["config.json", MARKER]  # no draft of any kind: a standalone LM's config first
    return [name for name in (*kind.files(), MARKER) if not (folder / name).is_file()]


def is_complete(folder: Path) -> bool:
    """A checkpoint (or ``initial/``) whose save finished: the draft loads from it."""
    return folder.is_dir() and not missing_files(folder)


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first; incomplete ones are reported and ignored."""
    found = []
    for path in sorted(run_dir.glob("checkpoint-*")):
        match = _NAME.match(path.name)
        if not match or not path.is_dir():
            continue
        if not is_complete(path):
            missing = ", ".join(missing_files(path))
            print(f"skipping incomplete checkpoint {path} (missing {missing}; an interrupted save)", file=sys.stderr)
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def drafts_of_run(run_dir: Path) -> list[tuple[str, int, Path]]:
    """(name, step, folder) of the initial draft and every complete checkpoint, by step."""
    initial = run_dir / INITIAL
    found = [(INITIAL, 0, initial)] if is_complete(initial) else []
    return found + [(path.name, step, path) for step, path in checkpoint_dirs(run_dir)]


def temporary_dir(run_dir: Path, step: int | str) -> Path:
    """Where checkpoint ``step`` (or ``"initial"``) is written before it is complete; the same on every process."""
    return run_dir / f".checkpoint-{step}.tmp"


def begin(run_dir: Path, step: int | str) -> Path:
    """A fresh temporary folder for checkpoint ``step`` (or ``"initial"``, the draft before training)."""
    tmp = temporary_dir(run_dir, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(run_dir: Path, tmp: Path, name: str, info: dict, keep_last: int | None = None) -> Path:
    """Mark ``tmp`` complete and rename it to ``name``; with ``keep_last``, drop the oldest checkpoints beyond it."""
    write_text(tmp / MARKER, json.dumps(info, indent=2))
    final = run_dir / name
    replace(tmp, final)  # only an incomplete one can be at ``final``: complete ones are never re-saved
    if keep_last is not None:
        for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    return final


def write_draft(model, state: dict | None, tokenizer, folder: Path, target_name: str) -> None:
    """The draft as its kind saves it (a standalone LM: a Hugging Face model folder; a LoRA draft: its
    adapter plus a merged copy). ``state``: the full state dict when the model is sharded (FSDP), else None."""
    kind_of_model(model).save(model, state, tokenizer, folder, target_name)


# Settings that must match for a run folder to be resumed: they decide the model, the data and its order.
RESUME_KEYS = (
    "target",
    "tiny_target",
    "draft.kind",
    "draft.init",
    "draft.layers",
    "draft.config",
    "draft.options",
    "draft.freeze_embeddings",
    "data.mode",
    "data.dataset",
    "data.config",
    "data.max_samples",
    "data.column_map",
    "data.max_length",
    "optim.batch_size",
    "optim.grad_accum",
    "seed",
    "data.heldout",
    "generate.samples",
    "on_policy.fraction",
    "on_policy.refresh_steps",
    "on_policy.pool",
    "teacher.cache",
    "teacher.top_k",
)


# Settings that shape the training itself: a resumed run with another value would mix two runs in one
# metrics.jsonl, so a change is refused unless resume=force, and then recorded in RESUME_LOG.
TRAINING_KEYS = (
    "loss.name",
    "loss.temperature",
    "loss.jsd_beta",
    "loss.gamma",
    "loss.ce_weight",
    "optim.lr",
    "optim.weight_decay",
    "optim.warmup_steps",
    "optim.max_grad_norm",
    "optim.mixed_precision",
    "teacher.dtype",
    "generate.max_new_tokens",
    "generate.temperature",
    "generate.top_p",
    "draft.model",
    "draft.lora_r",
    "draft.lora_alpha",
    "draft.lora_target_modules",
)
RESUME_LOG = "resume_log.jsonl"  # one record per forced resume: the step and the settings changed


MODEL_KEYS = ("target", "draft.model", "data.dataset")  # model or data specs: a path and a link to it are the same


def changed_settings(saved: dict, current: dict, keys: tuple[str, ...]) -> dict[str, list]:
    """{key: [saved value, current value]} for the ``keys`` that differ (a model or data path and
    another path to the same folder do not: ``loading.same_model``)."""

    def differs(key: str) -> bool:
        old, new = saved.get(key), current[key]
        if key in MODEL_KEYS and isinstance(old, str) and isinstance(new, str):
            return not same_model(old, new)
        return old != new

    return {k: [saved.get(k), current[k]] for k in keys if differs(k)}


def describe_changes(changes: dict[str, list]) -> str:
    return ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items())


def resume_point(run_dir: Path, cfg: DistillConfig, record: bool = True) -> tuple[int, Path] | None:
    """(step, folder) of the last complete checkpoint to resume from, after checking the config is compatible.

    A changed training setting is refused unless ``cfg.resume == "force"``; forced, it is appended to
    ``RESUME_LOG`` in the run folder when ``record`` (the main process).
    """
    found = checkpoint_dirs(run_dir) if run_dir.is_dir() else []
    if not found:
        return None
    step, path = found[-1]
    saved = flat_settings(json.loads((path / MARKER).read_text())["config"])
    current = flat_settings(cfg)
    fixed = changed_settings(saved, current, RESUME_KEYS)
    if fixed:
        raise DraftsmithError(
            f"{run_dir} holds a run made with a different config ({describe_changes(fixed)}); "
            "use another output_dir, or the same settings to resume"
        )
    if step >= cfg.optim.max_steps:
        raise DraftsmithError(
            f"{run_dir} already reached step {step} (optim.max_steps={cfg.optim.max_steps}); raise optim.max_steps "
            "to train further or use another output_dir"
        )
    training = changed_settings(saved, current, TRAINING_KEYS)
    if training and cfg.resume != "force":
        raise DraftsmithError(
            f"{run_dir} was trained up to step {step} with other settings ({describe_changes(training)}); "
            "use the same settings, another output_dir, or resume=force to continue with the new ones"
        )
    if training and record:
        with (run_dir / RESUME_LOG).open("a") as f:
            f.write(json.dumps({"step": step, "changed": training}) + "\n")
    return step, path
