"""Distillation throughput of the trainer's own step, against the machine's matrix ceiling, old code beside new.

Arms: the teacher live or read from the top-k cache, the draft's head full or cut to the config's
``train_draft_vocab``, for the default config as a user runs it (configs/smollm2-135m.yaml on the
shipped smollm2-self data: its dtype, bfloat16 where the CPU multiplies it natively, and the
trainer's threads) and in float32 (the same arms where the CPU has no native bfloat16). With
``--old PACKAGE`` every arm is also run by another draftsmith (e.g. the commit before a change,
checked out with ``git worktree add`` and assembled as a package folder), in a worker process with
that package first on its path, using that checkout's config file. The arms are set up, then stepped
in turn, one optimizer step each per round, so old and new meet the same load on a shared machine.

Per arm: loss tokens/s and loss tokens per CPU-second (medians over the timed rounds), the FLOPs of a
step per loss token (torch's FlopCounterMode over the warm-up steps: matrix products and attention,
forward and backward), the machine's matrix throughput measured in every round (the best of GEMMs of
the step's shapes, in the arm's dtype, on the trainer's threads) and the fraction of that ceiling the
step reaches (FLOPs per second / ceiling); new/old is the median of the per-round ratios. The target's
answers are the shipped data's; the teacher cache is built once under DRAFTSMITH_HOME (the first
cache arm's set-up) and read by every later run on the same examples, old code included.

Run: .venv/bin/python benchmarks/train_throughput.py [--old /tmp/old-package --rounds 5 --max-samples 400]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from common import median, save
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from draftsmith.specdec.loading import resolve_dtype
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import Run, setup, train_step

CONFIG = Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml"
GEMMS = [(2048, 576, 1536), (2048, 1536, 576), (2048, 2048, 2048)]  # (M, K, N): the step's shapes, and a square one


def arms(native_bf16: bool) -> dict[str, list[str]]:
    """name -> config overrides; float32 arms only where the default is another dtype."""
    dtypes = {"default": []} | (
        {"float32": ["teacher.dtype=float32", "optim.mixed_precision=no"]} if native_bf16 else {}
    )
    heads = {"cut": [], "full": ["draft.vocab=0"]}
    teachers = {"live": ["teacher.cache=false"], "cache": ["teacher.cache=true"]}
    return {
        f"{teacher} {head} {dtype}": [*t, *h, *d]
        for dtype, d in dtypes.items()
        for teacher, t in teachers.items()
        for head, h in heads.items()
    }


def micro_batches(run: Run) -> Iterator[list[dict]]:
    """The run's accumulation windows in training order, epoch after epoch."""
    epoch = 0
    while True:
        run.loader.set_epoch(epoch)
        batches = iter(run.loader)
        for _ in range(len(run.loader) // run.cfg.optim.grad_accum):
            yield [next(batches) for _ in range(run.cfg.optim.grad_accum)]
        epoch += 1


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def flash_attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    # the CPU flash-attention kernels, counted as torch counts the CUDA ones (the full T x T products)
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flash_attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    aten = torch.ops.aten
    return FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: flash_attention_flops,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: flash_attention_backward_flops,
        },
    )


class Arms:
    """Runs set up from one config file, stepped on request (in this process, or in a worker for old code)."""

    def __init__(self, config: Path, overrides: dict[str, list[str]], common: list[str], work: Path):
        self.runs, self.streams, self.setup_s = {}, {}, {}
        for arm, extra in overrides.items():
            folder = f"output_dir={work / arm.replace(' ', '_')}"
            cfg = load_config(DistillConfig, str(config), [folder, *common, *extra])
            start = time.perf_counter()
            self.runs[arm] = setup(cfg)
            self.setup_s[arm] = time.perf_counter() - start
            self.streams[arm] = micro_batches(self.runs[arm])

    def step(self, arm: str, count_flops: bool = False) -> dict:
        """One optimizer step of ``arm``: its loss tokens, wall and CPU seconds, and FLOPs when counted."""
        micro = next(self.streams[arm])
        counter = flop_counter() if count_flops else contextlib.nullcontext()
        cpu, start = cpu_seconds(), time.perf_counter()
        with counter:
            _, tokens = train_step(self.runs[arm], micro)
        record = {"tokens": tokens, "seconds": time.perf_counter() - start, "cpu_seconds": cpu_seconds() - cpu}
        if count_flops:
            record["flops"] = counter.get_total_flops()
        return record

    def describe(self) -> dict:
        return {
            "threads": torch.get_num_threads(),
            "setup_s": self.setup_s,
            "teacher_dtype": {arm: str(run.target.dtype) for arm, run in self.runs.items()},
            "mixed_precision": {arm: run.accelerator.mixed_precision for arm, run in self.runs.items()},
            "head_tokens": {arm: None if run.head_ids is None else len(run.head_ids) for arm, run in self.runs.items()},
            "training_sequences": {arm: len(run.loader.dataset) for arm, run in self.runs.items()},
        }


