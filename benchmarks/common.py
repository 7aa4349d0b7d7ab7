"""Shared set-up for the benchmarks: the default target, prompts, and a side-by-side timer."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from specdec.prompts import encode_chat, read_prompts

PROMPTS = Path(__file__).parent / "prompts" / "mixed.jsonl"


def default_target(device: str = "cpu"):
    """(model, tokenizer, eos ids) of the embedded default target in float32."""
    model = load_model(DEFAULT_TARGET, torch.device(device), torch.float32)
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


def hf_generate(model, ids, max_new_tokens, eos, assistant=None, gamma=4):
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "eos_token_id": sorted(eos),
        "pad_token_id": sorted(eos)[0],
    }
    if assistant is not None:
        kwargs.update(assistant_model=assistant, num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant")
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    return out[0, len(ids) :].tolist()


def save(name: str, result: dict) -> None:
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwritten: {out}")
