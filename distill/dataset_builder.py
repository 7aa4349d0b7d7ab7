"""A training set written by the target: prompts in, the target's answers out, kept as a dataset on disk.

A dataset folder is laid out as the Hugging Face hub lays out a dataset, so that
``datasets.load_dataset(FOLDER, split="train")`` and ``push_to_hub`` work with nothing of draftsmith
installed::

    README.md            the dataset card: YAML metadata naming the split's data files one by one, their
                         rows and bytes, and the manifest's facts (target, sampling, counts, complete or
                         not), then text; rewritten with every shard written or removed
    data/train-ID-rR-NNNNN.parquet   answer rows, one parquet file per shard (ID: the dataset's own id,
                         R: the process that wrote it)
    manifest.json        the settings the rows were made with, counts, tokens, seconds taken by builds
                         that ran to the end (a killed one adds its rows but not its time)
    prompts/             prompts the target wrote itself (when the source is ``self``), JSONL per round

Folders of the layout before (``shards/shard-rR-NNNNN/``, one ``save_to_disk`` folder per shard) still
load; ``draftsmith data`` on one converts it once, shard by shard, and says so.

``datasets`` keys its cache of a local folder by the folder's base name and a hash of the card's
``configs`` (the data file patterns as written, not the files they match) and ``dataset_info``. So the
card lists the exact shard files, whose names carry the dataset's id, and the split's rows and bytes:
two folders of one name, or one folder before and after rows were added, never share a cache entry.

Every file and shard is written under a temporary name and renamed when complete, so a build killed
at any point keeps every finished shard and nothing half-written. Building again into the same folder
continues: rows already present (by prompt id and sample number) are not made again, and asking for
more prompts or samples adds rows. The settings that decide what a row holds (target, dtype,
sampling, seed, max_new_tokens, prompt source, and the engine that generated: draftsmith's own
decoder or vLLM, see ``engines``) are fixed by the first build; a build with another value is
refused, naming the field, so a dataset never mixes rows made two ways.

With several processes (``accelerate launch``) each process answers a disjoint share of the prompts
(every N-th) and writes its own shards; the main process writes the manifest.

Rows: ``prompt_id``, ``sample``, ``source``, ``topic``, ``messages`` (the conversation awaiting the
answer), ``prompt_ids``, ``answer_ids``, ``answer_text``, ``finished`` (ended with an EOS id rather
than at ``max_new_tokens``). ``training_examples`` turns them into ``{"input_ids", "loss_mask"}``.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml
from datasets.table import InMemoryTable
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from draftsmith.distill.data import target_examples
from draftsmith.distill.dataset_card import check_card_files, missing_manifest
from draftsmith.distill.engines import Writer
from draftsmith.distill.prompt_filters import Deduplicator, PromptFilter
from draftsmith.distill.prompt_sources import PromptRecord
from draftsmith.distill.self_prompts import (
    RoundPlan,
    RoundResult,
    SelfPromptSettings,
    derived_seed,
    topic_shares,
    write_prompt_round,
)
from draftsmith.specdec.continuous import Progress
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import atomic_path, write_text
from draftsmith.specdec.loading import same_model
from draftsmith.specdec.locks import LOCK_FILE
from draftsmith.specdec.prompts import encode_chat
from draftsmith.specdec.sampling import SamplingParams

MANIFEST = "manifest.json"
CARD = "README.md"
DATA = "data"  # answer shards: data/train-ID-rR-NNNNN.parquet
SPLIT = "train"
LEGACY_SHARDS = "shards"  # the layout before: shards/shard-rR-NNNNN/, one save_to_disk folder per shard
PROMPTS = "prompts"
# Every shard is written with these types, so the split's files share one schema (a shard whose answers
# happen to be all empty would otherwise get another).
ROW_FEATURES = datasets.Features(
    {
        "prompt_id": datasets.Value("string"),
        "sample": datasets.Value("int64"),
        "source": datasets.Value("string"),
        "topic": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "prompt_ids": datasets.List(datasets.Value("int64")),
        "answer_ids": datasets.List(datasets.Value("int64")),
        "answer_text": datasets.Value("string"),
        "finished": datasets.Value("bool"),
    }
)


@dataclass(frozen=True)
class BuildSettings:
    """What every row of a dataset was made with; fixed when the dataset is created."""

    target: str  # the target as given (alias, folder, hub id)
    dtype: str  # the dtype the target ran in, e.g. "float32"
    sampling: dict  # {"temperature", "top_k", "top_p"}
    seed: int
    max_new_tokens: int
    prompt_source: dict  # what identifies the prompts: kind, path or hub id, self-prompt settings
    engine: str = "draftsmith"  # what generated prompts and answers: draftsmith (the bundled decoder) or vllm

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ProcessGroup:
    """This process's place among the processes building one dataset (one process by default)."""

    index: int = 0
    count: int = 1
    barrier: Callable[[], None] = field(default=lambda: None)  # all processes wait here

    @property
    def is_main(self) -> bool:
        return self.index == 0