def serve(spec: dict) -> None:
    """Worker mode: set up the arms of ``spec``, then answer each request line (an arm to step) with
    one JSON line on the original stdout; everything the library prints goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    arms = Arms(Path(spec["config"]), spec["arms"], spec["common"], Path(spec["work"]))
    replies.write(json.dumps(arms.describe()) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        replies.write(json.dumps(arms.step(request["arm"], request["count_flops"])) + "\n")


class Worker:
    """The arms of another draftsmith package, in a process with that package first on its path."""

    def __init__(self, package: Path, spec: dict, log: Path):
        env = os.environ | {"PYTHONPATH": str(package)}
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
        )
        self.info = self.reply()

    def reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker ended; its output:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def step(self, arm: str, count_flops: bool = False) -> dict:
        self.process.stdin.write(json.dumps({"arm": arm, "count_flops": count_flops}) + "\n")
        self.process.stdin.flush()
        return self.reply()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def matrix_ceiling(dtype: torch.dtype, repeats: int = 3) -> float:
    """The machine's matrix throughput now (FLOP/s): the best of ``GEMMS`` in ``dtype`` on this process's threads."""
    best = 0.0
    for m, k, n in GEMMS:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)  # warm: packing buffers, threads
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - start))
    return best


def measure(codes: dict, names: list[str], dtypes: dict[str, torch.dtype], warmup: int, rounds: int) -> dict:
    """Step every arm of every code in turn; the warm-up steps count FLOPs, the timed ones meet a
    matrix ceiling measured in the same round. -> {code: {arm: [records]}}, with "ceiling" per record."""
    records = {code: {arm: [] for arm in names} for code in codes}
    for round_index in range(warmup + rounds):
        counting = round_index < warmup
        ceilings = {} if counting else {arm: matrix_ceiling(dtypes[arm]) for arm in names}
        for arm in names:
            for code, arms_of in codes.items():
                record = arms_of.step(arm, counting) | {"ceiling": ceilings.get(arm)}
                records[code][arm].append(record)
                print(
                    f"round {round_index} {code:>3} {arm:<22} {record['tokens']:>5} tokens {record['seconds']:6.2f} s"
                )
    return records


def summary(records: list[dict], warmup: int) -> dict:
    """One arm of one code: medians over its timed steps, FLOPs per loss token from its warm-up steps."""
    counted, timed = records[:warmup], records[warmup:]
    flops_per_token = sum(r["flops"] for r in counted) / sum(r["tokens"] for r in counted)
    rates = [r["tokens"] / r["seconds"] for r in timed]
    return {
        "tokens_per_s": median(rates),
        "tokens_per_cpu_s": median([r["tokens"] / r["cpu_seconds"] for r in timed]),
        "gflops_per_token": flops_per_token / 1e9,
        "ceiling_gflop_s": median([r["ceiling"] for r in timed]) / 1e9,
        "fraction_of_ceiling": median([x * flops_per_token / r["ceiling"] for x, r in zip(rates, timed, strict=True)]),
        "tokens_per_s_each_round": rates,
    }


def ratio(new: list[dict], old: list[dict], warmup: int) -> float:
    """The median over timed rounds of new tokens/s over old tokens/s."""
    pairs = zip(new[warmup:], old[warmup:], strict=True)
    return median([(n["tokens"] / n["seconds"]) / (o["tokens"] / o["seconds"]) for n, o in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per arm first, their FLOPs counted")
    parser.add_argument(
        "--max-samples", type=int, default=400, help="rows of the shipped data the arms use (the cache covers them)"
    )
    parser.add_argument("--top-k", type=int, default=64, help="the teacher cache's k")
    parser.add_argument("--old", type=Path, help="a folder holding another draftsmith package, measured beside")
    parser.add_argument("--arms", help="comma-separated arm names to run (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(json.loads(args.worker))
        return
    native_bf16 = resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    overrides = arms(native_bf16)
    if args.arms:
        overrides = {name: overrides[name] for name in args.arms.split(",")}
    dtypes = {arm: torch.bfloat16 if native_bf16 and arm.endswith("default") else torch.float32 for arm in overrides}
    common = [f"data.max_samples={args.max_samples}", "optim.max_steps=100000", f"teacher.top_k={args.top_k}"]
    work = Path(tempfile.mkdtemp(prefix="train-throughput-bench-"))
    load_before = os.getloadavg()
    codes, worker = {}, None
    try:
        codes["new"] = Arms(CONFIG, overrides, common, work / "new")  # first: it builds the teacher cache
        if args.old:
            config = args.old / "draftsmith" / "configs" / CONFIG.name  # that checkout's own config
            spec = {"config": str(config), "arms": overrides, "common": common, "work": str(work / "old")}
            worker = Worker(args.old, spec, work / "old.log")
            codes["old"] = worker
        records = measure(codes, list(overrides), dtypes, args.warmup, args.rounds)
        described = {"new": codes["new"].describe()} | ({"old": worker.info} if worker else {})
    finally:
        if worker is not None:
            worker.close()
        shutil.rmtree(work, ignore_errors=True)
    report(args, records, described, dtypes, load_before)


def report(args, records: dict, described: dict, dtypes: dict, load_before) -> None:
    """Print the table and write results/train_throughput.json."""
    arms_run = list(records["new"])
    result = {
        "config": CONFIG.name,
        "max_samples": args.max_samples,
        "rounds": args.rounds,
        "warmup_rounds": args.warmup,
        "top_k": args.top_k,
        "old_package": str(args.old) if args.old else None,
        "dtype": {arm: str(dtype) for arm, dtype in dtypes.items()},
        "setup": described,
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "arms": {code: {arm: summary(r, args.warmup) for arm, r in by_arm.items()} for code, by_arm in records.items()},
    }
    if "old" in records:
        result["new_over_old"] = {arm: ratio(records["new"][arm], records["old"][arm], args.warmup) for arm in arms_run}
    print()
    for arm in arms_run:
        for code in records:
            s = result["arms"][code][arm]
            line = (
                f"{code:>3} {arm:<22}{s['tokens_per_s']:8.1f} tokens/s {s['tokens_per_cpu_s']:7.1f} per CPU-s "
                f"{s['gflops_per_token']:6.3f} GFLOP/token, "
                f"{s['fraction_of_ceiling']:.0%} of {s['ceiling_gflop_s']:.0f} GFLOP/s"
            )
            print(line)
        if "new_over_old" in result:
            print(f"    new/old {result['new_over_old'][arm]:.2f}x")
    save("train_throughput", result)


if __name__ == "__main__":
    main()
