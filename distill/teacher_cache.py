"""An offline cache of the teacher's top-k log-probabilities, so later epochs skip its forward pass.

For every training example, at the positions that count in the loss, the cache keeps the target's
``k`` most likely token ids (int32) and their log-probabilities (float16): ``6 k`` bytes per token.
It is written as ``safetensors`` shards of ``shard_size`` examples, each written atomically, with
``meta.json`` written last: a folder without it is incomplete and rebuilt.
The trainer reads it back at the loss rows (``rows_teacher_log_probs``: the top k kept, the rest of
the mass spread evenly over the other tokens, as ``losses.densify_topk`` defines it), over the full
vocabulary or a cut head's tokens.

A cache belongs to a dataset's content, not to a run: its folder (``folder_for``) is named by the
target, its dtype, ``k`` and a hash of the examples taken as a multiset (order-free), and every
shard stores each example's content digest beside its entries, so any run on the same examples
(another seed, another held-out split, another learning rate, every later epoch) reads it back
without running the target (``lookup``), and so does a cache built ahead of training for a dataset.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from draftsmith.distill import vocab_cut
from draftsmith.distill.data import collate, length_buckets
from draftsmith.distill.losses import densify_topk
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import atomic_path, write_text
from draftsmith.specdec.loading import draftsmith_home


def example_digest(example: dict) -> bytes:
    """16 bytes naming an example's content (its tokens and which of them count in the loss)."""
    return hashlib.sha256(json.dumps([example["input_ids"], example["loss_mask"]]).encode()).digest()[:16]


def cache_key(target_name: str, dtype: torch.dtype, examples: list[dict], top_k: int, temperature: float) -> str:
    """The name of the cache of ``examples``: the same for the same examples in any order."""
    digest = hashlib.sha256(json.dumps(["by-content", target_name, str(dtype), top_k, temperature]).encode())
    for example_hash in sorted(example_digest(e) for e in examples):
        digest.update(example_hash)
    return digest.hexdigest()[:16]


def folder_for(target_name: str, dtype: torch.dtype, examples: list[dict], top_k: int) -> Path:
    """Where the top-k cache of ``examples`` under ``target_name`` in ``dtype`` lives (DRAFTSMITH_HOME)."""
    return draftsmith_home() / "teacher-cache" / cache_key(target_name, dtype, examples, top_k, 1.0)


@torch.no_grad()
def build(
    target: PreTrainedModel,
    examples: list[dict],
    folder: Path,
    top_k: int,
    batch_size: int = 8,
    shard_size: int = 256,
    pad_id: int = 0,
    progress: bool = True,
) -> Path:
    """Run the target once over ``examples`` and write the top-k cache into ``folder``."""
    if (folder / "meta.json").is_file():
        return folder
    digests, examples = unique_examples(examples)  # a repeated example is run once
    made_by = {"target": target.name_or_path, "dtype": str(target.dtype).removeprefix("torch."), "top_k": top_k}
    made_by["content"] = content_digest(digests)
    if progress:
        say_why_not_reused(folder, made_by)
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = (len(examples) + shard_size - 1) // shard_size
    tokens = 0
    for shard in tqdm(range(n_shards), desc="teacher cache", disable=not progress, unit="shard"):
        chunk = examples[shard * shard_size : (shard + 1) * shard_size]
        # the shard in batches of similar lengths (the target runs no padding to speak of), one window;
        # entries go back in the examples' order
        lengths = [len(e["input_ids"]) for e in chunk]
        ids, logps = [torch.empty(0)] * len(chunk), [torch.empty(0)] * len(chunk)
        for rows in length_buckets(list(range(len(chunk))), lengths, batch_size, window=len(chunk)):
            batch = collate([chunk[i] for i in rows], pad_id)
            batch = {k: v.to(target.device) for k, v in batch.items()}
            top_ids, top_logps = rows_top_k(target, batch, top_k)  # (M, k): the loss rows, row after row
            counts = batch["loss_mask"].sum(1).tolist()
            for i, row_ids, row_logps in zip(rows, top_ids.split(counts), top_logps.split(counts), strict=True):
                ids[i], logps[i] = row_ids, row_logps
        tokens += write_shard(folder, shard, digests[shard * shard_size : (shard + 1) * shard_size], ids, logps)
    write_meta(folder, len(examples), tokens, top_k, n_shards, made_by)
    return folder


def content_digest(digests: list[bytes]) -> str:
    """What a cache was computed over, whatever the target, dtype or top-k: its examples in any order."""
    return hashlib.sha256(b"".join(sorted(digests))).hexdigest()[:16]


