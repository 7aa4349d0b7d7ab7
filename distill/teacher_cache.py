"""The target's features as data: its top-k log-probabilities at the loss rows and, for a kind that reads
the target's hidden states, those states at every position, so training runs no target forward.

For every training example, at the positions that count in the loss, the cache keeps the target's
``k`` most likely token ids (int32) and their log-probabilities (float16): ``6 k`` bytes per token; a
compact ``Encoding`` keeps the ids as uint16 (a vocabulary of up to 65536 tokens) and the log-probs as
uint8 steps of ``LOGPROB_STEP`` nats (``3 k`` bytes), each shard saying how it is encoded.
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

A *feature store* is such a cache that also holds, per example and per target layer a kind's
``teacher_layers`` names, the hidden states (L, H) entering that layer at each of the example's L
positions, in a storage dtype (bfloat16 by default): ``hidden.{layer}`` in each shard, rows of its
examples one after the other. Its key adds the layers and that dtype; a store holding more layers
serves a kind that needs fewer (``find_store``). ``Store`` reads the states back by memory-mapped
slices, a batch at a time. Before a build, ``check_space`` prints the size it will take and the free
disk, and refuses a build that does not fit. Several processes build one store together (``part``):
each writes its own shards, the first writes ``meta.json`` once all are done.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from draftsmith.distill import vocab_cut
from draftsmith.distill.data import collate, length_buckets
from draftsmith.distill.dataset_builder import ProcessGroup
from draftsmith.distill.losses import TopkTeacher
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import atomic_path, write_text
from draftsmith.specdec.loading import draftsmith_home

# Stores a training run builds from its own target say which teacher computed them: revision 2 keeps the
# rotary frequencies in float32 for a bfloat16 target, as from_pretrained and every decoder here do
# (revision 1, unmarked, had rounded them to bfloat16: its stores are not reused).
TEACHER_REVISION = 2

# uint8 log-probs: -log p in steps of 1/16 nat, 0 to 255 (log p down to -15.9; lower is clipped there).
# Rounding moves a probability by at most e^(1/32) - 1 = 3.2 % of itself.
LOGPROB_STEP = 1 / 16


@dataclass(frozen=True)
class Encoding:
    """How a store keeps its top-k entries: token ids as ``int32`` or ``uint16`` (a vocabulary of up to
    65536 tokens), log-probs as ``float16`` or ``uint8`` (-log p in steps of ``LOGPROB_STEP``, the step
    written into each shard beside them)."""

    indices: str = "int32"
    logprobs: str = "float16"

    def __post_init__(self):
        if self.indices not in ("int32", "uint16") or self.logprobs not in ("float16", "uint8"):
            raise DraftsmithError(
                f"a teacher cache keeps token ids as int32 or uint16 and log-probs as float16 or uint8, got "
                f"{self.indices} and {self.logprobs}"
            )

    @property
    def bytes_per_entry(self) -> int:
        return (4 if self.indices == "int32" else 2) + (2 if self.logprobs == "float16" else 1)

    def error(self) -> float:
        """The most a stored log-prob differs from the one computed (nats): float16 rounding of values
        down to -16 (its spacing there, 2^-7, halved), or half a uint8 step."""
        return 2**-8 if self.logprobs == "float16" else LOGPROB_STEP / 2

    def tensors(self, ids: torch.Tensor, logps: torch.Tensor) -> dict[str, torch.Tensor]:
        """The shard tensors of ids (N, k) and log-probs (N, k) in this encoding."""
        if self.indices == "uint16" and len(ids) and int(ids.max()) >= 2**16:
            raise DraftsmithError(
                f"token id {int(ids.max())} does not fit uint16 indices; use int32 for this vocabulary"
            )
        out = {"indices": ids.to(torch.int32).to(getattr(torch, self.indices))}
        if self.logprobs == "float16":
            return out | {"logprobs": logps.to(torch.float16)}
        steps = (-logps.float() / LOGPROB_STEP).round().clamp(0, 255)
        return out | {"logprobs": steps.to(torch.uint8), "logprob_step": torch.tensor([LOGPROB_STEP])}

    @classmethod
    def for_vocab(cls, vocab_size: int, logprobs: str = "float16") -> Encoding:
        """uint16 ids where the vocabulary fits them, else int32."""
        return cls("uint16" if vocab_size <= 2**16 else "int32", logprobs)

    @property
    def name(self) -> str:
        return f"{self.indices}-{self.logprobs}"


def decode_logprobs(values: torch.Tensor, step: float | None) -> torch.Tensor:
    """Stored log-probs as float32: float16 as they are, uint8 as -``step`` times their value."""
    return values.float() if values.dtype != torch.uint8 else values.float() * -step


def shard_step(f) -> float | None:
    """The uint8 log-prob step an open shard was written with (None: its log-probs are float16)."""
    return float(f.get_tensor("logprob_step")[0]) if "logprob_step" in set(f.keys()) else None


@dataclass(frozen=True)
class StoreFormat:
    """What a store holds and how: the target's ``top_k`` tokens at each loss position in ``encoding``,
    and the hidden states entering ``layers`` in ``hidden_dtype``; ``shard_rows`` examples a shard."""

    top_k: int
    layers: tuple[int, ...] = ()
    hidden_dtype: torch.dtype = torch.bfloat16
    encoding: Encoding = field(default_factory=Encoding)
    shard_rows: int = 256

    def describe(self) -> dict:
        """What meta.json says of it."""
        out = {"top_k": self.top_k, "encoding": asdict(self.encoding)}
        if self.layers:
            out |= {"layers": sorted(self.layers), "hidden_dtype": dtype_name(self.hidden_dtype)}
        return out


def example_digest(example: dict) -> bytes:
    """16 bytes naming an example's content (its tokens and which of them count in the loss)."""
    return hashlib.sha256(json.dumps([example["input_ids"], example["loss_mask"]]).encode()).digest()[:16]


