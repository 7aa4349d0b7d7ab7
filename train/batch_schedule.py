"""The gamma to draft at each batch size: chosen from measurements, and written as serving engines read it.

Drafting pays less as the batch grows (the verification pass is no longer almost free once the
target's step is compute-bound), so the gamma that is fastest at batch 1 can be slower than the
target alone at batch 16. ``eval-run --batch-sizes`` and ``eval --batch-sizes`` measure the fastest
gamma at each size (``speedup.measure_batch_size``); where the best measured speedup stays below
1.0 the size gets gamma 0, drafting off.

The schedule is vLLM's ``num_speculative_tokens_per_batch_size`` (vLLM 0.32 and later, a key of the
speculative config): inclusive batch-size ranges ``(first, last, gamma)``, sorted, not overlapping,
the first starting at 1, gamma >= 0 (vLLM's ``validate_and_normalize_dynamic_sd_schedule``). vLLM
gives a batch size past the last range the last range's gamma, and caps every gamma at the config's
``num_speculative_tokens`` (``build_dynamic_sd_schedule_lookup``). ``schedule_ranges`` follows the
same rule between measured sizes: a measured size's gamma holds up to the next measured size.

A published draft carries the schedule in ``generation_config.json``, in its ``draftsmith`` section
under the same key (transformers ignores the section and keeps ``num_assistant_tokens``, the gamma
of batch 1); ``draftsmith eval --draft FOLDER --batch-size B`` reads it from there.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from draftsmith.distill.drafts.kind import GENERATION_CONFIG
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"  # vLLM's name, in its speculative config
SECTION = "draftsmith"  # generation_config.json's section that transformers ignores

Ranges = list[tuple[int, int, int]]


def parse_batch_sizes(text: str, option: str = "--batch-sizes") -> list[int]:
    """``1,4,16`` as sorted batch sizes, 1 always among them (the schedule starts at 1)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise DraftsmithError(f"{option} takes batch sizes separated by commas (e.g. 1,4,16), got {text!r}") from err
    if not sizes or any(size < 1 for size in sizes):
        raise DraftsmithError(f"{option} must all be >= 1 (e.g. 1,4,16), got {text!r}")
    return sorted({1, *sizes})


def gamma_that_pays(gamma: int, speedup: float | None) -> int:
    """``gamma`` when drafting at it measured at least as fast as the target alone, else 0 (drafting off)."""
    if speedup is None or math.isnan(speedup) or speedup < 1.0:
        return 0
    return gamma


def schedule_ranges(gamma_by_size: dict[int, int]) -> Ranges:
    """vLLM's ``num_speculative_tokens_per_batch_size`` for gammas measured at some batch sizes.

    Each measured size's gamma holds from it up to the size before the next measured one; sizes
    below the smallest measured one take its gamma, so the first range starts at 1. Neighbouring
    ranges with the same gamma are merged. The last range is the largest measured size alone and
    vLLM carries its gamma to every larger batch: ``{1: 3, 4: 2, 16: 0}`` gives
    ``[(1, 3, 3), (4, 15, 2), (16, 16, 0)]``.
    """
    if not gamma_by_size:
        raise DraftsmithError("no batch size was measured: nothing to build a gamma schedule from")
    sizes = sorted(gamma_by_size)
    if sizes[0] < 1 or any(gamma_by_size[size] < 0 for size in sizes):
        raise DraftsmithError(f"batch sizes must be >= 1 and gammas >= 0, got {gamma_by_size}")
    ranges: Ranges = []
    for i, size in enumerate(sizes):
        first = 1 if i == 0 else size
        last = sizes[i + 1] - 1 if i + 1 < len(sizes) else size
        gamma = gamma_by_size[size]
        if ranges and ranges[-1][2] == gamma:
            ranges[-1] = (ranges[-1][0], last, gamma)
        else:
            ranges.append((first, last, gamma))
    return ranges


def gamma_for_batch(ranges: Ranges, batch_size: int) -> int:
    """The gamma ``ranges`` give ``batch_size``, as vLLM reads them (past the last range: its gamma)."""
    for first, last, gamma in ranges:
        if first <= batch_size <= last:
            return gamma
    return ranges[-1][2]


def engine_gamma(ranges: Ranges, gamma: int) -> int:
    """``num_speculative_tokens`` for a config that carries ``ranges``: vLLM caps every gamma of the
    schedule at it, so it is the largest of them, and ``gamma`` (batch 1's chain) when none drafts."""
    return max([gamma, *(g for _, _, g in ranges)])


def write_schedule(folder: Path, ranges: Ranges) -> None:
    """Put ``ranges`` into the ``draftsmith`` section of ``folder``'s ``generation_config.json``."""
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        raise DraftsmithError(f"{path} is missing: the draft's export wrote no generation config to carry its gammas")
    config = json.loads(path.read_text())
    config[SECTION] = {**config.get(SECTION, {}), SCHEDULE_KEY: [list(entry) for entry in ranges]}
    write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_schedule(folder: Path) -> Ranges | None:
    """The schedule a published ``folder`` carries (``write_schedule``), or None."""
    path = Path(folder) / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    entries = config.get(SECTION, {}).get(SCHEDULE_KEY)
    return None if entries is None else [tuple(entry) for entry in entries]


def format_ranges(ranges: Ranges) -> str:
    """The schedule as a Python literal, as a vLLM speculative config takes it."""
    return repr([tuple(entry) for entry in ranges])
