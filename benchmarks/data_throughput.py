"""Answer-generation throughput for dataset building: the continuous-batching generator against
transformers ``generate`` at the same batch sizes, side by side in one run, on the default target.

Both get the same prompts (the built-in training prompts, repeated to fill the cell), the same
max_new_tokens and EOS ids, greedy, in float32. ``generate`` gets the prompts in the same
length-sorted order, in consecutive batches of the given size (left-padded, as it requires); each of
its batches runs until its longest answer is done. Tokens counted are the answers' own (up to and
including the first EOS), for both. The two run interleaved, alternating which goes first, and the
median tokens/s over repeats is reported. ``generate`` runs on a separate model object loaded the
same way, so nothing the generator does to its model can affect it.

Run: .venv/bin/python benchmarks/data_throughput.py [--sizes 1,16,64,128 --prompts 2,32,96,128 --max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from common import default_target, median, save

from draftsmith.specdec.continuous import Batching, continuous_generate
from draftsmith.specdec.measure import machine
from draftsmith.specdec.prompts import encode_chat, read_prompts

BUILTIN = Path(__file__).parents[1] / "distill" / "data" / "prompts.jsonl"
CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx512f", "avx2")


def cpu_flags() -> dict[str, bool]:
    """Which of the instruction sets that matter for matrix kernels this CPU reports."""
    reported = machine.cpu_flags()
    return {flag: flag in reported for flag in CPU_FLAGS}


def answer_tokens(row: list[int], eos: frozenset[int]) -> list[int]:
    """A ``generate`` row's answer: up to and including the first EOS (the rest is padding)."""
    for i, token in enumerate(row):
        if token in eos:
            return row[: i + 1]
    return row


@torch.inference_mode()
def hf_batched(model, prompts: list[list[int]], batch_size: int, max_new_tokens: int, eos: frozenset[int]):
    """``generate`` over length-sorted prompts in consecutive left-padded batches: (answers, seconds)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    pad = sorted(eos)[0]
    start = time.perf_counter()
    for at in range(0, len(order), batch_size):
        chunk = order[at : at + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
        )
        for row, i in enumerate(chunk):
            answers[i] = answer_tokens(out[row, width:].tolist(), eos)
    return answers, time.perf_counter() - start


def ours(model, prompts, batch_size, max_new_tokens, eos):
    start = time.perf_counter()
    answers, _ = continuous_generate(model, prompts, max_new_tokens, Batching(eos_ids=eos, batch_size=batch_size))
    return answers, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,16,64,128")
    parser.add_argument("--prompts", default="2,32,96,128", help="prompts per cell, one per size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a CPU shared with other jobs, OpenMP threads wait on each other at "
        "every barrier; with 2 threads on 2 busy cores decoding ran 10x slower than with 1)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    sizes = [int(s) for s in args.sizes.split(",")]
    counts = [int(s) for s in args.prompts.split(",")]
    torch.manual_seed(0)
    model, tokenizer, eos = default_target()
    reference, _, _ = default_target()  # a separate, unmodified object for transformers
    pool = [encode_chat(tokenizer, p.turns[0]) for p in read_prompts(BUILTIN)]
    n = args.max_new_tokens
    ours(model, pool[:2], 2, 4, eos)  # warm-up
    hf_batched(reference, pool[:2], 2, 4, eos)
    cells = {}
    for size, count in zip(sizes, counts, strict=True):
        prompts = (pool * (count // len(pool) + 1))[:count]
        runs = {"continuous": [], "generate": []}
        same = []
        for rep in range(args.repeats):
            contenders = [("continuous", model, ours), ("generate", reference, hf_batched)]
            outputs = {}
            for name, m, fn in contenders if rep % 2 == 0 else contenders[::-1]:
                answers, seconds = fn(m, prompts, size, n, eos)
                runs[name].append(sum(len(a) for a in answers) / seconds)
                outputs[name] = answers
            same.append(sum(a == b for a, b in zip(outputs["continuous"], outputs["generate"], strict=True)))
        cells[size] = {
            "prompts": count,
            "continuous_tokens_per_s": median(runs["continuous"]),
            "generate_tokens_per_s": median(runs["generate"]),
            "runs": runs,
            "rows_identical_to_generate": min(same),
        }
        c = cells[size]
        print(
            f"batch {size:>3} ({count:>3} prompts): continuous {c['continuous_tokens_per_s']:7.1f} t/s  "
            f"generate {c['generate_tokens_per_s']:7.1f} t/s  identical rows {c['rows_identical_to_generate']}/{count}",
            flush=True,
        )
    report(cells, sizes, n, eos, {"before": load_before, "after": os.getloadavg()})


def report(cells: dict, sizes: list[int], max_new_tokens: int, eos: frozenset[int], load: dict) -> None:
    base = cells[sizes[0]]["continuous_tokens_per_s"]
    print(f"\n| batch | prompts | continuous t/s | generate t/s | continuous / generate | vs batch {sizes[0]} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        c = cells[size]
        c["continuous_over_generate"] = c["continuous_tokens_per_s"] / c["generate_tokens_per_s"]
        c["continuous_over_first_size"] = c["continuous_tokens_per_s"] / base
        print(
            f"| {size} | {c['prompts']} | {c['continuous_tokens_per_s']:.1f} | {c['generate_tokens_per_s']:.1f} | "
            f"{c['continuous_over_generate']:.2f} | {c['continuous_over_first_size']:.2f} |"
        )
    save(
        "data_throughput",
        {
            "dtype": "float32",
            "torch_threads": torch.get_num_threads(),
            "cpu_flags": cpu_flags(),
            "cpu_count": os.cpu_count(),
            "load_average_1_5_15_min": load,  # other jobs on the machine: ratios are what carries over
            "max_new_tokens": max_new_tokens,
            "eos_ids": sorted(eos),
            "greedy": True,
            "sizes": cells,
        },
    )


if __name__ == "__main__":
    main()
