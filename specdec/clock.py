"""Timing and model modes: the decoders time their phases with it, and measurements build on it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Clock:
    """Wall-clock timer that waits for the device, so GPU time is charged to the right phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.start = self.last = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap (or since the clock was made)."""
        now = self.now()
        elapsed, self.last = now - self.last, now
        return elapsed

    def total(self) -> float:
        """Seconds since the clock was made."""
        return self.now() - self.start


@contextmanager
def eval_mode(*models: torch.nn.Module) -> Iterator[None]:
    """Put ``models`` in eval mode for the block, then give each back the mode it had."""
    modes = [model.training for model in models]
    for model in models:
        model.eval()
    try:
        yield
    finally:
        for model, training in zip(models, modes, strict=True):
            model.train(training)
