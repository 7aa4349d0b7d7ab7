"""Peak memory of the vLLM feature build at N and 4N rows: it must not grow with the rows.

``draftsmith data --engine vllm --hidden-layers`` streams every finished request's top-k and hidden
states into store shards of at most --shard-rows rows, with at most --batch-size requests in flight,
so the building process holds one shard and the requests in flight whatever the number of rows. This
runs that build (``data.vllm_feature_store``, the step after the answers, its own vLLM server
included) over the first N and 4N rows of the shipped dataset (``distill/data/smollm2-self``), each in
a fresh process, and records:

- the building process's peak resident set (``getrusage``'s ru_maxrss, reported by the process itself);
- the vLLM server's: the largest sum over its processes (API server, engine, workers) of their
  resident sets, sampled every 0.2 s;
- what the rows' hidden states take in all, in the server's dtype (what a build holding them in
  memory before writing would hold).

Writes benchmarks/results/NAME.json (default feature_store_memory) with the machine's CPU flags, the
dtype and the threads; it fails (exit 1) when the building process's peak at 4N exceeds 1.3x its peak at N.
Run: .venv/bin/python benchmarks/feature_store_memory.py [--rows 64 --layers 2,15,27 --top-k 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import save

from draftsmith.distill.dataset_builder import load_built, training_examples
from draftsmith.specdec.loading import DEFAULT_TARGET, resolve_device, resolve_dtype

SHIPPED = Path(__file__).parents[1] / "distill" / "data" / "smollm2-self"  # 2800 rows of the default target's
RATIO_LIMIT = 1.3

# The feature build alone, as ``draftsmith data`` runs it once the answers are written; prints its own peak.
BUILD = """
import json, resource, sys
from pathlib import Path
from draftsmith import data
from draftsmith.specdec.loading import resolve_device, resolve_dtype
args = data.parser().parse_args(sys.argv[1:])
data.check_options(args)  # as the command checks them (and fills the engine defaults)
device = resolve_device(args.device)
dtype = resolve_dtype(args.dtype, device)
store = data.vllm_feature_store(args, data.serve_options(args, device, dtype), dtype, Path(args.output))
print(json.dumps({"peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "store": str(store)}))
"""


def subset(folder: Path, rows: int) -> Path:
    """A dataset folder holding the shipped dataset's first ``rows`` rows (its manifest, one parquet shard)."""
    (folder / "data").mkdir(parents=True)
    shutil.copy(SHIPPED / "manifest.json", folder / "manifest.json")
    load_built(SHIPPED).select(range(rows)).to_parquet(str(folder / "data" / "train-bench-r0-00000.parquet"))
    return folder


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while read
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rss_kib(pid: int) -> int:
    """A process's resident set now (VmRSS), 0 once it has ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def sample_server(pid: int, stop: threading.Event, peak: list[int]) -> None:
    """Keep in ``peak[0]`` the largest sum of resident sets of ``pid``'s descendants (the server's processes)."""
    while not stop.wait(0.2):
        peak[0] = max(peak[0], sum(rss_kib(child) for child in descendants(pid)))


def build(folder: Path, options: list[str], max_length: int, server_item: int) -> dict:
    """One feature build over ``folder`` in a fresh process: its peak RSS, the server's, the seconds, and
    the size of the rows' hidden states in all, at ``server_item`` bytes a value."""
    command = [sys.executable, "-c", BUILD, "--output", str(folder), *options]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, server_peak = threading.Event(), [0]
    sampler = threading.Thread(target=sample_server, args=(process.pid, stop, server_peak))
    sampler.start()
    out, err = process.communicate()
    stop.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"the feature build failed ({process.returncode}):\n{err[-3000:]}")
    report = json.loads(out.strip().splitlines()[-1])
    meta = json.loads((Path(report["store"]) / "meta.json").read_text())
    positions = sum(len(e["input_ids"]) for e in training_examples(folder, max_length))
    return {
        "rows": meta["examples"],
        "positions": positions,
        "states_mb": round(positions * len(meta["layers"]) * meta["hidden_size"] * server_item / 2**20, 1),
        "seconds": round(time.perf_counter() - started, 1),
        "build_peak_rss_mb": round(report["peak_rss_kib"] / 1024, 1),
        "server_peak_rss_mb": round(server_peak[0] / 1024, 1),
        "store_files": len(list(Path(report["store"]).glob("shard-*.safetensors"))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="N: the smaller build's rows (the larger: 4N)")
    parser.add_argument("--layers", default="2,15,27", help="--hidden-layers (default: EAGLE-3's 2,15,27)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=256, help="rows cut as distill cuts them")
    parser.add_argument("--shard-rows", type=int, default=16, help="rows per store shard")
    parser.add_argument("--batch-size", type=int, default=16, help="requests in flight")
    parser.add_argument("--threads", type=int, default=None, help="the server's threads (default: every core)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CPUs with native bfloat16, else float32")
    parser.add_argument("--name", default="feature_store_memory", help="results/NAME.json")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    options = ["--engine", "vllm", "--engine-eager", "--teacher-cache", str(args.top_k), "--hidden-layers", args.layers]
    options += ["--max-length", str(args.max_length), "--shard-rows", str(args.shard_rows)]
    options += ["--batch-size", str(args.batch_size), "--dtype", str(dtype).removeprefix("torch."), "--no-progress"]
    if args.threads is not None:
        options += ["--engine-threads", str(args.threads)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, rows in (("N", args.rows), ("4N", 4 * args.rows)):
            folder = subset(Path(tmp) / label, rows)
            runs[label] = build(folder, options, args.max_length, dtype.itemsize)
            print(f"{label}: {json.dumps(runs[label])}", flush=True)
            shutil.rmtree(folder)
    ratio = runs["4N"]["build_peak_rss_mb"] / runs["N"]["build_peak_rss_mb"]
    server_ratio = runs["4N"]["server_peak_rss_mb"] / runs["N"]["server_peak_rss_mb"]
    report = {
        "target": DEFAULT_TARGET,
        "dtype": str(dtype).removeprefix("torch."),
        "server_threads": args.threads or len(os.sched_getaffinity(0)),
        "options": options,
        "runs": runs,
        "build_peak_ratio": round(ratio, 3),
        "server_peak_ratio": round(server_ratio, 3),
        "limit": RATIO_LIMIT,
    }
    save(args.name, report)
    print(f"peak RSS of the build at 4N / N: {ratio:.2f}x (limit {RATIO_LIMIT}x); the server's {server_ratio:.2f}x")
    if ratio > RATIO_LIMIT:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
