"""Distillation throughput with the live teacher vs the offline top-k teacher cache, side by side.

Same config (configs/smollm2-135m.yaml: default target, 2-layer draft), same data, the same number
of steps each, interleaved in one run; prints tokens/s of both, their ratio, and the cache's size.
Run: .venv/bin/python benchmarks/teacher_cache.py [--steps 6 --top-k 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from common import median, save, tokens_per_s

from draftsmith.specdec.loading import draftsmith_home
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train

CONFIG = Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="teacher-cache-bench-"))
    rates = {"live": [], "cache": []}
    try:
        for rep in range(args.repeats):
            for mode in ("live", "cache"):
                cfg = load_config(
                    DistillConfig,
                    str(CONFIG),
                    [
                        f"output_dir={work / f'{mode}-{rep}'}",
                        "data.dataset=builtin",  # the built-in prompts: a cache over them builds in minutes
                        f"optim.max_steps={args.steps}",
                        f"log.steps={args.steps}",
                        f"save.steps={args.steps}",
                        f"teacher.cache={mode == 'cache'}",
                        f"teacher.top_k={args.top_k}",
                    ],
                )
                rates[mode].append(tokens_per_s(train(cfg)))  # the cache is built once, outside the timed steps
                print(f"repeat {rep + 1} {mode}: {rates[mode][-1]:.1f} tokens/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    metas = [json.loads(p.read_text()) for p in (draftsmith_home() / "teacher-cache").glob("*/meta.json")]
    meta = next(m for m in metas if m["top_k"] == args.top_k)
    ratios = [c / v for c, v in zip(rates["cache"], rates["live"], strict=True)]
    result = {
        "live_tokens_per_s": median(rates["live"]),
        "cache_tokens_per_s": median(rates["cache"]),
        "speedup": median(ratios),
        "top_k": args.top_k,
        "bytes_per_token": meta["bytes_per_token"],
        "cached_tokens": meta["tokens"],
        "steps": args.steps,
    }
    print(
        f"\nlive teacher {result['live_tokens_per_s']:.1f} tokens/s, teacher cache {result['cache_tokens_per_s']:.1f} "
        f"tokens/s: {result['speedup']:.2f}x; cache {meta['bytes_per_token']} bytes/token, {meta['tokens']} tokens"
    )
    save("teacher_cache", result)


if __name__ == "__main__":
    main()