def say_why_not_reused(folder: Path, wanted: dict) -> None:
    """A cache of the same examples beside ``folder`` made another way: name it and what differs, so a
    rebuild is never silent (stderr)."""
    for meta_path in sorted(folder.parent.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("content") != wanted["content"]:
            continue
        keys = [key for key in ("top_k", "dtype", "target") if meta.get(key) != wanted[key]]
        differs = [f"{key} {meta.get(key)} (this run: {wanted[key]})" for key in keys]
        print(
            f"teacher cache: {meta_path.parent} holds these examples but was made with {', '.join(differs)}; "
            "computing a new one",
            file=sys.stderr,
        )
        return


def rows_top_k(target: PreTrainedModel, batch: dict, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k (token ids, log-probs), each (M, k), at a batch's M loss rows: its head and
    log-softmax at those rows only, a chunk of rows at a time (prompt and padding positions cost no head)."""
    hidden = vocab_cut.target_rows(target, batch, vocab_cut.loss_rows(batch["loss_mask"])).hidden  # (M, H)
    chunk = max(1, vocab_cut.CHUNK_ELEMENTS // target.config.vocab_size)
    ids, logps = [torch.zeros(0, top_k, dtype=torch.long)], [torch.zeros(0, top_k)]
    for start in range(0, len(hidden), chunk):
        top = torch.topk(vocab_cut.head_log_probs(target, hidden[start : start + chunk], None), top_k, dim=-1)
        ids.append(top.indices.cpu())
        logps.append(top.values.cpu())
    return torch.cat(ids), torch.cat(logps)


def save(
    folder: Path,
    examples: list[dict],
    entries: list[tuple[torch.Tensor, torch.Tensor]],
    top_k: int,
    shard_size: int = 256,
) -> Path:
    """Write ``entries`` computed elsewhere (e.g. a serving engine's prompt log-probs), one per example:
    (indices (N, k), log-probs (N, k)) at its N loss positions, as ``build`` writes them."""
    by_digest = {example_digest(e): entry for e, entry in zip(examples, entries, strict=True)}
    digests = unique_examples(examples)[0]
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = (len(digests) + shard_size - 1) // shard_size
    tokens = 0
    for shard in range(n_shards):
        chunk = digests[shard * shard_size : (shard + 1) * shard_size]
        tokens += write_shard(folder, shard, chunk, [by_digest[d][0] for d in chunk], [by_digest[d][1] for d in chunk])
    write_meta(folder, len(digests), tokens, top_k, n_shards)
    return folder


def unique_examples(examples: list[dict]) -> tuple[list[bytes], list[dict]]:
    """(content digests, examples) with each content once, in first-seen order."""
    unique: dict[bytes, dict] = {}
    for example in examples:
        unique.setdefault(example_digest(example), example)
    return list(unique), list(unique.values())


def write_shard(
    folder: Path, shard: int, digests: list[bytes], ids: list[torch.Tensor], logps: list[torch.Tensor]
) -> int:
    """One shard file, atomically: per example its digest and its (N, k) token ids (int32) and
    log-probs (float16); returns the tokens (loss positions) written."""
    counts = [len(i) for i in ids]
    tensors = {
        "indices": torch.cat(ids).to(torch.int32),
        "logprobs": torch.cat(logps).to(torch.float16),
        "counts": torch.tensor(counts),
        "digests": torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(-1, 16),
    }
    with atomic_path(folder / f"shard-{shard:05d}.safetensors") as tmp:
        save_file(tensors, tmp)
    return sum(counts)


def write_meta(folder: Path, examples: int, tokens: int, top_k: int, shards: int, made_by: dict | None = None) -> None:
    """meta.json, written last: a cache folder without it is incomplete. made_by: the target, dtype and
    content digest it was computed with (how a cache made another way is named when not reused)."""
    meta = {"examples": examples, "tokens": tokens, "top_k": top_k, "shards": shards, "bytes_per_token": 6 * top_k}
    meta |= made_by or {}
    write_text(folder / "meta.json", json.dumps(meta, indent=2))


def load(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example: (indices (N, k) int64, log-probs (N, k) float32) at its loss positions, in stored order."""
    return [entry for _, entry in read_entries(folder)]


def read_entries(folder: Path) -> list[tuple[bytes, tuple[torch.Tensor, torch.Tensor]]]:
    """(content digest, (indices, log-probs)) of every example of the cache, in stored order."""
    meta = json.loads((folder / "meta.json").read_text())
    entries = []
    for shard in range(meta["shards"]):
        data = load_file(folder / f"shard-{shard:05d}.safetensors")
        ids, logps = data["indices"].long(), data["logprobs"].float()
        digests = [bytes(row) for row in data["digests"].tolist()]
        offset = 0
        for digest, count in zip(digests, data["counts"].tolist(), strict=True):
            entries.append((digest, (ids[offset : offset + count], logps[offset : offset + count])))
            offset += count
    return entries


def lookup(folder: Path, examples: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache entries of ``examples``, in their order, found by content; a missing one is an error."""
    by_digest = dict(read_entries(folder))
    found = [by_digest.get(example_digest(e)) for e in examples]
    if any(entry is None for entry in found):
        raise DraftsmithError(
            f"the teacher cache {folder} lacks {sum(e is None for e in found)} of these examples; delete the "
            "folder to rebuild it"
        )
    return found


def dense_teacher_logprobs(
    entries: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Teacher log-probs (B, T, V) for a batch whose rows are ``entries``; uniform off the loss mask."""
    batch, width = mask.shape
    out = torch.full((batch, width, vocab_size), -math.log(vocab_size), device=mask.device)
    for row, (ids, logps) in enumerate(entries):
        out[row, mask[row]] = densify_topk(ids.to(mask.device), logps.to(mask.device), vocab_size)
    return out


def subset_logprobs(
    indices: torch.Tensor, logprobs: torch.Tensor, ids: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probs at ``temperature`` on the tokens ``ids`` of the distribution ``densify_topk`` makes
    of a top-k entry (top-k kept, the rest spread evenly): (M, k) ids and log-probs -> (M, N).

    The same values as ``log_softmax(densify_topk(indices, logprobs, V) / temperature)[:, ids]``,
    normalized over the full vocabulary, without building (M, V)."""
    top_k = indices.shape[-1]
    others = vocab_size - top_k
    top = logprobs.float() / temperature  # (M, k)
    rest = (1 - logprobs.float().exp().sum(-1, keepdim=True)).clamp(min=1e-9)  # (M, 1)
    log_other = (rest / max(others, 1)).log() / temperature  # (M, 1): each token outside the top k
    terms = [top, log_other + math.log(others)] if others else [top]
    log_norm = torch.logsumexp(torch.cat(terms, dim=-1), dim=-1, keepdim=True)  # (M, 1)
    column = torch.full((vocab_size,), len(ids), dtype=torch.long, device=ids.device)
    column[ids] = torch.arange(len(ids), device=ids.device)  # token -> its column; N for tokens not kept
    out = log_other.expand(-1, len(ids) + 1).clone()  # (M, N + 1): the last column collects the others
    out.scatter_(1, column[indices.long()], top)
    return out[:, : len(ids)] - log_norm


def subset_teacher_logprobs(
    entries: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Teacher log-probs (B, T, N) on the tokens ``ids`` for a batch whose rows are ``entries``;
    uniform off the loss mask (never used there)."""
    out = torch.full((*mask.shape, len(ids)), -math.log(vocab_size), device=mask.device)
    indices = torch.cat([e[0] for e in entries]).to(mask.device)  # (M, k): the rows' loss positions in order
    logprobs = torch.cat([e[1] for e in entries]).to(mask.device)
    out[mask] = subset_logprobs(indices, logprobs, ids, vocab_size, temperature)
    return out


def topk_log_probs(
    indices: torch.Tensor,
    logprobs: torch.Tensor,
    vocab_size: int,
    ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs at ``temperature`` of the distribution ``densify_topk`` makes of top-k entries (the
    top k kept, the rest spread evenly), at the loss rows: (M, k) ids and log-probs -> (M, N) on the
    tokens ``ids``, or (M, V) for ``ids`` None.

    The values of ``log_softmax(densify_topk(indices, logprobs, V) / temperature)`` (what the losses
    took of the dense cache), normalized over the full vocabulary from the k values and the rest's
    share (no log-softmax over V, nothing of size (B, T, V))."""
    if ids is not None:
        return subset_logprobs(indices, logprobs, ids, vocab_size, temperature)
    others = vocab_size - indices.shape[-1]
    top = logprobs.float() / temperature  # (M, k)
    rest = (1 - logprobs.float().exp().sum(-1, keepdim=True)).clamp(min=1e-9)  # (M, 1)
    log_other = (rest / max(others, 1)).log() / temperature  # (M, 1): each token outside the top k
    terms = [top, log_other + math.log(others)] if others else [top]
    log_norm = torch.logsumexp(torch.cat(terms, dim=-1), dim=-1, keepdim=True)  # (M, 1)
    out = (log_other - log_norm).expand(-1, vocab_size).clone()  # (M, V)
    return out.scatter_(1, indices.long(), top - log_norm)


def rows_teacher_log_probs(
    entries: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    vocab_size: int,
    ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Teacher log-probs at the loss rows of a batch whose rows are ``entries`` (their loss positions in
    order, which is the row-major order of the loss rows): (M, N) on ``ids``, or (M, V)."""
    indices = torch.cat([e[0] for e in entries]).to(device)  # (M, k)
    logprobs = torch.cat([e[1] for e in entries]).to(device)
    return topk_log_probs(indices, logprobs, vocab_size, ids, temperature)
