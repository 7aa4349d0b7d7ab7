"""Distillation throughput, side by side: the draft's head full or cut, the teacher live or cached.

Four runs of the same config (configs/smollm2-135m.yaml: default target, 2-layer draft, forward
KL), in float32, set up together and stepped in turn, one optimizer step each per round, so every
arm meets the same load on a shared machine and the same batch at the same step:
  full head             the draft's 49 k-way head, the target run as teacher on every batch
  cut head              train_draft_vocab=N: logits, softmax and loss over the N most frequent tokens
  full head + cache     teacher_cache=true: the target's top-k log-probs, written once, read back
  cut head + cache      both
Each step is the trainer's own ``train_step`` (forward, loss, backward, optimizer), timed alone;
the first round is a warm-up. Prints the median tokens/s (loss tokens per second) of each arm and
the median of its per-round ratio to the full head with the live teacher. The target's answers
and the teacher cache are built once, outside the timing (the cache build is timed apart).
The teacher's precision is compared by benchmarks/train_precision.py.

Run: .venv/bin/python benchmarks/train_throughput.py [--rounds 5 --draft-vocab 8192]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from common import median, save

from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import Run, setup, train_step

CONFIG = Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml"


def arms(draft_vocab: int, top_k: int) -> dict[str, list[str]]:
    cut, cache = f"train_draft_vocab={draft_vocab}", ["teacher_cache=true", f"teacher_top_k={top_k}"]
    return {
        "full head": ["train_draft_vocab=0"],
        "cut head": [cut],
        "full head + cache": ["train_draft_vocab=0", *cache],
        "cut head + cache": [cut, *cache],
    }


def micro_batches(run: Run) -> Iterator[list[dict]]:
    """The run's accumulation windows in training order, epoch after epoch."""
    epoch = 0
    while True:
        run.loader.set_epoch(epoch)
        batches = iter(run.loader)
        for _ in range(len(run.loader) // run.cfg.grad_accum):
            yield [next(batches) for _ in range(run.cfg.grad_accum)]
        epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per arm, after one warm-up step")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the cut head's N (train_draft_vocab)")
    parser.add_argument("--top-k", type=int, default=64, help="the teacher cache's k")
    parser.add_argument(
        "--samples",
        type=int,
        default=1,
        help="target answers per training prompt (the shipped config's 8 lengthens the one-off answer "
        "generation and cache build, not a step's work; it widens the ranked vocabulary)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    parser.add_argument("--config", type=Path, default=CONFIG, help="distillation config (default: smollm2-135m)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="train-throughput-bench-"))
    load_before = os.getloadavg()
    # dataset=builtin: the arms train on the target's answers to the 56 built-in prompts, generated here
    common = [
        "dataset=builtin",
        f"gen_samples={args.samples}",
        "teacher_dtype=float32",
        "mixed_precision=no",
        "max_steps=1000",
    ]
    runs, streams, setup_s = {}, {}, {}
    try:
        for arm, overrides in arms(args.draft_vocab, args.top_k).items():
            folder = f"output_dir={work / arm.replace(' ', '_').replace('+', '')}"
            cfg = load_config(DistillConfig, str(args.config), [folder, *common, *overrides])
            start = time.perf_counter()
            runs[arm] = setup(cfg)
            setup_s[arm] = time.perf_counter() - start
            streams[arm] = micro_batches(runs[arm])
        rates: dict[str, list[float]] = {arm: [] for arm in runs}
        for step in range(args.rounds + 1):
            for arm, run in runs.items():
                start = time.perf_counter()
                _, tokens = train_step(run, next(streams[arm]))
                elapsed = time.perf_counter() - start
                if step:  # the first round warms up
                    rates[arm].append(tokens / elapsed)
                print(f"round {step} {arm}: {tokens} tokens in {elapsed:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = rates["full head"]
    kept = {arm: len(run.head_ids) for arm, run in runs.items() if run.head_ids is not None}
    result = {
        "config": args.config.name,
        "dtype": "float32",
        "loss": runs["full head"].cfg.loss,
        "rounds": args.rounds,
        "batch_size": runs["full head"].cfg.batch_size,
        "answers_per_prompt": args.samples,
        "torch_threads": args.threads,
        "draft_vocab": args.draft_vocab,
        "head_tokens_kept": kept,  # the first N ranked tokens (all the training answers hold, if fewer) and EOS
        "top_k": args.top_k,
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "tokens_per_s": {arm: median(r) for arm, r in rates.items()},
        "ratio_to_full_head": {arm: median([x / b for x, b in zip(r, base, strict=True)]) for arm, r in rates.items()},
        "tokens_per_s_each_round": rates,
        # setup: models, answers (cached), the held-out alpha at step 0, initial/; the first cache arm
        # also builds the teacher cache, the second reads it
        "setup_s": setup_s,
    }
    print()
    for arm in runs:
        print(
            f"{arm:<20}{result['tokens_per_s'][arm]:>8.1f} tokens/s  {result['ratio_to_full_head'][arm]:.2f}x "
            "the full head with the live teacher"
        )
    print(f"head cut to {kept} tokens; setup seconds {', '.join(f'{a}: {s:.0f}' for a, s in setup_s.items())}")
    save("train_throughput", result)


if __name__ == "__main__":
    main()
