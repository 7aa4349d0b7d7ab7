"""EAGLE-3 training steps per second from the feature store vs the live target, side by side.

The same config (default: configs/smollm2-135m-eagle3.yaml), the same data and the same number of
steps each, interleaved (live, store, live, store, ...) so a machine that slows down slows both. The
store is built once before the first store run (its build is not timed); each run's steps/s is its
train_summary.json's (step time only, not evaluations or checkpoints), and teacher_forwards is
recorded beside it. Writes benchmarks/results/feature_store.json.
``--profile N`` then profiles N store steps (after one unprofiled) with torch's profiler and records
where a step's time goes: the ops of most self time, and the shares of the matrix products and of
attention, which no change to the loss can remove.
``--flops`` counts the floating-point operations of one live and one store step on the same batch
(torch's FlopCounterMode, with the CPU flash-attention kernels counted as its attention formulas
count the others): their ratio is what the store can gain where both steps run at the same rate of
operations, the ceiling of the measured ratio.
Run: .venv/bin/python benchmarks/feature_store.py [--steps 6 --repeats 2 --profile 3 --flops]
Smoke: .venv/bin/python benchmarks/feature_store.py --config tiny --steps 2 --repeats 1 --name feature_store_smoke
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import median, save
from torch.ops import aten
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import setup, train, train_step

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul"}


def bench_config(config: str, folder: Path, cached: bool, extra: list[str], *more: str) -> DistillConfig:
    """``config`` writing to ``folder``, no speedup evaluations, the teacher from the store or live."""
    items = [f"output_dir={folder}", "eval.speedup_steps=0", f"teacher.cache={str(cached).lower()}", *more, *extra]
    return load_config(DistillConfig, config_path(config), items)


def run(config: str, folder: Path, steps: int, cached: bool, extra: list[str]) -> dict:
    """One training run of ``steps`` steps; its train_summary.json."""
    limits = (f"optim.max_steps={steps}", f"save.steps={steps}", f"log.steps={steps}")
    result = train(bench_config(config, folder, cached, extra, *limits))
    return json.loads((result.run_dir / "train_summary.json").read_text())


def store_profile(config: str, folder: Path, steps: int, extra: list[str]) -> dict:
    """Where a store step's time goes: ``steps`` steps after one unprofiled, by self CPU time per op."""
    run = setup(bench_config(config, folder, True, extra))
    batches = iter(run.loader)
    train_step(run, [next(batches)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            train_step(run, [next(batches)])
        seconds = (time.perf_counter() - start) / steps
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    matmul = sum(e.self_cpu_time_total for e in ops if e.key in MATMUL_OPS)
    attention = sum(e.self_cpu_time_total for e in ops if "scaled_dot_product" in e.key or "attention" in e.key)
    return {
        "steps": steps,
        "step_s": seconds,
        "matmul_share": matmul / total,
        "attention_share": attention / total,
        "top_ops": [{"op": e.key, "share": e.self_cpu_time_total / total, "calls": e.count} for e in ops[:15]],
    }


# The CPU flash-attention kernels, counted as FlopCounterMode counts the other attention kernels
# (from the shapes of their arguments).
CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *_, **__: sdpa_flop_count(q, k, v),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad, q, k, v, *_, **__: sdpa_backward_flop_count(grad, q, k, v)
    ),
}


def step_flops(config: str, folder: Path, extra: list[str]) -> dict:
    """Floating-point operations of the first training step, live and from the store (same batch)."""
    counted = {}
    for source in ("live", "store"):
        run = setup(bench_config(config, folder / source, source == "store", extra))
        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            train_step(run, [next(iter(run.loader))])
        counted[source] = counter.get_total_flops()
    return {**counted, "ratio": counted["live"] / counted["store"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2-135m-eagle3")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--name", default="feature_store", help="results/NAME.json (default: feature_store)")
    parser.add_argument("--profile", type=int, default=0, help="then profile this many store steps")
    parser.add_argument("--flops", action="store_true", help="then count one live and one store step's operations")
    args = parser.parse_args()
    extra = ["draft.kind=eagle3", "draft.vocab=30"] if args.config == "tiny" else []
    records = {"live": [], "store": []}
    with tempfile.TemporaryDirectory() as tmp:
        run(args.config, Path(tmp) / "build", 1, True, extra)  # builds the store, untimed
        for repeat in range(args.repeats):
            for source in ("live", "store"):
                folder = Path(tmp) / f"{source}-{repeat}"
                records[source].append(run(args.config, folder, args.steps, source == "store", extra))
        profiled = store_profile(args.config, Path(tmp) / "profile", args.profile, extra) if args.profile else None
        flops = step_flops(args.config, Path(tmp) / "flops", extra) if args.flops else None
    live = median([r["steps_per_s"] for r in records["live"]])
    stored = median([r["steps_per_s"] for r in records["store"]])
    report = {
        "config": args.config,
        "steps": args.steps,
        "repeats": args.repeats,
        "live_steps_per_s": live,
        "store_steps_per_s": stored,
        "ratio": stored / live,
        "runs": records,
    }
    if profiled is not None:
        report["profile"] = profiled
    if flops is not None:
        report["flops"] = flops
    save(args.name, report)
    print(f"steps/s: live {live:.3f}, from the store {stored:.3f} ({stored / live:.1f}x)")
    if flops is not None:
        print(f"operations per step: live {flops['live']:.3g}, store {flops['store']:.3g} ({flops['ratio']:.1f}x)")


if __name__ == "__main__":
    main()
