"""Shared set-up for the benchmarks: the default target, prompts, and a side-by-side timer."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.measure.machine import machine
from draftsmith.specdec.prompts import encode_chat, read_prompts

PROMPTS = Path(__file__).parents[1] / "distill" / "data" / "eval_prompts.jsonl"  # held out from training
RESULTS = Path(__file__).parent / "results"  # every benchmark's JSON (``save``) and plots


def default_target(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer, eos ids) of the embedded default target (float32 unless asked)."""
    model = load_model(DEFAULT_TARGET, torch.device(device), dtype)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    return model, tokenizer, eos_token_ids(model, tokenizer)


def prompt_ids(tokenizer, limit: int | None = None) -> list[list[int]]:
    return [encode_chat(tokenizer, p.turns[0]) for p in read_prompts(PROMPTS)[:limit]]


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


@dataclass
class Repeat:
    """One pass of every prompt through every decoder, back to back.

    tokens_per_s: {run: tokens/s over the pass}; outputs: {(run, prompt index): tokens};
    accepted / proposed: {run: draft tokens over the pass} (0 for a target-only decoder).
    """

    tokens_per_s: dict[str, float]
    outputs: dict[tuple[str, int], list[int]]
    accepted: dict[str, int]
    proposed: dict[str, int]

    def alpha(self) -> dict[str, float]:
        return {k: self.accepted[k] / p for k, p in self.proposed.items() if p}


def interleaved(runs: dict[str, Callable], prompts: list[list[int]], repeats: int) -> Iterator[Repeat]:
    """Every ``runs`` decoder (prompt ids -> (outputs, stats)) on each prompt in turn, one warm-up call
    each first; yields a ``Repeat`` per pass, so that every run of a pass saw the same minutes."""
    for fn in runs.values():
        fn(prompts[0])
    for _ in range(repeats):
        seconds, tokens = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0)
        accepted, proposed, outputs = dict.fromkeys(runs, 0), dict.fromkeys(runs, 0), {}
        for i, ids in enumerate(prompts):
            for name, fn in runs.items():
                (out, stats), elapsed = timed(fn, ids)
                seconds[name] += elapsed
                tokens[name] += len(out[0])
                outputs[name, i] = out[0]
                accepted[name] += stats.accepted
                proposed[name] += stats.proposed
        yield Repeat({k: tokens[k] / seconds[k] for k in runs}, outputs, accepted, proposed)


def median(xs):
    return statistics.median(xs)


def tokens_per_s(run: Path) -> float:
    """A distillation run's training tokens/s over its last logged window (metrics.jsonl)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return records[-1]["tokens_per_s"]


def save(name: str, result: dict) -> None:
    """Write ``results/<name>.json`` with the machine it was measured on."""
    result = {**result, "machine": machine()}
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(json.dumps(result, indent=2))
    partial.replace(out)  # a run stopped while writing keeps the file it had
    print(f"\nwritten: {out}")
