"""The teacher's top-k cache of a dataset folder, built by the data step, so distillation reads it.

Layout inside a dataset folder (``draftsmith data --teacher-cache K``)::

    teacher-cache-k<K>[-uint8]/
        <shard name>/    one ``teacher_cache`` folder (its shards and meta.json) per answer shard
                         (``train-r0-00003`` for data/train-r0-00003.parquet), over the shard's rows
        cache.json       written last: how it was made (``build_dataset_cache``); without it the
                         cache is incomplete and no run reads it

Rows are cached whole (prompt + answer), or cut at ``--max-length`` as distill cuts them, one cache per
answer shard, so:
- a killed build keeps every shard cache whose meta.json was written and builds the others again;
- rows added to the dataset later get their own shard caches when the step runs again;
- a run that cuts sequences at ``max_length`` (up to the cache's own) reads a prefix of a row's entries
  (a causal target's distribution at a position does not depend on what follows it), and a run with
  ``teacher.top_k`` <= K the first ``teacher.top_k`` columns (entries are sorted, most likely first):
  exactly what ``teacher_cache.build`` would have written for the run's own examples.

``cache.json`` records the target and its weights' digest, the dtype it ran in, K, the encoding, the
cut, the digest of the dataset's ``manifest.json`` it was computed for, the draftsmith version and the
command that computes it again. A run reads the cache only while the manifest is still that one (a
dataset grown or rebuilt since says so in one line, and the run's own target teaches), and only a
cache computed in float32 or in the run's own teacher dtype (the dtype matters for a forward, and a
float32 one is the most exact). The target computes it in draftsmith (``teacher_cache.build``) or in a
vLLM server from its prompt log-probs (the same top-k of the same log-softmax, in the engine's kernels).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedModel

from draftsmith.distill import teacher_cache
from draftsmith.distill.data import target_examples
from draftsmith.distill.dataset_builder import (
    MANIFEST,
    ProcessGroup,
    read_shard,
    shard_name,
    shard_paths,
)
from draftsmith.distill.teacher_cache import Encoding, StoreFormat
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text
from draftsmith.specdec.vllm_client import complete
from draftsmith.specdec.vllm_server import Server

Entries = list[tuple[torch.Tensor, torch.Tensor]]  # per example: (indices (N, k), log-probs (N, k))
RECORD = "cache.json"


def cache_folder(folder: Path, fmt: StoreFormat) -> Path:
    """Where a dataset folder keeps its top-k cache in ``fmt`` (uint8 log-probs in a folder of their own)."""
    suffix = "-uint8" if fmt.encoding.logprobs == "uint8" else ""
    return Path(folder) / f"teacher-cache-k{fmt.top_k}{suffix}"


def manifest_digest(folder: Path) -> str:
    """sha256 of the dataset's manifest.json: what a cache was computed for."""
    return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()


def row_examples(shard: datasets.Dataset, max_length: int | None = None) -> list[dict | None]:
    """Each row's training example (``distill.data.target_examples``), cut at ``max_length``
    (None: whole); None for a row with no answer token left to learn."""
    examples = []
    for prompt, answer in zip(shard["prompt_ids"], shard["answer_ids"], strict=True):
        made = target_examples([prompt], [answer], max_length or len(prompt) + len(answer))
        examples.append(made[0] if made else None)
    return examples


def build_dataset_cache(
    folder: Path,
    fmt: StoreFormat,
    write_cache: Callable[[list[dict], Path], None],
    description: dict,
    group: ProcessGroup | None = None,
    max_length: int | None = None,
) -> dict:
    """The top-k cache of every answer shard not cached yet (each process every N-th), its rows cut at
    ``max_length`` (None: whole); then ``cache.json``, which it returns.

    write_cache(examples, cache folder): writes one shard's cache (``target_cache_writer``,
    ``engine_cache_writer``). description: what computed it (target, weights digest, dtype, engine,
    command, ...), recorded in ``cache.json`` with K, the encoding, the cut and the manifest's digest."""
    group = group or ProcessGroup()
    if fmt.top_k < 1:
        raise DraftsmithError(f"--teacher-cache must be >= 1 (tokens kept per position), got {fmt.top_k}")
    out = cache_folder(folder, fmt)
    record = {**description, "top_k": fmt.top_k, "encoding": asdict(fmt.encoding), "max_length": max_length}
    check_same_making(out, record)
    shards = shard_paths(folder)
    for shard in shards[group.index :: group.count]:
        if not (out / shard_name(shard) / "meta.json").is_file():
            write_cache(
                [e for e in row_examples(read_shard(shard), max_length) if e is not None], out / shard_name(shard)
            )
    group.barrier()
    metas = [json.loads((out / shard_name(s) / "meta.json").read_text()) for s in shards]
    record |= {"shards": len(shards), "examples": sum(m["examples"] for m in metas)}
    record |= {"tokens": sum(m["tokens"] for m in metas), "manifest_sha256": manifest_digest(folder)}
    if group.is_main:
        write_text(out / RECORD, json.dumps(record, indent=2) + "\n")
    group.barrier()
    return record


