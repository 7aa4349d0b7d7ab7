"""The target-only baseline: timed once over a prompt set, then shared by every draft measured against it.

``evaluate_pair`` times the target beside each draft unless it is given a baseline whose runs are the
ones it would time (same prompts, length, sampling, seeds, batching, cache kind and compile mode):
then the target's recorded runs and outputs stand in for its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.specdec.compiled import resolve_compile
from draftsmith.specdec.measure.runs import PairRun, run_repeats, warm_up, warm_up_sizes
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.measure.tally import Tally


@dataclass
class Baseline:
    """Target-only runs over a prompt set, timed once (``measure_baseline``) and shared by the drafts
    ``evaluate_pair`` measures against it: one Tally per repeat, its stats and outputs in the order in
    which a repeat visits the batches. ``settings``: what the runs depend on (``baseline_settings``)."""

    settings: dict
    repeats: list[Tally]


def baseline_settings(settings: MeasureSettings) -> dict:
    """What target-only runs depend on: prompts, length, sampling, seeds, batching and cache kind."""
    options = settings.options
    sampling = options.sampling
    return {
        "prompts": [(p.id, p.category, p.turns, p.text) for p in settings.prompts],
        "max_new_tokens": settings.max_new_tokens,
        "sampling": (sampling.temperature, sampling.top_k, sampling.top_p),
        "seed": settings.seed,
        "batch_size": settings.batch_size,
        "cache_kind": options.cache_kind,
        "compile": options.compile,
    }


def measure_baseline(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: MeasureSettings
) -> Baseline:
    """Time the target-only decoder over ``settings.prompts`` once, as ``evaluate_pair`` would beside a
    draft (same seeds, batches and turns; ``settings.options``: its sampling and cache kind), for
    several drafts to share."""
    options = dataclasses.replace(settings.options, compile=resolve_compile(settings.options.compile, target))
    settings = dataclasses.replace(settings, options=options)
    pair = PairRun(target, None, tokenizer, settings)
    first = settings.prompts[0]
    warm_up(pair, pair.encode(first, first.turns[0]), warm_up_sizes(settings, options.compile))
    runs, _ = run_repeats(pair)
    return Baseline(baseline_settings(settings), [r["target"] for r in runs])


def usable_baseline(baseline: Baseline | None, settings: MeasureSettings) -> Baseline | None:
    """``baseline`` when its runs are the ones a measurement under ``settings`` would time, else None
    (time them there)."""
    if baseline is None or baseline.settings != baseline_settings(settings):
        return None
    if len(baseline.repeats) != settings.repeats:
        return None
    return baseline
