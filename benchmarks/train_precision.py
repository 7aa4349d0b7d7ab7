"""Distillation throughput by precision, side by side.

Same config (configs/smollm2-135m.yaml: default target, 2-layer draft), the same number of steps
per arm, arms interleaved over the repeats:
  float32       the teacher in float32, the draft in float32
  bf16 teacher  the teacher in bfloat16 (teacher_dtype), the draft in float32
  bf16 + amp    the teacher in bfloat16, the draft under bfloat16 autocast (mixed_precision bf16)
Prints tokens/s (loss tokens per second of training) of each and their ratios to float32. Each
teacher dtype has its own set of target answers (generated once, cached, outside the timing).

Run: .venv/bin/python benchmarks/train_precision.py [--steps 8 --repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from common import median, save, tokens_per_s

from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train

CONFIG = Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml"
ARMS = {
    "float32": ["teacher.dtype=float32", "optim.mixed_precision=no"],
    "bf16 teacher": ["teacher.dtype=bfloat16", "optim.mixed_precision=no"],
    "bf16 + amp": ["teacher.dtype=bfloat16", "optim.mixed_precision=bf16"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="train-throughput-bench-"))
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        for rep in range(args.repeats):
            for arm, overrides in ARMS.items():
                run = work / f"{arm.replace(' ', '_').replace('+', '')}-{rep}"
                steps = [f"optim.max_steps={args.steps}", f"log.steps={args.steps}", f"save.steps={args.steps}"]
                data = "data.dataset=builtin"  # the target answers the built-in prompts at the start of each run
                live = "teacher.cache=false"  # the target teaches at every step: its dtype is what is measured
                cfg = load_config(DistillConfig, str(CONFIG), [f"output_dir={run}", data, live, *steps, *overrides])
                rates[arm].append(tokens_per_s(train(cfg)))
                print(f"repeat {rep + 1} {arm}: {rates[arm][-1]:.1f} tokens/s")

    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = median(rates["float32"])
    result = {
        "steps": args.steps,
        "repeats": args.repeats,
        "tokens_per_s": {arm: median(r) for arm, r in rates.items()},
        "ratio_to_float32": {arm: median(r) / base for arm, r in rates.items()},
    }
    print()
    for arm in ARMS:
        print(f"{arm:<14}{result['tokens_per_s'][arm]:>8.1f} tokens/s  {result['ratio_to_float32'][arm]:.2f}x float32")
    save("train_precision", result)


if __name__ == "__main__":
    main()