MADE_WITH = ("target", "dtype", "top_k", "encoding", "max_length")  # what shard caches of one folder share


def check_same_making(out: Path, record: dict) -> None:
    """A cache folder whose shard caches were made another way (another target, dtype or cut) is not
    added to: refused in one line, naming what differs."""
    if not (out / RECORD).is_file():
        return
    old = json.loads((out / RECORD).read_text())
    differs = [f"{key} {old.get(key)} (now {record[key]})" for key in MADE_WITH if old.get(key) != record[key]]
    if differs:
        raise DraftsmithError(
            f"{out} was made with {', '.join(differs)}; delete it to compute it again this way, or keep its settings"
        )


def target_cache_writer(
    target: PreTrainedModel, fmt: StoreFormat, batch_size: int = 8
) -> Callable[[list[dict], Path], None]:
    """Shard caches computed by draftsmith's own copy of the target (``teacher_cache.build``)."""
    if fmt.top_k > target.config.vocab_size:
        raise DraftsmithError(
            f"--teacher-cache {fmt.top_k} exceeds the target's vocabulary ({target.config.vocab_size})"
        )

    def write(examples: list[dict], out: Path) -> None:
        teacher_cache.build(target, examples, out, fmt, batch_size=batch_size, progress=False)

    return write


def engine_cache_writer(server: Server, fmt: StoreFormat, concurrency: int = 64) -> Callable[[list[dict], Path], None]:
    """Shard caches computed by a vLLM server from its prompt log-probs: each row is sent whole as a
    prompt with ``prompt_logprobs=top_k`` (the server must allow that many: ``--max-logprobs``), and
    the distribution predicting token t+1 is kept at every loss position t."""
    top_k = fmt.top_k

    def entry(example: dict) -> tuple[torch.Tensor, torch.Tensor]:
        answer = complete(server, example["input_ids"], max_tokens=1, prompt_logprobs=top_k)
        tops = answer.prompt_logprobs  # [t]: the top k after tokens 0..t, predicting token t + 1
        rows = [tops[t] for t, counts in enumerate(example["loss_mask"]) if counts]
        if any(len(ids) != top_k for ids, _ in rows):
            raise DraftsmithError(f"the vLLM server returned fewer than {top_k} log-probs at a position")
        return torch.tensor([ids for ids, _ in rows]), torch.tensor([logps for _, logps in rows])

    def write(examples: list[dict], out: Path) -> None:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            entries = list(pool.map(entry, examples))
        teacher_cache.save(out, examples, entries, fmt)

    return write


def derive_cache(folder: Path, source: Path, fmt: StoreFormat, command: str) -> Path:
    """A smaller cache of ``folder`` made from its complete cache ``source`` (another folder's copy of
    the same dataset's cache serves too): the first ``fmt.top_k`` columns of its entries (sorted, most
    likely first: the top-k of the same forward), kept in ``fmt.encoding`` (its values rounded twice: by
    the source's encoding, then by this one). command: the one that computes the derived cache itself,
    recorded in its ``cache.json``."""
    record = json.loads((source / RECORD).read_text())
    if fmt.top_k > record["top_k"]:
        raise DraftsmithError(f"{source} keeps top-{record['top_k']}: it cannot give top-{fmt.top_k}")
    out = cache_folder(folder, fmt)
    for shard in sorted(path for path in source.iterdir() if (path / "meta.json").is_file()):
        digests, entries = zip(*teacher_cache.read_entries(shard), strict=True)
        meta = json.loads((shard / "meta.json").read_text())
        (out / shard.name).mkdir(parents=True, exist_ok=True)
        ids, logps = [e[0][:, : fmt.top_k] for e in entries], [e[1][:, : fmt.top_k] for e in entries]
        size = fmt.shard_rows
        for number, start in enumerate(range(0, len(digests), size)):
            rows = slice(start, start + size)
            chunk = (list(digests[rows]), ids[rows], logps[rows])
            teacher_cache.write_shard(out / shard.name, number, *chunk, encoding=fmt.encoding)
        made_by = {"target": record["target"], "dtype": record["dtype"], "content": meta["content"]}
        made_by |= {**fmt.describe(), "derived_from": source.name}
        teacher_cache.write_meta(out / shard.name, meta["examples"], meta["tokens"], fmt.top_k, 0, made_by)
    derived_from = {"cache": source.name, "encoding": record["encoding"]}  # its rounding adds to this one's
    record |= {"top_k": fmt.top_k, "encoding": asdict(fmt.encoding), "command": command, "derived_from": derived_from}
    write_text(out / RECORD, json.dumps(record, indent=2) + "\n")
    return out