def sampling_settings(sampling: SamplingParams) -> dict:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def changed_field(old: dict, new: dict, prefix: str = "") -> str | None:
    """The first field (dotted path) whose value differs between two settings dicts, or None."""
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = changed_field(a, b, f"{prefix}{key}.")
            if inner is not None:
                return inner
        elif a != b:
            return f"{prefix}{key}"
    return None


def lookup(settings: dict, dotted: str):
    for part in dotted.split("."):
        settings = settings.get(part) if isinstance(settings, dict) else None
    return settings


SHIPPED = Path(__file__).parent / "data"  # datasets that ship with draftsmith, by folder name


def built_folder(spec: str) -> Path | None:
    """The folder of the ``draftsmith data`` dataset that ``spec`` names: a path to one, or the name of
    one that ships with draftsmith (``smollm2-self``); None when ``spec`` is another kind of source."""
    if read_manifest(Path(spec)) is not None:
        return Path(spec)
    if "/" not in spec and read_manifest(SHIPPED / spec) is not None:
        return SHIPPED / spec
    return None


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DraftsmithError(f"{path} is not valid JSON ({err.msg}); it was not written by draftsmith data") from err


def check_trusted(folder: Path, target: str, allow_incomplete: bool = False) -> dict:
    """The manifest of a dataset folder fit to train ``target`` on; anything else is refused in one line.

    Its rows must be the answers of ``target`` (the same model, also through a symbolic link), and its
    build must have finished unless ``data.allow_incomplete``: a build that was interrupted, or is still
    running, holds only part of what was asked for.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        not_built = f"{folder} is not a dataset built by draftsmith data (no {MANIFEST})"
        raise DraftsmithError(missing_manifest(folder) or not_built)
    check_card_files(folder)
    made_by = manifest["settings"]["target"]
    if not same_model(made_by, target):
        raise DraftsmithError(
            f"{folder} holds answers of target {made_by!r}, not of {target!r}; distill with target={made_by} "
            "or build a dataset with this target (draftsmith data --target ...)"
        )
    check_shards(folder, manifest)
    if not manifest.get("complete", False) and not allow_incomplete:
        raise DraftsmithError(
            f"{folder} is an incomplete build (interrupted, or still running): run the same draftsmith data "
            "command again to finish it, or set data.allow_incomplete=true to train on the rows it has"
        )
    return manifest


def check_settings(folder: Path, settings: BuildSettings) -> dict | None:
    """The manifest of an existing dataset made with ``settings`` (None for a new one); refuse any other.

    A folder that exists, is not empty and has no manifest is refused too: it is not a dataset.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        if folder.is_dir() and any(p.name != LOCK_FILE for p in folder.iterdir()):  # a build's lock alone: new
            not_built = f"{folder} exists and is not a draftsmith dataset (no {MANIFEST}); choose another"
            raise DraftsmithError(missing_manifest(folder) or not_built)
        return None
    check_card_files(folder)
    # Datasets from before engines were recorded were all made by the bundled decoder.
    old, new = {"engine": "draftsmith", **manifest["settings"]}, settings.to_dict()
    if same_model(old["target"], new["target"]):  # the target's folder named another way (a link, a trailing /)
        new["target"] = old["target"]
    if grows_topics(old.get("prompt_source") or {}, new["prompt_source"]):  # the rows it has keep their meaning
        old = {**old, "prompt_source": {**old["prompt_source"], "topics": new["prompt_source"]["topics"]}}
    name = changed_field(old, new)
    if name is not None:
        raise DraftsmithError(
            f"{folder} was built with {name}={json.dumps(lookup(old, name))}, not {json.dumps(lookup(new, name))}; "
            "rows made two ways would mix. Write to a new --output folder, or keep the dataset's setting"
        )
    return manifest


