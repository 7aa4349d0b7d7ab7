"""Every draft of a run measured for real: ``initial/`` and each complete checkpoint, at each temperature.

The report (``speedup_report.json``, ``.md``, ``speedup.png``) and ``best.json`` are rewritten after
each draft, so an interruption loses nothing; drafts already measured with the same settings are
not measured again. Every draft is measured side by side with the target alone: its speedup, c and v
come from runs of the two decoders interleaved batch by batch (``speedup.measure_draft``). Nothing is
timed once and shared between drafts: on a shared machine a slow or fast minute would then land in
every later ratio, and a checkpoint's rank would follow the machine's load instead of its weights.
The best draft is then measured once more (``speedup.confirm_draft``): the figure it was chosen by
is the highest of several noisy ones, and a measurement after the choice is not biased by it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.distill.drafts import kind_of_folder, load_draft
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import eos_token_ids, resolve_device, resolve_dtype
from draftsmith.specdec.matmul import use_column_products
from draftsmith.specdec.measure import machine
from draftsmith.specdec.measure.settings import MeasureSettings, measuring_dtype
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import read_prompts
from draftsmith.specdec.sampling import SamplingParams
from draftsmith.specdec.tree import TreeShape
from draftsmith.train import checkpoint, speedup
from draftsmith.train.config import DistillConfig
from draftsmith.train.models import RunModels


@dataclass(frozen=True)
class RunEvalSettings:
    """What ``draftsmith eval-run`` measures of a run, checked when made.

    prompts_file: the prompts (a JSONL file), of which the first ``limit`` are used (None: all).
    gammas: chain gammas whose speedup is predicted; the best one is measured.
    temperatures: each draft is measured at each; the first one chooses the best draft.
    trees: token-tree shapes measured beside the chain gammas (batch 1); the fastest is chosen over the
        chain when it measured faster (``speedup.choose_tree``).
    max_new_tokens, repeats: new tokens per prompt, and timed repeats per measurement.
    force: measure again drafts already in the report.
    device, dtype: where and in what the pair runs (None: the default of the device).
    draft_vocab_size: decode with the draft's head cut to the N tokens most frequent in the training
        answers (0: the full head); None: the cut the run trained with (its ``draft.vocab``).
    pace: the measurement at the best gamma pauses drafting for a sequence where it does not pay
        (``DecodeOptions.pace``), as draftsmith's decoder does by default.
    draft_options: the draft kind's decode options (``DecodeOptions.draft_options``), checked by the kind.
    progress: show progress bars.
    batch_sizes: the batch sizes the best draft's gamma is chosen at (1 first, always: its own
        measurement); each larger one is measured beside the target alone at that size
        (``speedup.measure_batch_size``), in float32 unless ``dtype`` was given (``measuring_dtype``).
    """

    prompts_file: str | Path
    gammas: list[int]
    temperatures: list[float] = field(default_factory=lambda: [0.0])
    trees: tuple[TreeShape, ...] = ()
    max_new_tokens: int = 64
    limit: int | None = None
    repeats: int = 1
    force: bool = False
    device: str | None = None
    dtype: str | None = None
    draft_vocab_size: int | None = None
    pace: bool = True
    draft_options: dict = field(default_factory=dict)
    progress: bool = True
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        if not self.batch_sizes or self.batch_sizes[0] != 1 or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise DraftsmithError(f"batch sizes must be increasing and start at 1, got {self.batch_sizes}")
        if any(g < 1 for g in self.gammas):
            raise DraftsmithError(f"gammas must be >= 1, got {self.gammas}")
        if self.limit is not None and self.limit < 1:
            raise DraftsmithError(f"--limit must be >= 1 (prompts to use; leave it out for all), got {self.limit}")
        if self.max_new_tokens < 1:
            raise DraftsmithError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")


def evaluate_run(run_dir: Path, settings: RunEvalSettings, models: RunModels | None = None) -> dict:
    """Measure the drafts of ``run_dir`` not yet in its report; return the report (``best`` names the best draft).

    models: the run's config and target when the caller has them loaded (``quickstart``)."""
    models = models or RunModels.for_run(run_dir)
    cfg = models.cfg
    draft_vocab_size = cfg.draft.vocab if settings.draft_vocab_size is None else settings.draft_vocab_size
    drafts = checkpoint.drafts_of_run(run_dir)
    if not drafts:
        raise DraftsmithError(f"{run_dir} has no checkpoints yet (no initial/ or checkpoint-*/ folders)")
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    target = models.target(device, dtype)
    matmul = "columns" if use_column_products(target) else "linear"  # decided here, so the report names it
    tokenizer = models.tokenizer
    eos = eos_token_ids(target, tokenizer)
    ranking = draft_vocab.load_ranking(run_dir, draft_vocab_size) if draft_vocab_size else None
    report = start_report(run_dir, cfg, settings, dtype, draft_vocab_size, matmul)
    options = DecodeOptions(pace=settings.pace, draft_options=settings.draft_options)
    measure = MeasureSettings(
        read_prompts(settings.prompts_file)[: settings.limit],
        max_new_tokens=settings.max_new_tokens,
        eos_ids=eos,
        seed=cfg.seed,
        repeats=settings.repeats,
        progress=settings.progress,
        options=options,
    )

    def load(folder: Path, verifier: torch.nn.Module = target) -> torch.nn.Module:
        draft = load_draft(str(folder), verifier, device, verifier.dtype)
        if ranking and kind_of_folder(folder).cuts_head:
            draft = draft_vocab.SubsetHeadDraft(draft, ranking, eos)
        return draft

    for name, step, folder in drafts:
        for temp in settings.temperatures:
            if str(temp) in report["results"].get(name, {}):
                continue
            draft = load(folder)
            print(f"measuring {name} at temperature {temp}")
            result = speedup.measure_draft(
                target, draft, tokenizer, at_temperature(measure, temp), settings.gammas, trees=settings.trees
            )
            check_measured(result, name, settings.max_new_tokens)
            report["results"].setdefault(name, {})[str(temp)] = {"step": step, **result.to_json()}
            speedup.write_report(run_dir, report)
    best = speedup.write_report(run_dir, report)
    chosen = report["results"][best][str(settings.temperatures[0])] if best is not None else {}
    if best is not None and "confirmation" not in chosen:
        print(f"{best} is the best draft: timing it once more beside the target, for its model card")
        folder = next(folder for name, _, folder in drafts if name == best)
        at = at_temperature(measure, settings.temperatures[0])
        chosen["confirmation"] = speedup.confirm_draft(
            target, load(folder), tokenizer, at, chosen["best_gamma"], chosen.get("best_tree")
        )
        best = speedup.write_report(run_dir, report)
    if best is not None:
        folder = next(folder for name, _, folder in drafts if name == best)
        at = at_temperature(measure, settings.temperatures[0])
        run = BatchSizeRun(at, models, device, dtype, lambda verifier: load(folder, verifier))
        by_batch_size(run_dir, report, best, settings, run)
    report["best"] = best
    return report