def carried_caches(folder: Path) -> list[tuple[Path, dict]]:
    """The complete top-k caches a dataset folder carries: (folder, its cache.json)."""
    paths = sorted(Path(folder).glob(f"teacher-cache-k*/{RECORD}"))
    return [(path.parent, json.loads(path.read_text())) for path in paths]


def why_not_served(record: dict, dtype: str, top_k: int, max_length: int, manifest: str) -> str | None:
    """Why a carried cache does not serve a run (None: it does): fewer tokens per position than the run
    keeps, another dtype than float32 or the run's, rows cut shorter, or another version of the dataset."""
    if record["top_k"] < top_k:
        return f"top-{record['top_k']}, the run keeps {top_k}"
    if record["dtype"] not in ("float32", dtype):
        return f"computed in {record['dtype']}, the run's teacher runs in {dtype}"
    if record["max_length"] is not None and record["max_length"] < max_length:
        return f"rows cut at {record['max_length']} tokens, the run reads {max_length}"
    if record["manifest_sha256"] != manifest:
        return (
            f"computed for another version of the dataset (manifest sha256 {record['manifest_sha256'][:12]}, now "
            f"{manifest[:12]}); `{record.get('command', 'draftsmith data --teacher-cache K')}` computes it again"
        )
    return None


def dataset_entries(
    folder: Path, examples: list[dict], dtype: str, top_k: int, max_length: int
) -> tuple[Entries, Path] | None:
    """Entries for ``examples`` (made from the dataset at ``max_length``) from a cache the dataset
    carries, and that cache's folder: the smallest K >= ``top_k`` that serves the run (``why_not_served``)
    and covers every example, float16 log-probs before uint8 at one K; None when there is none (a cache
    carried but not serving is named, with why, in one line on stderr)."""
    carried = carried_caches(folder)
    unfinished = [path.name for path in sorted(Path(folder).glob("teacher-cache-k*")) if not (path / RECORD).is_file()]
    if unfinished and not carried:  # an interrupted build, or one by a draftsmith before cache.json
        print(
            f"teacher cache: {folder} has {', '.join(unfinished)} without {RECORD} (unfinished, or made before "
            "caches recorded how they were made): not read; `draftsmith data --output FOLDER --cache-only "
            "--teacher-cache K` finishes it",
            file=sys.stderr,
        )
    manifest = manifest_digest(folder)
    reasons = {path: why_not_served(record, dtype, top_k, max_length, manifest) for path, record in carried}
    serving = [(path, record) for path, record in carried if reasons[path] is None]
    if not serving:
        if carried:  # a rebuild is never silent
            named = "; ".join(f"{path.name}: {reason}" for path, reason in reasons.items())
            print(f"teacher cache: {folder} carries {named}; so the run's target teaches", file=sys.stderr)
        return None
    path, record = min(serving, key=lambda item: (item[1]["top_k"], Encoding(**item[1]["encoding"]).logprobs))
    by_digest: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
    uncached = []  # answer shards the cache has no entries for: rows added after it was built
    for shard in shard_paths(folder):
        cached = path / shard_name(shard)
        if not (cached / "meta.json").is_file():
            uncached.append(shard_name(shard))
            continue
        whole = dict(teacher_cache.read_entries(cached))
        rows = read_shard(shard)
        for full, cut in zip(row_examples(rows, record["max_length"]), row_examples(rows, max_length), strict=True):
            if cut is not None:
                ids, logps = whole[teacher_cache.example_digest(full)]
                count = sum(cut["loss_mask"])
                by_digest[teacher_cache.example_digest(cut)] = (ids[:count, :top_k], logps[:count, :top_k])
    found = [by_digest.get(teacher_cache.example_digest(e)) for e in examples]
    missing = sum(entry is None for entry in found)
    if missing:
        print(
            f"teacher cache: {path} has no entries for {missing} of the run's examples (shards without entries: "
            f"{', '.join(uncached) or 'none'}; `{record.get('command', 'draftsmith data --teacher-cache K')}` adds "
            "them), so the run's target teaches",
            file=sys.stderr,
        )
        return None
    return found, path
