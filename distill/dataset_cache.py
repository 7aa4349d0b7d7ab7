"""The teacher's top-k cache of a dataset folder, built by the data step, so distillation reads it.

Layout inside a dataset folder (``draftsmith data --teacher-cache K``)::

    teacher-cache-k<K>/<shard name>/   one ``teacher_cache`` folder (its shards and meta.json) per
                                       answer shard (``train-r0-00003`` for data/train-r0-00003.parquet),
                                       over the shard's rows as whole sequences

Rows are cached whole (prompt + answer, nothing cut), one cache per answer shard, so:
- a killed build keeps every shard cache whose meta.json was written and builds the others again;
- rows added to the dataset later get their own shard caches when the step runs again;
- a run that cuts sequences at ``max_length`` reads a prefix of a row's entries (a causal target's
  distribution at a position does not depend on what follows it), and a run with ``teacher.top_k``
  <= K the first ``teacher.top_k`` columns (entries are sorted, most likely first): exactly what
  ``teacher_cache.build`` would have written for the run's own examples.
The target computes it in draftsmith (``teacher_cache.build``) or in a vLLM server from its prompt
log-probs (the same top-k of the same log-softmax, in the engine's own kernels). The manifest's
``teacher_cache`` records, per K, the target, dtype and engine that computed it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import torch
from transformers import PreTrainedModel

from draftsmith.distill import teacher_cache
from draftsmith.distill.data import target_examples
from draftsmith.distill.dataset_builder import (
    MANIFEST,
    ProcessGroup,
    read_manifest,
    read_shard,
    shard_name,
    shard_paths,
)
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import write_text
from draftsmith.specdec.vllm_client import complete
from draftsmith.specdec.vllm_server import Server

Entries = list[tuple[torch.Tensor, torch.Tensor]]  # per example: (indices (N, k), log-probs (N, k))


def cache_folder(folder: Path, top_k: int) -> Path:
    return Path(folder) / f"teacher-cache-k{top_k}"


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
    top_k: int,
    write_cache: Callable[[list[dict], Path], None],
    description: dict,
    group: ProcessGroup | None = None,
) -> dict:
    """The top-k cache of every answer shard not cached yet (each process every N-th); the manifest.

    write_cache(examples, cache folder): writes one shard's cache (``target_cache_writer``,
    ``engine_cache_writer``). description: what computed it (target, dtype, ...), recorded in the
    manifest under ``top_k``.
    """
    group = group or ProcessGroup()
    if top_k < 1:
        raise DraftsmithError(f"--teacher-cache must be >= 1 (tokens kept per position), got {top_k}")
    shards = shard_paths(folder)
    for shard in shards[group.index :: group.count]:
        out = cache_folder(folder, top_k) / shard_name(shard)
        if not (out / "meta.json").is_file():
            write_cache([e for e in row_examples(read_shard(shard)) if e is not None], out)
    group.barrier()
    manifest = read_manifest(folder)
    if group.is_main:
        tokens = sum(
            json.loads((cache_folder(folder, top_k) / shard_name(s) / "meta.json").read_text())["tokens"]
            for s in shards
        )
        record = {**description, "top_k": top_k, "shards": len(shards), "tokens": tokens}
        manifest.setdefault("teacher_cache", {})[str(top_k)] = record
        write_text(Path(folder) / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    group.barrier()
    return manifest


def target_cache_writer(
    target: PreTrainedModel, top_k: int, batch_size: int = 8, pad_id: int = 0
) -> Callable[[list[dict], Path], None]:
    """Shard caches computed by draftsmith's own copy of the target (``teacher_cache.build``)."""
    if top_k > target.config.vocab_size:
        raise DraftsmithError(f"--teacher-cache {top_k} exceeds the target's vocabulary ({target.config.vocab_size})")

    def write(examples: list[dict], out: Path) -> None:
        teacher_cache.build(target, examples, out, top_k, batch_size, pad_id=pad_id, progress=False)

    return write


def engine_cache_writer(server: Server, top_k: int, concurrency: int = 64) -> Callable[[list[dict], Path], None]:
    """Shard caches computed by a vLLM server from its prompt log-probs: each row is sent whole as a
    prompt with ``prompt_logprobs=top_k`` (the server must allow that many: ``--max-logprobs``), and
    the distribution predicting token t+1 is kept at every loss position t."""

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
        teacher_cache.save(out, examples, entries, top_k)

    return write


def dataset_entries(folder: Path, examples: list[dict], dtype: str, top_k: int, max_length: int) -> Entries | None:
    """Entries for ``examples`` (made from the dataset at ``max_length``) from the dataset's own cache:
    the smallest K >= ``top_k`` computed in ``dtype`` that covers them all; None when there is none."""
    kinds = (read_manifest(folder) or {}).get("teacher_cache", {})
    usable = sorted(int(k) for k, record in kinds.items() if int(k) >= top_k and record["dtype"] == dtype)
    if not usable:
        if kinds:  # a rebuild is never silent: name what the folder carries and why it does not serve
            carried = ", ".join(f"top-{k} in {record['dtype']}" for k, record in sorted(kinds.items()))
            print(
                f"teacher cache: {folder} carries {carried}; this run asks top-{top_k} in {dtype} (a cache serves "
                "a run of its dtype and a top-k up to its own), so the target computes its own",
                file=sys.stderr,
            )
        return None
    by_digest: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
    for shard in shard_paths(folder):
        cached = cache_folder(folder, usable[0]) / shard_name(shard)
        if not (cached / "meta.json").is_file():  # rows added after the cache was built
            print(
                f"teacher cache: {cache_folder(folder, usable[0])} has no entries for the shard {shard_name(shard)} "
                f"(rows added later; draftsmith data --teacher-cache {usable[0]} adds them), so the target computes "
                "its own",
                file=sys.stderr,
            )
            return None
        whole = dict(teacher_cache.read_entries(cached))
        rows = read_shard(shard)
        for full, cut in zip(row_examples(rows), row_examples(rows, max_length), strict=True):
            if cut is not None:
                ids, logps = whole[teacher_cache.example_digest(full)]
                count = sum(cut["loss_mask"])
                by_digest[teacher_cache.example_digest(cut)] = (ids[:count, :top_k], logps[:count, :top_k])
    found = [by_digest.get(teacher_cache.example_digest(e)) for e in examples]
    return None if any(entry is None for entry in found) else found
