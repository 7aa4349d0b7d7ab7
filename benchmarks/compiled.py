"""Eager vs compiled decoding, side by side in one run: the target's single-token step, the draft's step,
verification forwards at gamma 1-8 (each with c and v as eval reports them), and the end-to-end
speedup of the default pair (the default target and its first 2 layers as draft) as ``draftsmith
eval`` measures it, greedy, with compile time reported apart.

Steps are timed on one sequence over a real prompt's cache: a forward, then a rollback to the
prompt, the median of ``--steps`` after a warm-up (compilation and, on CUDA, graph capture).

Run: .venv/bin/python benchmarks/compiled.py [--device cuda] [--dtype bfloat16] [--prompts 2]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import PROMPTS, default_target, save

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.cache import default_cache_kind
from draftsmith.specdec.clock import Clock
from draftsmith.specdec.compiled import CompiledStream, compile_mode
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat, read_prompts
from draftsmith.specdec.stream import ModelStream

MODES = ("eager", "compiled")


@torch.inference_mode()
def step_seconds(model, role: str, compiled: bool, context: list[int], widths: list[int], steps: int) -> dict:
    """Median seconds of a forward over each of ``widths`` tokens on top of ``context``, on one sequence."""
    device = model.device
    capacity = len(context) + max(widths) + 8
    if compiled:
        stream = CompiledStream(model, 1, capacity, role=role)
    else:
        stream = ModelStream(model, 1, capacity, default_cache_kind(device), row_exact=role == "target")
    prompt = torch.tensor([context], device=device)
    stream.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), logits_to_keep=1)
    keep = torch.tensor([len(context)], device=device)
    clock, seconds = Clock(device), {}
    for width in widths:
        x = torch.full((1, width), 7, dtype=torch.long, device=device)
        valid = torch.ones_like(x, dtype=torch.bool)
        times = []
        for _ in range(steps + 3):  # three warm-up forwards: compilation, graph capture, one more
            clock.lap()
            stream.forward(x, valid, logits_to_keep=1 if role == "draft" else 0)
            times.append(clock.lap())
            stream.rollback(keep)
        seconds[width] = statistics.median(times[3:])
    return seconds


def step_table(target, draft, context: list[int], gammas: list[int], steps: int) -> dict:
    """Per mode: target step, draft step, verification per gamma (ms), with c and v per gamma."""
    table = {}
    for mode in MODES:
        compiled = mode == "compiled"
        target_s = step_seconds(target, "target", compiled, context, [1] + [g + 1 for g in gammas], steps)
        draft_s = step_seconds(draft, "draft", compiled, context, [1], steps)[1]
        table[mode] = {
            "target_step_ms": target_s[1] * 1e3,
            "draft_step_ms": draft_s * 1e3,
            "c": draft_s / target_s[1],
            "verify_ms": {g: target_s[g + 1] * 1e3 for g in gammas},
            "v": {g: target_s[g + 1] / target_s[1] for g in gammas},
        }
    return table


def end_to_end(target, draft, tokenizer, eos, prompts, gamma: int, max_new_tokens: int, repeats: int) -> dict:
    """``evaluate_pair``'s report (greedy) in each mode; compile time is its warm-up, apart from tokens/s."""
    keys = (
        "speedup",
        "predicted_speedup",
        "efficiency",
        "target_tokens_per_s",
        "spec_tokens_per_s",
        "mean_accepted_tokens",
        "acceptance_rate",
        "cost_ratio_c",
        "verify_ratio_v",
        "greedy_match",
        "compile_s",
        "compiled_graphs",
        "verify_widths",
    )
    result = {}
    for mode in MODES:
        report = evaluate_pair(
            target,
            draft,
            tokenizer,
            MeasureSettings(
                prompts,
                options=DecodeOptions(gamma=gamma, compile=mode == "compiled"),
                max_new_tokens=max_new_tokens,
                eos_ids=eos,
                repeats=repeats,
                progress=False,
            ),
        ).to_json()
        result[mode] = {key: report[key] for key in keys}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    parser.add_argument("--gammas", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--gamma", type=int, default=4, help="gamma of the end-to-end runs (default: 4)")
    parser.add_argument("--steps", type=int, default=15, help="timed forwards per shape (default: 15)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, tokenizer, eos = default_target(args.device, dtype)
    draft = truncate_target(target, 2)
    prompts = read_prompts(PROMPTS)[: args.prompts]
    gammas = [int(g) for g in args.gammas.split(",")]

    steps = step_table(target, draft, encode_chat(tokenizer, prompts[0].turns[0]), gammas, args.steps)
    print(f"{'':<10}{'target ms':>10}{'draft ms':>10}{'c':>7}   verify ms (v) at gamma " + " ".join(map(str, gammas)))
    for mode, row in steps.items():
        verify = " ".join(f"{row['verify_ms'][g]:.1f}({row['v'][g]:.2f})" for g in gammas)
        print(f"{mode:<10}{row['target_step_ms']:>10.2f}{row['draft_step_ms']:>10.2f}{row['c']:>7.3f}   {verify}")
    ratio = {key: steps["eager"][key] / steps["compiled"][key] for key in ("target_step_ms", "draft_step_ms")}
    print(f"compiled is {ratio['target_step_ms']:.2f}x (target step), {ratio['draft_step_ms']:.2f}x (draft step) eager")

    e2e = end_to_end(target, draft, tokenizer, eos, prompts, args.gamma, args.max_new_tokens, args.repeats)
    for mode, row in e2e.items():
        compile_note = (
            f", compile {row['compile_s']:.1f} s ({row['compiled_graphs']} graphs)" if row["compile_s"] else ""
        )
        print(
            f"{mode:<10}gamma {args.gamma}: target {row['target_tokens_per_s']:.1f} t/s, spec "
            f"{row['spec_tokens_per_s']:.1f} t/s, speedup {row['speedup']:.2f} (predicted "
            f"{row['predicted_speedup']:.2f}), tau {row['mean_accepted_tokens']:.2f}, c {row['cost_ratio_c']:.3f}, "
            f"v {row['verify_ratio_v']:.2f}, greedy identical {row['greedy_match']:.0%}{compile_note}"
        )
    save(
        "compiled" if device.type == "cpu" else f"compiled_{device.type}",
        {
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "compile_mode": compile_mode(device),
            "settings": vars(args),
            "steps": steps,
            "end_to_end": e2e,
        },
    )


if __name__ == "__main__":
    main()