def cache_key(
    target_name: str,
    dtype: torch.dtype,
    examples: list[dict],
    top_k: int,
    temperature: float,
    layers: Sequence[int] = (),
    hidden_dtype: torch.dtype = torch.bfloat16,
) -> str:
    """The name of the cache of ``examples``: the same for the same examples in any order; a store with
    hidden states is named by its layers and their storage dtype too (a top-k cache keeps its old name)."""
    key = ["by-content", target_name, str(dtype), top_k, temperature]
    if dtype != torch.float32:
        key.append(f"teacher-revision-{TEACHER_REVISION}")
    if layers:
        key += [sorted(layers), str(hidden_dtype)]
    digest = hashlib.sha256(json.dumps(key).encode())
    for example_hash in sorted(example_digest(e) for e in examples):
        digest.update(example_hash)
    return digest.hexdigest()[:16]


def folder_for(
    target_name: str,
    dtype: torch.dtype,
    examples: list[dict],
    top_k: int,
    layers: Sequence[int] = (),
    hidden_dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Where the cache of ``examples`` under ``target_name`` in ``dtype`` lives (DRAFTSMITH_HOME)."""
    name = cache_key(target_name, dtype, examples, top_k, 1.0, layers, hidden_dtype)
    return draftsmith_home() / "teacher-cache" / name


def find_store(
    folder: Path, target: str, dtype: torch.dtype, examples: list[dict], top_k: int, layers: Sequence[int], hidden_dtype
) -> Path:
    """``folder``, or a complete store beside it over the same examples, target, dtype and top-k whose
    layers include ``layers`` (in the same storage dtype): a store with more layers serves fewer."""
    if (folder / "meta.json").is_file():
        return folder
    wanted = {"target_key": target, "dtype": dtype_name(dtype), "top_k": top_k}
    wanted["content"] = content_digest(unique_examples(examples)[0])
    if target != DATASET_TARGET and dtype != torch.float32:
        wanted["teacher_revision"] = TEACHER_REVISION
    for meta_path in sorted(folder.parent.glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        if any(meta.get(key) != value for key, value in wanted.items()):
            continue
        if not layers or (
            set(layers) <= set(meta.get("layers", [])) and meta["hidden_dtype"] == dtype_name(hidden_dtype)
        ):
            return meta_path.parent
    return folder


STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DATASET_TARGET = "dataset"  # the target_key of a store a dataset folder carries (the folder names its target)


def dataset_store(dataset: Path, content: str, top_k: int, layers: Sequence[int]) -> Path:
    """Where a ``draftsmith data`` folder keeps the feature store of its rows (``content``: their digest);
    the trainer finds it with ``find_store`` beside any other there."""
    return dataset / "feature-store" / f"k{top_k}-layers-{'-'.join(map(str, sorted(layers)))}-{content}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def disk_free(folder: Path) -> int:
    """Free bytes on the disk that holds ``folder`` (or its nearest existing parent)."""
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def store_bytes(examples: list[dict], top_k: int, layers: Sequence[int], hidden_size: int, hidden_dtype) -> int:
    """The bytes a store of ``examples`` takes at most: 6 k per loss token (int32 ids, float16 log-probs;
    a compact ``Encoding`` takes less) and, per stored layer, H values of ``hidden_dtype`` per position."""
    loss_tokens = sum(sum(e["loss_mask"]) for e in examples)
    positions = sum(len(e["input_ids"]) for e in examples)
    item = torch.empty((), dtype=hidden_dtype).element_size()
    return 6 * top_k * loss_tokens + positions * len(layers) * hidden_size * item


def check_space(folder: Path, needed: int, free_bytes: Callable[[Path], int] | None = None, say: bool = True) -> None:
    """Print the size a build will take and the free disk (``free_bytes``, else ``disk_free``); refuse, in
    one line, a build that does not fit."""
    free = (free_bytes or disk_free)(folder)
    if say:
        print(f"teacher store: {size_text(needed)} to write into {folder}; {size_text(free)} free", file=sys.stderr)
    if needed > free:
        raise DraftsmithError(
            f"the teacher store needs {size_text(needed)} but {folder} has {size_text(free)} free; free disk space, "
            "point DRAFTSMITH_HOME at a larger disk, or store less (teacher.cache_dtype, teacher.top_k, fewer examples)"
        )


def size_text(size: float) -> str:
    """Bytes as people read them: 7.9 kB, 1.23 GB, 4.1 TB."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} TB"


@torch.no_grad()
def build(
    target: PreTrainedModel,
    examples: list[dict],
    folder: Path,
    fmt: StoreFormat,
    group: ProcessGroup | None = None,
    batch_size: int = 8,
    progress: bool = True,
    target_key: str = "",
) -> Path:
    """Run the target once over ``examples`` and write the store ``fmt`` describes into ``folder``: the
    top-k at the loss positions (and the hidden states entering ``fmt.layers``), ``fmt.shard_rows``
    examples a shard.

    group: this process among the processes building it: each writes the shards ``shard % count ==
    index`` (a shard already written is kept: an interrupted build resumes); its barrier waits for all
    of them, then the first writes ``meta.json``. The size is checked against the free disk first."""
    if (folder / "meta.json").is_file():
        return folder
    group = group or ProcessGroup()
    digests, examples = unique_examples(examples)  # a repeated example is run once
    made_by = {"target": target.name_or_path, "dtype": dtype_name(target.dtype), **fmt.describe()}
    made_by |= {"content": content_digest(digests), "target_key": target_key, "teacher_revision": TEACHER_REVISION}
    if fmt.layers:
        made_by["hidden_size"] = target.config.hidden_size
    if progress:
        say_why_not_reused(folder, made_by)
    needed = store_bytes(examples, fmt.top_k, fmt.layers, target.config.hidden_size, fmt.hidden_dtype)
    check_space(folder, needed, say=group.is_main)
    folder.mkdir(parents=True, exist_ok=True)
    size, pad = fmt.shard_rows, target.config.pad_token_id or 0  # right padding: its value changes no row
    n_shards = (len(examples) + size - 1) // size
    mine = [shard for shard in range(n_shards) if shard % group.count == group.index]
    for shard in tqdm(mine, desc="teacher cache", disable=not progress, unit="shard"):
        if (folder / shard_name(shard)).is_file():
            continue
        chunk = examples[shard * size : (shard + 1) * size]
        ids, logps, hidden = chunk_features(target, chunk, fmt.top_k, fmt.layers, batch_size, pad)
        chunk_digests = digests[shard * size : (shard + 1) * size]
        write_shard(folder, shard, chunk_digests, ids, logps, hidden, fmt.hidden_dtype, fmt.encoding)
    group.barrier()
    if group.is_main:
        tokens = sum(sum(e["loss_mask"]) for e in examples)
        write_meta(folder, len(examples), tokens, fmt.top_k, n_shards, made_by)
    group.barrier()
    return folder


def chunk_features(
    target: PreTrainedModel, chunk: list[dict], top_k: int, layers: Sequence[int], batch_size: int, pad_id: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[int, list[torch.Tensor]]]:
    """Per example of ``chunk``: top-k (ids (N, k), log-probs (N, k)) at its N loss positions and, per
    layer, its hidden states (L, H) at its L positions. Batches of similar lengths (the target runs no
    padding to speak of), one window; entries come back in the chunk's order."""
    lengths = [len(e["input_ids"]) for e in chunk]
    ids, logps = [torch.empty(0)] * len(chunk), [torch.empty(0)] * len(chunk)
    hidden = {layer: [torch.empty(0)] * len(chunk) for layer in layers}
    for rows in length_buckets(list(range(len(chunk))), lengths, batch_size, window=len(chunk)):
        batch = collate([chunk[i] for i in rows], pad_id)
        batch = {k: v.to(target.device) for k, v in batch.items()}
        out = vocab_cut.target_rows(target, batch, vocab_cut.loss_rows(batch["loss_mask"]), layers)
        top_ids, top_logps = head_top_k(target, out.hidden, top_k)  # (M, k): the loss rows, row after row
        counts = batch["loss_mask"].sum(1).tolist()
        for i, row_ids, row_logps in zip(rows, top_ids.split(counts), top_logps.split(counts), strict=True):
            ids[i], logps[i] = row_ids, row_logps
        for layer in layers:
            for row, i in enumerate(rows):
                hidden[layer][i] = out.layers[layer][row, : lengths[i]].cpu()  # (L, H)
    return ids, logps, hidden


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


def head_top_k(target: PreTrainedModel, hidden: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target head's top-k (token ids, log-probs), each (M, k), over the full vocabulary at
    temperature 1, of decoder outputs ``hidden`` (M, H), a chunk of rows at a time."""
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
    fmt: StoreFormat,
    hidden: list[dict[int, torch.Tensor]] | None = None,
    made_by: dict | None = None,
) -> Path:
    """Write ``entries`` computed elsewhere (e.g. a serving engine's prompt log-probs), one per example:
    (indices (N, k), log-probs (N, k)) at its N loss positions, as ``build`` writes them in ``fmt``;
    ``hidden``: per example {layer: (L, H)} its hidden states (a vLLM server's), stored in
    ``fmt.hidden_dtype``. made_by: what ``meta.json`` says of how it was made (``build``'s fields)."""
    by_digest = {example_digest(e): entry for e, entry in zip(examples, entries, strict=True)}
    states = {example_digest(e): h for e, h in zip(examples, hidden, strict=True)} if hidden else {}
    layers = sorted(next(iter(states.values()))) if states else []
    digests = unique_examples(examples)[0]
    folder.mkdir(parents=True, exist_ok=True)
    size = fmt.shard_rows
    n_shards = (len(digests) + size - 1) // size
    tokens = 0
    for shard in range(n_shards):
        chunk = digests[shard * size : (shard + 1) * size]
        chunk_hidden = {layer: [states[d][layer] for d in chunk] for layer in layers}
        ids, logps = [by_digest[d][0] for d in chunk], [by_digest[d][1] for d in chunk]
        tokens += write_shard(folder, shard, chunk, ids, logps, chunk_hidden, fmt.hidden_dtype, fmt.encoding)
    write_meta(folder, len(digests), tokens, fmt.top_k, n_shards, {**fmt.describe(), **(made_by or {})})
    return folder


SHARD_BYTES = 1 << 30  # a streamed shard's hidden states, at most about: what ``write_streamed`` holds in memory


def stored_rows(folder: Path) -> tuple[set[bytes], int]:
    """What a build killed midway left in ``folder``: (the content digests of the examples its shard files
    hold, the first shard number none of them uses). Its hidden ``*.tmp`` leftovers are not shards."""
    if not folder.is_dir():
        return set(), 0
    numbers = [path.name.removeprefix("shard-").removesuffix(".safetensors") for path in folder.glob("shard-*")]
    return set(stored_digests(folder)), max((int(n) for n in numbers if n.isdigit()), default=-1) + 1


def write_streamed(
    folder: Path,
    rows: Iterable[tuple[bytes, tuple[torch.Tensor, torch.Tensor], dict[int, torch.Tensor]]],
    layers: Sequence[int],
    hidden_dtype: torch.dtype = torch.bfloat16,
    first_shard: int = 0,
    shard_rows: int = 256,
    shard_bytes: int = SHARD_BYTES,
) -> int:
    """Write rows computed elsewhere as they arrive (a serving engine's, in any order) into shards
    ``first_shard``, ``first_shard + 1``, ...: per row its content digest, its top-k (ids (N, k),
    log-probs (N, k)) and its {layer: (L, H)} states of ``layers``. A shard is written, atomically, once it
    holds ``shard_rows`` rows or ``shard_bytes`` of states in ``hidden_dtype``, so memory holds one shard's
    rows however many there are, and a build killed midway keeps every shard written (``stored_rows``).
    ``finish_streamed`` then writes ``meta.json``. Returns the rows written."""
    folder.mkdir(parents=True, exist_ok=True)
    item = torch.empty((), dtype=hidden_dtype).element_size()
    shard, written = first_shard, 0
    digests, ids, logps, hidden, size = [], [], [], {layer: [] for layer in layers}, 0
    for digest, (row_ids, row_logps), states in rows:
        digests.append(digest)
        ids.append(row_ids)
        logps.append(row_logps)
        for layer in layers:
            hidden[layer].append(states[layer].to(hidden_dtype))  # the storage dtype now: half a float32 row
            size += states[layer].numel() * item
        if len(digests) >= shard_rows or size >= shard_bytes:
            write_shard(folder, shard, digests, ids, logps, hidden, hidden_dtype)
            shard, written = shard + 1, written + len(digests)
            digests, ids, logps, hidden, size = [], [], [], {layer: [] for layer in layers}, 0
    if digests:
        write_shard(folder, shard, digests, ids, logps, hidden, hidden_dtype)
        written += len(digests)
    return written


def finish_streamed(folder: Path, examples: list[dict], top_k: int, made_by: dict | None = None) -> Path:
    """Write ``meta.json`` over the shards ``write_streamed`` wrote for ``examples``, once every example is
    in one of them (else refused: the store stays incomplete and the next build resumes it)."""
    digests, unique = unique_examples(examples)
    missing = len(set(digests) - set(stored_digests(folder)))
    if missing:
        raise DraftsmithError(
            f"the teacher store {folder} lacks {missing} of its {len(digests)} examples; run the same command "
            "again to compute them"
        )
    tokens = sum(sum(e["loss_mask"]) for e in unique)
    write_meta(folder, len(digests), tokens, top_k, 0, made_by)  # write_meta counts the shard files itself
    return folder


def unique_examples(examples: list[dict]) -> tuple[list[bytes], list[dict]]:
    """(content digests, examples) with each content once, in first-seen order."""
    unique: dict[bytes, dict] = {}
    for example in examples:
        unique.setdefault(example_digest(example), example)
    return list(unique), list(unique.values())


def shard_name(shard: int | str) -> str:
    return f"shard-{shard:05d}.safetensors" if isinstance(shard, int) else f"shard-{shard}.safetensors"


def write_shard(
    folder: Path,
    shard: int | str,
    digests: list[bytes],
    ids: list[torch.Tensor],
    logps: list[torch.Tensor],
    hidden: dict[int, list[torch.Tensor]] | None = None,
    hidden_dtype: torch.dtype = torch.bfloat16,
    encoding: Encoding | None = None,
) -> int:
    """One shard file, atomically: per example its digest and its (N, k) token ids and log-probs in
    ``encoding`` (int32 and float16 by default), and per layer of ``hidden`` its (L, H) states in
    ``hidden_dtype`` (rows of the examples one after the other, ``lengths`` L each); returns the tokens
    (loss positions) written."""
    counts = [len(i) for i in ids]
    tensors = (encoding or Encoding()).tensors(torch.cat(ids), torch.cat(logps))
    tensors |= {
        "counts": torch.tensor(counts),
        "digests": torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(-1, 16),
    }
    for layer, states in (hidden or {}).items():
        tensors[f"hidden.{layer}"] = torch.cat(states).to(hidden_dtype).contiguous()  # (sum L, H)
        tensors["lengths"] = torch.tensor([len(x) for x in states])
    with atomic_path(folder / shard_name(shard)) as tmp:
        save_file(tensors, tmp)
    return sum(counts)


def write_meta(folder: Path, examples: int, tokens: int, top_k: int, shards: int, made_by: dict | None = None) -> None:
    """meta.json, written last: a cache folder without it is incomplete. made_by: the target, dtype and
    content digest it was computed with (how a cache made another way is named when not reused)."""
    meta = {"examples": examples, "tokens": tokens, "top_k": top_k, "shards": shards}
    meta |= made_by or {}
    meta["bytes_per_token"] = Encoding(**meta.get("encoding", {})).bytes_per_entry * top_k
    meta["files"] = sorted(p.name for p in folder.glob("shard-*.safetensors"))
    meta["shards"] = len(meta["files"])
    write_text(folder / "meta.json", json.dumps(meta, indent=2))


def load(folder: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per example: (indices (N, k) int64, log-probs (N, k) float32) at its loss positions, in stored order."""
    return [entry for _, entry in read_entries(folder)]


def read_entries(folder: Path) -> list[tuple[bytes, tuple[torch.Tensor, torch.Tensor]]]:
    """(content digest, (indices, log-probs)) of every example of the cache, in stored order."""
    entries = []
    for name in shard_files(folder):
        with safe_open(folder / name, framework="pt") as f:  # the top-k only: hidden states stay on disk
            data = {key: f.get_tensor(key) for key in ("indices", "logprobs", "counts", "digests")}
            step = shard_step(f)
        ids, logps = data["indices"].long(), decode_logprobs(data["logprobs"], step)
        digests = [bytes(row) for row in data["digests"].tolist()]
        offset = 0
        for digest, count in zip(digests, data["counts"].tolist(), strict=True):
            entries.append((digest, (ids[offset : offset + count], logps[offset : offset + count])))
            offset += count
    return entries


def shard_files(folder: Path) -> list[str]:
    """The shard files of a complete cache, in stored order (a cache of before ``files`` numbers them)."""
    meta = json.loads((folder / "meta.json").read_text())
    return meta.get("files") or [shard_name(shard) for shard in range(meta["shards"])]


def stored_digests(folder: Path) -> list[bytes]:
    """The content digests of every example in the shard files of ``folder`` (complete or not)."""
    digests = []
    for path in sorted(folder.glob("shard-*.safetensors")):
        with safe_open(path, framework="pt") as f:
            digests += [bytes(row) for row in f.get_tensor("digests").tolist()]
    return digests


class StoredEntries(Mapping):
    """The top-k entries of a store's examples by content digest, each read from its shard when asked
    (memory-mapped slices): a process holds where each example lies, not the entries, so its memory
    does not grow with the store. ``entries[digest]`` -> (indices (N, k), log-probs (N, k)).

    where: digest -> (shard file, first loss row, loss rows); shard: a shard file's open handle."""

    def __init__(self, where: dict[bytes, tuple[str, int, int]], shard: Callable[[str], object]):
        self.where, self.shard = where, shard
        self.steps: dict[str, float | None] = {}  # shard file -> its uint8 log-prob step (None: float16)

    def __getitem__(self, digest: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        name, start, count = self.where[digest]
        rows, f = slice(start, start + count), self.shard(name)
        if name not in self.steps:
            self.steps[name] = shard_step(f)
        return f.get_slice("indices")[rows].long(), decode_logprobs(f.get_slice("logprobs")[rows], self.steps[name])

    def __contains__(self, digest: object) -> bool:
        return digest in self.where

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class ExampleEntries(Sequence):
    """The entries of a list of examples, in its order, read when indexed (``StoredEntries``)."""

    def __init__(self, entries: StoredEntries, digests: list[bytes]):
        self.entries, self.digests = entries, digests

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.entries[self.digests[i]]

    def __len__(self) -> int:
        return len(self.digests)


class Store:
    """A complete store read back: its top-k entries and hidden states read from memory-mapped slices
    of its shards at each batch, never all held at once. Opening it reads each shard's index (digests,
    loss rows and lengths per example) once; a shard's handle is opened the first time a batch needs it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.meta = json.loads((folder / "meta.json").read_text())
        self.layers: tuple[int, ...] = tuple(self.meta.get("layers", ()))
        self.files: dict[str, object] = {}  # shard file -> its open handle
        entries_at: dict[bytes, tuple[str, int, int]] = {}  # digest -> (shard file, first loss row, loss rows)
        self.where: dict[bytes, tuple[str, int, int]] = {}  # digest -> (shard file, first row, length)
        for name in shard_files(folder):
            with safe_open(folder / name, framework="pt") as f:
                digests = [bytes(d) for d in f.get_tensor("digests").tolist()]
                counts = f.get_tensor("counts").tolist()
                lengths = f.get_tensor("lengths").tolist() if self.layers else []
            for at, sizes in ((entries_at, counts), (self.where, lengths)):
                starts = [0, *torch.tensor(sizes, dtype=torch.long).cumsum(0).tolist()]
                for row, size in enumerate(sizes):
                    at[digests[row]] = (name, starts[row], size)
        self.entries = StoredEntries(entries_at, self.shard)

    def shard(self, name: str):
        """The open (memory-mapped) handle of the shard file ``name``."""
        if name not in self.files:
            self.files[name] = safe_open(self.folder / name, framework="pt")
        return self.files[name]

    def lookup(self, examples: list[dict]) -> ExampleEntries:
        """The top-k entries of ``examples``, in their order, each read when indexed; a missing one is an error."""
        digests = [example_digest(e) for e in examples]
        missing = sum(digest not in self.entries for digest in digests)
        if missing:
            raise DraftsmithError(
                f"the teacher cache {self.folder} lacks {missing} of these examples; delete the folder to rebuild it"
            )
        return ExampleEntries(self.entries, digests)

    def check_layers(self, layers: Sequence[int]) -> None:
        missing = sorted(set(layers) - set(self.layers))
        if missing:
            raise DraftsmithError(
                f"the teacher store {self.folder} holds layers {list(self.layers)}, not {missing}; delete it to rebuild"
            )

    def hidden(
        self, digests: list[bytes], layers: Sequence[int], width: int, dtype: torch.dtype, device: torch.device
    ) -> dict[int, torch.Tensor]:
        """{layer: (B, T, H)} the stored states of a right-padded batch whose rows are ``digests``
        (zeros at the padding, which no loss row attends to), in ``dtype`` on ``device``."""
        size = self.meta["hidden_size"]
        out = {layer: torch.zeros(len(digests), width, size, dtype=dtype) for layer in layers}
        for row, digest in enumerate(digests):
            name, start, length = self.where[digest]
            for layer in layers:
                out[layer][row, :length] = self.shard(name).get_slice(f"hidden.{layer}")[start : start + length]
        return {layer: states.to(device) for layer, states in out.items()}


def topk_teacher(
    indices: torch.Tensor,
    logprobs: torch.Tensor,
    vocab_size: int,
    ids: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> TopkTeacher:
    """The distribution ``densify_topk`` makes of top-k entries (the top k kept, the rest spread
    evenly) at ``temperature``, at the loss rows, on the columns of a head over ``ids`` (N,) or over
    the full vocabulary (None): (M, k) ids and log-probs -> its sparse form, normalized over the full
    vocabulary from the k values and the rest's share (no log-softmax over V)."""
    others = vocab_size - indices.shape[-1]
    top = logprobs.float() / temperature  # (M, k)
    rest = (1 - logprobs.float().exp().sum(-1, keepdim=True)).clamp(min=1e-9)  # (M, 1)
    log_other = (rest / max(others, 1)).log() / temperature  # (M, 1): each token outside the top k
    terms = [top, log_other + math.log(others)] if others else [top]
    log_norm = torch.logsumexp(torch.cat(terms, dim=-1), dim=-1, keepdim=True)  # (M, 1)
    if ids is None:
        return TopkTeacher(indices.long(), top - log_norm, log_other - log_norm, vocab_size)
    column = torch.full((vocab_size,), len(ids), dtype=torch.long, device=ids.device)
    column[ids] = torch.arange(len(ids), device=ids.device)  # token -> its column; N for tokens not kept
    return TopkTeacher(column[indices.long()], top - log_norm, log_other - log_norm, len(ids))


def rows_teacher_argmax(entries: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The target's most probable token at the loss rows of a batch whose rows are ``entries`` (M,):
    the stored top-k entry of highest log-prob (the store's top-k is over the full vocabulary)."""
    indices = torch.cat([e[0] for e in entries])  # (M, k)
    best = torch.cat([e[1] for e in entries]).float().argmax(-1, keepdim=True)  # (M, 1)
    return indices.gather(1, best)[:, 0].long().to(device)


def rows_teacher_log_probs(
    entries: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    vocab_size: int,
    ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    sparse: bool = False,
) -> torch.Tensor | TopkTeacher:
    """Teacher log-probs at the loss rows of a batch whose rows are ``entries`` (their loss positions in
    order, which is the row-major order of the loss rows): (M, N) on ``ids``, or (M, V); ``sparse``:
    as a ``TopkTeacher`` (forward KL needs no dense teacher)."""
    indices = torch.cat([e[0] for e in entries]).to(device)  # (M, k)
    logprobs = torch.cat([e[1] for e in entries]).to(device)
    teacher = topk_teacher(indices, logprobs, vocab_size, ids, temperature)
    return teacher if sparse else teacher.dense()