def grows_topics(old: dict, new: dict) -> bool:
    """Whether self-written prompts steered by ``old``'s topics may go on under ``new``'s: every old
    topic is still asked for (each keeps the prompts it has) and the rest is new. Writing without
    topics is another mix, and stays one."""
    before, after = old.get("topics"), new.get("topics")
    if old.get("kind") != "self" or new.get("kind") != "self" or not before or not after:
        return False
    return set(before) <= set(after)


def open_dataset(folder: Path, settings: BuildSettings, group: ProcessGroup, engine: dict) -> dict:
    """Create the dataset folder, or check that an existing one was made with the same settings.

    Returns the manifest. The main process removes temporaries a killed build left behind.
    engine: the generating engine's description, recorded as this build's.
    """
    folder = Path(folder)
    existing = check_settings(folder, settings)
    manifest = existing or {"settings": settings.to_dict(), "seconds": 0.0}
    recorded = settings.to_dict() | ({"target": existing["settings"]["target"]} if existing else {})
    manifest.update(settings=recorded, engine=engine, complete=False)  # complete once this build ends
    group.barrier()  # every process has read the folder before the main process writes to it
    if group.is_main:
        for stale in folder.glob("**/.*.tmp"):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        manifest.setdefault("id", uuid.uuid4().hex[:8])
        repair(folder)
        convert_legacy(folder)
        name_shards(folder, manifest["id"])
        manifest["draftsmith_version"] = draftsmith_version()
        write_text(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        write_card(folder, manifest)
    group.barrier()
    return read_manifest(folder)  # the main process's, with the dataset's id


def draftsmith_version() -> str:
    """The installed draftsmith's version, or a note that it runs from a checkout that is not installed."""
    try:
        return importlib.metadata.version("draftsmith")
    except importlib.metadata.PackageNotFoundError:
        return "not installed (run from a checkout)"


def token_bar(desc: str, enabled: bool) -> tuple[Callable[[Progress], None] | None, Callable[[], None]]:
    """A tqdm bar in tokens (rate in tokens/s, ETA from the most tokens still to come): (callback, close)."""
    if not enabled:
        return None, lambda: None
    bar = tqdm(desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True)

    def update(progress: Progress) -> None:
        bar.total = progress.tokens_bound
        bar.update(progress.tokens - bar.n)
        bar.set_postfix_str(f"{progress.rows_done}/{progress.rows_total} rows", refresh=False)

    return update, bar.close


def shard_paths(folder: Path) -> list[Path]:
    """The finished answer shards (parquet files, or folders of the old layout), in name order
    (temporaries start with a dot and are skipped)."""
    folder = Path(folder)
    shards = list((folder / DATA).glob(f"{SPLIT}-*.parquet"))
    shards += [p for p in (folder / LEGACY_SHARDS).glob("shard-r*") if p.is_dir()]
    return sorted(shards, key=lambda p: shard_place(shard_name(p)))


def shard_name(path: Path) -> str:
    """A shard's name (``train-1a2b3c4d-r0-00003``; ``train-r0-00003`` before datasets had an id,
    ``shard-r0-00003`` in the old layout), which keys its teacher cache."""
    return path.stem if path.suffix == ".parquet" else path.name


SHARD_NAME = re.compile(r"(?:train|shard)-(?:([0-9a-f]+)-)?r(\d+)-(\d+)")


def shard_place(name: str) -> tuple[int, int]:
    """(process, serial) of a shard name: the order shards are read in."""
    match = SHARD_NAME.fullmatch(name)
    if match is None:
        return (sys.maxsize, sys.maxsize)
    return int(match[2]), int(match[3])


def name_shards(folder: Path, dataset_id: str) -> None:
    """Give shards named before datasets had an id (``train-r0-00003``) the dataset's id, their teacher
    caches with them, so that no other folder lists the same data files."""
    folder = Path(folder)
    for path in shard_paths(folder):
        match = SHARD_NAME.fullmatch(shard_name(path))
        if path.suffix != ".parquet" or match is None or match[1] is not None:
            continue
        name = f"{SPLIT}-{dataset_id}-r{match[2]}-{match[3]}"
        for cache in folder.glob(f"teacher-cache-k*/{shard_name(path)}"):
            cache.rename(cache.with_name(name))
        path.rename(path.with_name(f"{name}.parquet"))


def read_shard(path: Path) -> datasets.Dataset:
    """A shard's rows; a shard that cannot be read is named, with how to repair it."""
    try:
        if path.suffix == ".parquet":
            return datasets.Dataset(InMemoryTable(pq.read_table(parquet_file(path))))
        return datasets.load_from_disk(str(path))
    except (OSError, ValueError, pa.ArrowException) as err:  # FileNotFoundError, ArrowInvalid, bad JSON
        raise DraftsmithError(damaged(path, err)) from err


def parquet_file(path: Path) -> Path:
    if not path.is_file():  # pyarrow would read a folder as a partitioned dataset
        raise IsADirectoryError(f"{path.name} is not a file")
    return path


def damaged(path: Path, err: Exception) -> str:
    folder = path.parent.parent
    return (
        f"{folder}: the shard {path.relative_to(folder)} is damaged ({' '.join(str(err).split())[:160]}); run "
        f"draftsmith data on {folder} again (the same command) to rebuild it"
    )


def shard_rows(path: Path) -> int:
    """A shard's row count, read cheaply (a parquet file's footer, an old folder's memory map); a
    damaged shard raises ``DraftsmithError`` naming it."""
    try:
        if path.suffix == ".parquet":
            return pq.read_metadata(parquet_file(path)).num_rows
        return len(datasets.load_from_disk(str(path)))
    except (OSError, ValueError, pa.ArrowException) as err:
        raise DraftsmithError(damaged(path, err)) from err


def shard_problem(path: Path) -> str | None:
    """What is wrong with a shard (see ``shard_rows``), or None."""
    try:
        shard_rows(path)
    except DraftsmithError as err:
        return str(err)
    return None


def check_shards(folder: Path, manifest: dict) -> None:
    """Refuse a dataset with a damaged shard, naming it, or, when its build finished, with fewer rows
    than the manifest counts (a shard file deleted)."""
    rows = sum(shard_rows(path) for path in shard_paths(folder))
    counted = manifest.get("counts", {}).get("rows") if manifest.get("complete") else None
    if counted is not None and rows < counted:
        raise DraftsmithError(
            f"{folder} holds {rows} rows but its manifest counts {counted}: a shard was removed; run draftsmith "
            f"data on {folder} again (the same command) to rebuild it"
        )


def repair(folder: Path) -> None:
    """Remove damaged shards (and their teacher caches) so that the build answers their rows again."""
    for path in shard_paths(folder):
        if shard_problem(path) is None:
            continue
        print(f"{folder}: the shard {path.relative_to(folder)} is damaged; rebuilding its rows", file=sys.stderr)
        for cache in Path(folder).glob(f"teacher-cache-k*/{shard_name(path)}"):
            shutil.rmtree(cache)
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def convert_legacy(folder: Path) -> None:
    """Convert the shards of the old layout to parquet files under data/, once, each atomically: a
    conversion that is killed resumes where it stopped (the old folder goes only after its file is in place)."""
    folder = Path(folder)
    legacy = [p for p in shard_paths(folder) if p.is_dir()]
    if not legacy:
        return
    for path in legacy:
        name = f"{SPLIT}-{path.name.removeprefix('shard-')}"
        final = folder / DATA / f"{name}.parquet"
        if not final.is_file():
            with atomic_path(final) as tmp:
                read_shard(path).cast(ROW_FEATURES).to_parquet(str(tmp))
        for cache in folder.glob(f"teacher-cache-k*/{path.name}"):
            cache.rename(cache.with_name(name))
        shutil.rmtree(path)
    (folder / LEGACY_SHARDS).rmdir()
    print(f"{folder}: converted {len(legacy)} shard(s) of the old layout (shards/) to {DATA}/*.parquet")


def write_shard(folder: Path, process_index: int, rows: list[dict]) -> Path:
    """Save ``rows`` as this process's next shard, atomically, and the card that lists it; return its path."""
    manifest = read_manifest(folder) or {}
    places = [shard_place(shard_name(p)) for p in shard_paths(folder)]
    serial = 1 + max((s for process, s in places if process == process_index), default=-1)
    prefix = f"{SPLIT}-{manifest['id']}" if "id" in manifest else SPLIT
    final = Path(folder) / DATA / f"{prefix}-r{process_index}-{serial:05d}.parquet"
    with atomic_path(final) as tmp:
        datasets.Dataset.from_list(rows, features=ROW_FEATURES).to_parquet(str(tmp))
    if manifest:
        write_card(folder, manifest)
    return final


def load_built(folder: Path) -> datasets.Dataset:
    """Every finished row of a dataset folder, as one dataset (shards in name order)."""
    folder = Path(folder)
    if read_manifest(folder) is None:
        raise DraftsmithError(f"{folder} is not a dataset built by draftsmith data (no {MANIFEST})")
    shards = [read_shard(p) for p in shard_paths(folder)]
    if not shards:
        raise DraftsmithError(f"{folder} holds no rows yet; run draftsmith data to build it")
    return datasets.concatenate_datasets(shards)


def done_keys(folder: Path) -> set[tuple[str, int]]:
    """(prompt_id, sample) of every row already written."""
    keys: set[tuple[str, int]] = set()
    for path in shard_paths(folder):
        shard = read_shard(path).select_columns(["prompt_id", "sample"])
        keys.update(zip(shard["prompt_id"], shard["sample"], strict=True))
    return keys


def write_card(folder: Path, manifest: dict) -> None:
    """The dataset card: YAML metadata that names the split's data files (how ``load_dataset`` and the hub
    find them) and the manifest's facts, then the card's text (kept when the card has some already)."""
    facts = {
        "complete": manifest.get("complete", False),
        **{k: manifest["settings"][k] for k in ("target", "dtype", "engine", "sampling", "seed", "max_new_tokens")},
        "prompt_source": manifest["settings"]["prompt_source"].get("kind"),
        **{k: v for k, v in manifest.get("counts", {}).items() if not isinstance(v, dict)},
    }
    files = [p for p in shard_paths(folder) if p.suffix == ".parquet"]
    rows = sum(shard_rows(p) for p in files)
    size = sum(p.stat().st_size for p in files)
    metadata = {
        "configs": [
            {
                "config_name": "default",
                "data_files": [{"split": SPLIT, "path": [p.relative_to(folder).as_posix() for p in files]}],
            }
        ],
        # datasets hashes this and the file list into its cache key: the key follows rows and bytes
        "dataset_info": {
            "config_name": "default",
            "splits": [{"name": SPLIT, "num_bytes": size, "num_examples": rows}],
            "download_size": size,
            "dataset_size": size,
        },
        "task_categories": ["text-generation"],
        "tags": ["draftsmith", "distillation", "speculative-decoding", "synthetic"],
        "draftsmith": facts,
    }
    path = Path(folder) / CARD
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if text.startswith("---\n") and "\n---\n" in text[4:]:
        text = text[4:].split("\n---\n", 1)[1].lstrip("\n")
    if not text.strip():
        text = (
            f"# {Path(folder).resolve().name}\n\nAnswers of `{facts['target']}` written by `draftsmith data` "
            'for distilling draft models. Load it with `datasets.load_dataset(FOLDER, split="train")`; '
            "`manifest.json` records every setting.\n"
        )
    write_text(path, f"---\n{yaml.safe_dump(metadata, sort_keys=False)}---\n\n{text}")


def training_examples(folder: Path, max_length: int) -> list[dict]:
    """``{"input_ids", "loss_mask"}`` examples of a built dataset: the loss covers the answer tokens."""
    rows = load_built(folder).select_columns(["prompt_ids", "answer_ids"])
    return target_examples(rows["prompt_ids"], rows["answer_ids"], max_length)


@dataclass(frozen=True)
class SelfPromptRequest:
    """Prompts the target writes itself: how many in all, how, and which ones are kept."""

    count: int
    settings: SelfPromptSettings = SelfPromptSettings()
    filters: PromptFilter = PromptFilter()

    def source_settings(self) -> dict:
        """What identifies these prompts in the manifest (the count may grow; the rest is fixed)."""
        return {"kind": "self", **self.settings.to_dict(), "filters": asdict(self.filters)}


def read_self_prompts(folder: Path) -> list[PromptRecord]:
    """The self-written prompts on disk, in writing order (round, then process), each id once."""
    records, seen = [], set()
    for path in sorted((Path(folder) / PROMPTS).glob("round-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if row["id"] not in seen:  # two processes may write the same text in one round
                seen.add(row["id"])
                records.append(PromptRecord(**row))
    return records


def write_round(folder: Path, number: int, process_index: int, result: RoundResult) -> None:
    """One process's prompts of one round (JSONL) and the round's counts (JSON), each atomically."""
    stem = Path(folder) / PROMPTS / f"round-{number:05d}-r{process_index}"
    lines = "".join(json.dumps(asdict(record)) + "\n" for record in result.prompts)
    stats = {"candidates": result.candidates, "kept": len(result.prompts), "dropped": dict(result.dropped)}
    write_text(stem.with_suffix(".stats.json"), json.dumps(stats) + "\n")
    write_text(stem.with_suffix(".jsonl"), lines)


def next_round(folder: Path) -> int:
    rounds = [int(p.name.split("-")[1]) for p in (Path(folder) / PROMPTS).glob("round-*.jsonl")]
    return 1 + max(rounds, default=-1)


def self_prompts(
    folder: Path,
    writer: Writer,
    request: SelfPromptRequest,
    seed: int,
    group: ProcessGroup,
    progress: bool = True,
    max_idle_rounds: int = 3,
) -> list[PromptRecord]:
    """``request.count`` prompts written by the target, topic shares even; rounds go on until there are.

    Each round, every process writes its share of what is missing; a round's prompts are saved when
    it ends, so an interrupted build keeps its finished rounds. Fails after ``max_idle_rounds`` rounds
    in a row that kept nothing (the filters reject everything the target writes).
    """
    shares = topic_shares(request.count, request.settings.topics)
    oversample, idle = 1.25, 0
    while True:
        group.barrier()  # every process sees the same rounds on disk
        records = read_self_prompts(folder)
        have = Counter(record.topic for record in records)
        need = {topic: max(0, n - have[topic]) for topic, n in shares.items()}
        if not any(need.values()):
            return [r for topic, n in shares.items() for r in [r for r in records if r.topic == topic][:n]]
        if idle >= max_idle_rounds:
            raise DraftsmithError(
                f"the target wrote no usable prompt in {idle} rounds (dropped: {dropped_summary(folder)}); "
                "relax the prompt filters or raise the prompt token limit"
            )
        mine = {topic: n // group.count + (group.index < n % group.count) for topic, n in need.items()}
        number = next_round(folder)
        callback, close = token_bar(f"writing prompts, round {number}", progress and group.is_main)
        round_plan = RoundPlan(mine, seed, tag=f"{number}-{group.index}", oversample=oversample)
        result = write_prompt_round(
            writer, round_plan, request.settings, request.filters, dedup_of(records), on_progress=callback
        )
        close()
        write_round(folder, number, group.index, result)
        group.barrier()
        idle = idle + 1 if len(read_self_prompts(folder)) == len(records) else 0
        oversample = min(8.0, 1.25 * result.candidates / max(len(result.prompts), 1))


def dedup_of(records: list[PromptRecord]) -> Deduplicator:
    dedup = Deduplicator()
    for record in records:
        dedup.add(record.text)
    return dedup


def dropped_summary(folder: Path) -> dict:
    """Candidates written, prompts kept, and drops by reason, over every round on disk."""
    total = Counter()
    for path in (Path(folder) / PROMPTS).glob("round-*.stats.json"):
        stats = json.loads(path.read_text(encoding="utf-8"))
        total.update({"candidates": stats["candidates"], "kept": stats["kept"], **stats["dropped"]})
    return dict(sorted(total.items()))


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[PromptRecord], max_new_tokens: int, context: int | None
) -> tuple[dict[str, list[int]], int]:
    """Token ids of each prompt awaiting its answer, by id; prompts too long for the context are left out.

    Returns (ids by prompt id, how many were left out).
    """
    encoded, too_long = {}, 0
    for record in prompts:
        if record.id in encoded:
            raise DraftsmithError(f"prompt id {record.id!r} appears twice in {record.source}; ids must be unique")
        ids = encode_chat(tokenizer, record.messages, record.text)
        if context is not None and len(ids) + max_new_tokens > context:
            too_long += 1
            continue
        encoded[record.id] = ids
    return encoded, too_long


def answer_row(tokenizer, record: PromptRecord, sample: int, prompt_ids, answer_ids, eos_ids) -> dict:
    return {
        "prompt_id": record.id,
        "sample": sample,
        "source": record.source,
        "topic": record.topic,
        "messages": [{"role": m["role"], "content": m["content"]} for m in record.messages],
        "prompt_ids": list(prompt_ids),
        "answer_ids": answer_ids,
        "answer_text": tokenizer.decode(answer_ids, skip_special_tokens=True),
        "finished": bool(answer_ids) and answer_ids[-1] in eos_ids,
    }


def answer_prompts(
    folder: Path,
    writer: Writer,
    prompts: list[PromptRecord],
    settings: BuildSettings,
    samples_per_prompt: int,
    shard_rows: int,
    group: ProcessGroup,
    progress: bool = True,
) -> int:
    """Answer every (prompt, sample) not yet in the dataset; this process takes every N-th.

    Answers are written in shards of ``shard_rows`` rows as they complete. Sample ``s`` of a prompt
    is drawn with a seed fixed by the run seed, the prompt id and ``s``, so a row does not depend on
    which process made it or on what shared its batch. Returns the rows this process wrote.
    """
    engine, tokenizer, eos_ids = writer.engine, writer.tokenizer, writer.eos_ids
    sampling = SamplingParams(**settings.sampling)
    encoded, too_long = encode_prompts(tokenizer, prompts, settings.max_new_tokens, engine.context)
    if too_long and group.is_main:
        print(f"left out {too_long} prompt(s) longer than the context allows with max_new_tokens", file=sys.stderr)
    done = done_keys(folder)
    items = [(record, sample) for record in prompts if record.id in encoded for sample in range(samples_per_prompt)]
    mine = [
        (record, sample)
        for i, (record, sample) in enumerate(items)
        if i % group.count == group.index and (record.id, sample) not in done
    ]
    if not mine:
        return 0
    seeds = [derived_seed(settings.seed, record.id, sample) for record, sample in mine]
    callback, close = token_bar("answering", progress and group.is_main)
    buffer, written = [], 0
    for index, answer in engine.stream(
        [encoded[record.id] for record, _ in mine],
        settings.max_new_tokens,
        sampling=sampling,
        stop_ids=eos_ids,
        seeds=None if sampling.greedy else seeds,
        on_progress=callback,
    ):
        record, sample = mine[index]
        buffer.append(answer_row(tokenizer, record, sample, encoded[record.id], answer, eos_ids))
        if len(buffer) >= shard_rows:
            write_shard(folder, group.index, buffer)
            written, buffer = written + len(buffer), []
    if buffer:
        write_shard(folder, group.index, buffer)
        written += len(buffer)
    close()
    return written


def dataset_counts(folder: Path) -> dict:
    """Rows, distinct prompts, tokens, and rows per topic and per source of a dataset folder."""
    rows = load_built(folder)
    table = rows.data
    return {
        "rows": len(rows),
        "prompts": len(set(rows["prompt_id"])),
        "answer_tokens": pc.sum(pc.list_value_length(table.column("answer_ids"))).as_py(),
        "prompt_tokens": pc.sum(pc.list_value_length(table.column("prompt_ids"))).as_py(),
        "finished_rows": sum(rows["finished"]),
        "rows_by_topic": dict(sorted(Counter(rows["topic"]).items())),
        "rows_by_source": dict(sorted(Counter(rows["source"]).items())),
    }


def finish_dataset(folder: Path, manifest: dict, request: dict, seconds: float, group: ProcessGroup) -> dict:
    """After every process is done: the main process records counts, the request and the time taken."""
    group.barrier()
    if group.is_main:
        manifest.update(request=request, counts=dataset_counts(folder), complete=True)
        manifest["seconds"] = manifest.get("seconds", 0.0) + seconds
        if manifest["settings"]["prompt_source"]["kind"] == "self":
            manifest["self_prompts"] = dropped_summary(folder)
        write_text(Path(folder) / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        write_card(folder, manifest)
    group.barrier()
    return manifest


def build_dataset(
    folder: Path,
    writer: Writer,
    settings: BuildSettings,
    prompts: list[PromptRecord] | SelfPromptRequest,
    samples_per_prompt: int = 1,
    shard_rows: int = 256,
    group: ProcessGroup | None = None,
    progress: bool = True,
) -> dict:
    """Build (or continue, or extend) the dataset in ``folder``; return its manifest.

    prompts: the prompts to answer, or a request for prompts the target writes itself (then written
    first, into ``folder/prompts``). ``settings.prompt_source`` must describe them, and
    ``settings.engine`` name ``writer.engine``.
    """
    group, engine = group or ProcessGroup(), writer.engine
    if settings.engine != engine.name:
        raise DraftsmithError(f"settings name engine {settings.engine!r} but {engine.name!r} generates; give the same")
    if samples_per_prompt < 1:
        raise DraftsmithError(f"--samples-per-prompt must be >= 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and settings.sampling["temperature"] == 0:
        raise DraftsmithError(
            "greedy answers are all the same: more than one sample per prompt needs --temperature > 0"
        )
    started = time.perf_counter()
    manifest = open_dataset(folder, settings, group, engine.describe())
    if isinstance(prompts, SelfPromptRequest):
        request = {"num_prompts": prompts.count, "samples_per_prompt": samples_per_prompt}
        prompts = self_prompts(folder, writer, prompts, settings.seed, group, progress)
    else:
        request = {"num_prompts": len(prompts), "samples_per_prompt": samples_per_prompt}
    answer_prompts(
        folder,
        writer,
        prompts,
        settings,
        samples_per_prompt,
        shard_rows=shard_rows,
        group=group,
        progress=progress,
    )
    return finish_dataset(folder, manifest, request, time.perf_counter() - started, group)
