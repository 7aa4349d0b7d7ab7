"""Shared set-up for the benchmarks: the default target, prompts, and a side-by-side timer."""

from __future__ import annotations

import json
import statistics
import time
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
