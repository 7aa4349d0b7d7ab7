"""Which top-k teacher cache ships with smollm2-self: held-out sum min(p, q) of the default draft trained
from each candidate, against the draft trained from the top-64, and each candidate's size.

The candidates come from one top-64 cache of the dataset, computed by the default target in float32:

    draftsmith data --output COPY --cache-only --teacher-cache 64 --max-length 256 --dtype float32

(COPY: a copy of distill/data/smollm2-self). Each keeps the first k columns (k 8, 16, 32; the top-k
of the same forward) with uint16 token ids and float16 or uint8 log-probs (``dataset_cache.derive_cache``)
in a copy of the dataset of its own. The default config (configs/smollm2-135m) trains the same steps
from each, with the same seed, data order and held-out rows; every step reads the cache (no target
forward), and the held-out sum min(p, q) is exact: ``teacher.load_parts=false`` loads the whole target,
which gives the held-out p. Sizes: the cache's bytes, and zlib level 9 of each file (how git stores it).
A quality measurement, not a timed one.

Run: .venv/bin/python benchmarks/shipped_teacher_cache.py --source COPY [--steps 100 --heldout 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import zlib
from pathlib import Path

from common import save

from draftsmith.distill.dataset_builder import MANIFEST
from draftsmith.distill.dataset_cache import cache_folder, derive_cache
from draftsmith.distill.teacher_cache import Encoding, StoreFormat
from draftsmith.train.config import DistillConfig, config_path, load_config
from draftsmith.train.loop import train

CANDIDATES = "64:float16,8:float16,8:uint8,16:float16,16:uint8,32:float16,32:uint8"  # the first: the reference
DATASET_FILES = (MANIFEST, "README.md", "data", "prompts")  # what a copy of the dataset needs besides its cache


def candidate(source: Path, work: Path, top_k: int, logprobs: str) -> Path:
    """A copy of the dataset at ``source`` carrying only the top-``top_k`` cache in ``logprobs``."""
    folder = work / f"k{top_k}-{logprobs}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name in DATASET_FILES:
        if (source / name).is_dir():
            shutil.copytree(source / name, folder / name)
        elif (source / name).is_file():
            shutil.copy2(source / name, folder / name)
    fmt = StoreFormat(top_k, encoding=Encoding("uint16", logprobs))
    command = (
        f"draftsmith data --output {source} --cache-only --teacher-cache {top_k} --teacher-encoding {logprobs} "
        "--max-length 256 --dtype float32"
    )
    derive_cache(folder, cache_folder(source, StoreFormat(64)), fmt, command)
    return folder


def sizes(cache: Path) -> tuple[int, int]:
    """(bytes, bytes after zlib level 9 file by file) of a cache folder."""
    files = [path for path in sorted(cache.rglob("*")) if path.is_file()]
    raw = sum(path.stat().st_size for path in files)
    return raw, sum(len(zlib.compress(path.read_bytes(), 9)) for path in files)


def trained(folder: Path, top_k: int, args: argparse.Namespace) -> dict:
    """The default draft trained ``args.steps`` store-fed steps on ``folder``: its held-out figures."""
    run = args.work / f"run-{folder.name}"
    shutil.rmtree(run, ignore_errors=True)
    overrides = [
        f"data.dataset={folder}",
        f"data.heldout={args.heldout}",
        f"teacher.top_k={top_k}",
        "teacher.load_parts=false",  # the whole target: held-out p exact, never read from the cache
        "teacher.dtype=float32",
        "optim.mixed_precision=no",  # the same arithmetic on every CPU
        f"optim.max_steps={args.steps}",
        f"save.steps={args.steps}",
        f"log.steps={args.steps}",
        f"output_dir={run}",
    ]
    if args.max_samples is not None:
        overrides.append(f"data.max_samples={args.max_samples}")
    train(load_config(DistillConfig, config_path("smollm2-135m"), overrides))
    summary = json.loads((run / "train_summary.json").read_text())
    if summary["teacher_forwards"] != 0 or summary["store"] != str(cache_folder_of(folder)):
        raise SystemExit(f"{folder}: the run did not read its cache ({summary['teacher']}, {summary['store']})")
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return {"heldout_sum_min_pq": last["acceptance_rate"], "heldout_tvd": last["tvd"], "step": last["step"]}


def cache_folder_of(folder: Path) -> Path:
    """The one cache a candidate's dataset copy carries."""
    return next(path.parent for path in folder.glob("teacher-cache-k*/cache.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, required=True, help="a copy of smollm2-self holding teacher-cache-k64")
    parser.add_argument("--work", type=Path, default=Path("/tmp/shipped-teacher-cache"))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--heldout", type=int, default=32)
    parser.add_argument("--max-samples", type=int, default=None, help="train on the dataset's first N rows only")
    parser.add_argument(
        "--candidates", default=CANDIDATES, help=f"K:LOGPROBS,... the first the reference ({CANDIDATES})"
    )
    parser.add_argument("--name", default="shipped_teacher_cache")
    args = parser.parse_args()
    rows = []
    for item in args.candidates.split(","):
        top_k, logprobs = int(item.split(":")[0]), item.split(":")[1]
        folder = candidate(args.source, args.work, top_k, logprobs)
        raw, packed = sizes(cache_folder_of(folder))
        rows.append({"top_k": top_k, "logprobs": logprobs, "bytes": raw, "zlib_bytes": packed})
        rows[-1] |= trained(folder, top_k, args)
        print(json.dumps(rows[-1]), flush=True)
        report(rows, args)  # after each candidate: a run stopped early keeps what it measured


def report(rows: list[dict], args: argparse.Namespace) -> None:
    """The table so far, each candidate against the first, and the JSON (results/NAME.json)."""
    reference = rows[0]["heldout_sum_min_pq"]  # the first candidate's
    print(f"\n{'k':>3} {'log-probs':>9} {'MB':>7} {'MB zlib':>8} {'held-out sum min(p,q)':>22} {'vs first':>10}")
    for row in rows:
        row["vs_reference"] = row["heldout_sum_min_pq"] - reference
        print(
            f"{row['top_k']:>3} {row['logprobs']:>9} {row['bytes'] / 1e6:>7.2f} {row['zlib_bytes'] / 1e6:>8.2f} "
            f"{row['heldout_sum_min_pq']:>22.4f} {row['vs_reference']:>+10.4f}"
        )
    settings = {"steps": args.steps, "heldout": args.heldout, "max_samples": args.max_samples}
    settings |= {"config": "smollm2-135m", "source": str(args.source)}
    save(args.name, {"settings": settings, "candidates": rows})


if __name__ == "__main__":
    main()
