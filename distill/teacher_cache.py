"""An offline cache of the teacher's top-k log-probabilities, so later epochs skip its forward pass.

For every training example, at the positions that count in the loss, the cache keeps the target's
``k`` most likely token ids (int32) and their log-probabilities (float16): ``6 k`` bytes per token.
It is written as ``safetensors`` shards of ``shard_size`` examples, each written atomically, with
``meta.json`` written last: a folder without it is incomplete and rebuilt.
Losses read it back through ``losses.densify_topk``.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from draftsmith.distill.data import collate
from draftsmith.distill.losses import densify_topk
from draftsmith.specdec.files import atomic_path, write_text


def cache_key(target_name: str, dtype: torch.dtype, examples: list[dict], top_k: int, temperature: float) -> str:
    digest = hashlib.sha256(json.dumps([target_name, str(dtype), top_k, temperature]).encode())
    for e in examples:
        digest.update(json.dumps([e["input_ids"], e["loss_mask"]]).encode())
    return digest.hexdigest()[:16]


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
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = (len(examples) + shard_size - 1) // shard_size
    tokens = 0
    for shard in tqdm(range(n_shards), desc="teacher cache", disable=not progress, unit="shard"):
        chunk = examples[shard * shard_size : (shard + 1) * shard_size]
        ids, logps, counts = [], [], []
        for start in range(0, len(chunk), batch_size):
            batch = collate(chunk[start : start + batch_size], pad_id)
            batch = {k: v.to(target.device) for k, v in batch.items()}
            logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            top = torch.topk(torch.log_softmax(logits.float(), -1), top_k, dim=-1)
            for row in range(len(logits)):
                mask = batch["loss_mask"][row]
                ids.append(top.indices[row][mask].to(torch.int32).cpu())
                logps.append(top.values[row][mask].to(torch.float16).cpu())
                counts.append(int(mask.sum()))
        tokens += sum(counts)
        tensors = {"indices": torch.cat(ids), "logprobs": torch.cat(logps), "counts": torch.tensor(counts)}
        with atomic_path(folder / f"shard-{shard:05d}.safetensors") as tmp:
            save_file(tensors, tmp)
    meta = {
        "examples": len(examples),
        "tokens": tokens,
        "top_k": top_k,
        "shards": n_shards,
        "bytes_per_token": 6 * top_k,
    }
    write_text(folder / "meta.json", json.dumps(meta, indent=2))
    return folder


def load(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example: (indices (N, k) int64, log-probs (N, k) float32) at its loss positions, in order."""
    meta = json.loads((folder / "meta.json").read_text())
    entries = []
    for shard in range(meta["shards"]):
        data = load_file(folder / f"shard-{shard:05d}.safetensors")
        ids, logps = data["indices"].long(), data["logprobs"].float()
        offset = 0
        for count in data["counts"].tolist():
            entries.append((ids[offset : offset + count], logps[offset : offset + count]))
            offset += count
    return entries


def dense_teacher_logprobs(
    entries: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Teacher log-probs (B, T, V) for a batch whose rows are ``entries``; uniform off the loss mask."""
    batch, width = mask.shape
    out = torch.full((batch, width, vocab_size), -math.log(vocab_size), device=mask.device)
    for row, (ids, logps) in enumerate(entries):
        out[row, mask[row]] = densify_topk(ids.to(mask.device), logps.to(mask.device), vocab_size)
    return out