@dataclass(frozen=True)
class BatchSizeRun:
    """How the best draft is measured at larger batch sizes: the settings at the first temperature, the
    run's models (a target per dtype), the device and the dtype of batch 1, and ``load``, the draft
    for a given target."""

    settings: MeasureSettings
    models: RunModels
    device: torch.device
    dtype: torch.dtype
    load: Callable[[torch.nn.Module], torch.nn.Module]


def by_batch_size(run_dir: Path, report: dict, best: str, settings: RunEvalSettings, run: BatchSizeRun) -> None:
    """The best draft's gamma at each of ``settings.batch_sizes`` (``by_batch_size`` in its result at the
    first temperature) and vLLM's ranges of them (``gamma_by_batch_size``): batch 1 from its own
    measurement, each larger size measured unless already in the report; the report rewritten."""
    chosen = report["results"][best][str(settings.temperatures[0])]
    entries = chosen.setdefault("by_batch_size", {})
    under = {"dtype": report["dtype"], "matmul": report["matmul"]}
    entries["1"] = speedup.batch_one_entry(chosen, len(run.settings.prompts), under)
    for size in settings.batch_sizes[1:]:
        if str(size) in entries:
            continue
        dtype = measuring_dtype(settings.dtype, run.dtype, size)
        target = run.models.target(run.device, dtype)
        use_column_products(target)  # a target cast to another dtype times its own product form
        print(f"{best}: choosing its gamma at batch size {size} ({str(dtype).removeprefix('torch.')})")
        entries[str(size)] = speedup.measure_batch_size(
            target, run.load(target), run.models.tokenizer, run.settings, settings.gammas, size
        )
        speedup.write_report(run_dir, report)
    chosen["gamma_by_batch_size"] = speedup.schedule_of(entries)
    speedup.write_report(run_dir, report)


def start_report(
    run_dir: Path,
    cfg: DistillConfig,
    settings: RunEvalSettings,
    dtype: torch.dtype,
    draft_vocab_size: int,
    matmul: str,
) -> dict:
    """The run's report so far, or a new one when it was measured under other settings (or ``force``),
    with the settings of this call. ``matmul``: the form of the target's few-row products
    (``specdec.matmul``), a setting like the dtype: drafts measured in the other form are measured again."""
    measured_under = {
        "prompts": str(settings.prompts_file),
        "gammas": settings.gammas,
        "max_new_tokens": settings.max_new_tokens,
        "limit": settings.limit,
        "dtype": str(dtype).removeprefix("torch."),
        "matmul": matmul,
        "draft_vocab": draft_vocab_size,
        "trees": [t.text for t in settings.trees],
        "repeats": settings.repeats,
        "pace": settings.pace,
        "draft_options": {key: settings.draft_options[key] for key in sorted(settings.draft_options)},
    }
    report = speedup.load_report(run_dir)
    changed = any(report.get(k) != v for k, v in measured_under.items())
    # A report from before every draft was timed beside its own baseline is measured again.
    if settings.force or changed or report.get("side_by_side") is not True:
        report = {"results": {}, "side_by_side": True}
    report.update(
        measured_under,
        run=str(run_dir),
        target=cfg.target,
        temperatures=settings.temperatures,
        hardware=machine.describe(),
        machine=machine.machine(),
    )
    return report


def at_temperature(settings: MeasureSettings, temperature: float) -> MeasureSettings:
    """``settings`` with sampling at ``temperature`` (the settings object measures greedily)."""
    options = dataclasses.replace(settings.options, sampling=SamplingParams(temperature))
    return dataclasses.replace(settings, options=options)


def check_measured(result: speedup.DraftMeasurement, name: str, max_new_tokens: int) -> None:
    """Refuse a measurement without figures (no decoding rounds to time) before anything is written."""
    figures = (result.speedup, result.acceptance_rate, result.cost_ratio_c)
    if any(x is None or math.isnan(x) for x in figures):
        raise DraftsmithError(
            f"{name}: nothing was measured at --max-new-tokens {max_new_tokens} (no speculative rounds to time); "
            "raise --max-new-tokens (16 or more) or use more prompts; nothing was written for it"
        )
