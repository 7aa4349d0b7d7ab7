"""What a measurement of a (target, draft) pair runs, as one object passed down whole."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import Prompt


@dataclass(frozen=True)
class MeasureSettings:
    """Settings of one measurement (``pair.evaluate_pair``, the engine comparison), the same for the
    speculative decoder and the target-only baseline.

    prompts: what is decoded; every turn of a multi-turn prompt, later turns seeing the target's answers.
    options: how the speculative decoder decodes; its sampling and cache kind are the baseline's too.
    max_new_tokens: new tokens per turn, at most (both decoders stop at ``eos_ids`` before that).
    eos_ids: token ids that end an answer.
    seed: sampling seed of the first repeat; repeat r draws with ``seed + r``, the same for both decoders.
    repeats: timed passes over the prompts; the report takes the median.
    batch_size: prompts decoded together (batches never mix categories).
    progress: show a progress bar.
    """

    prompts: list[Prompt]
    options: DecodeOptions = DecodeOptions()
    max_new_tokens: int = 128
    eos_ids: frozenset[int] = frozenset()
    seed: int = 0
    repeats: int = 3
    batch_size: int = 1
    progress: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise DraftsmithError(f"batch size must be >= 1, got {self.batch_size}")
        if self.repeats < 1:
            raise DraftsmithError(f"repeats must be >= 1, got {self.repeats}")


def measuring_dtype(asked: str | None, resolved: torch.dtype, batch_size: int) -> torch.dtype:
    """The dtype a pair is measured in at ``batch_size``: ``resolved`` (the device's default, or what
    was ``asked``), except float32 at batch > 1 when no dtype was asked: row-exact decoding, which keeps
    greedy output the target's in 16-bit dtypes, covers batch 1 only."""
    if asked is None and batch_size > 1 and resolved != torch.float32:
        return torch.float32
    return resolved
