"""Prompts for dataset building, from any ``datasets`` source or the built-in set.

A source is one of:

- ``builtin``: the packaged training prompts (``distill/data/prompts.jsonl``). The evaluation prompts
  next to it are held out and refused as a source;
- a local ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file, or a folder written by
  ``save_to_disk``;
- a hub dataset id, with an optional config name and a split.

A row is read in the usual formats, in this order of preference:

- ``prompt`` / ``instruction`` / ``question``: a user message; an ``instruction`` with an ``input``
  (Alpaca) becomes the two joined by a blank line;
- ``messages`` or ``conversations``: a chat, ``{role, content}`` or ShareGPT ``{from, value}`` turns;
  trailing assistant turns are dropped (the target writes that reply);
- ``turns``: the first of a list of user turns;
- ``text``: plain text, used as a user message.

Rows are brought to the forms of ``specdec.prompts.parse_prompt_row`` (``conversations`` renamed,
``instruction`` + ``input`` and ``text`` made a ``prompt``), which parses them: one parser for
evaluation prompts and training prompts.

``data.column_map`` names the column that holds a field when it has another name, e.g.
``{"prompt": "query"}``; then only the mapped columns are read (and ``category``). A row with none
of the fields is an error naming its row number, unless bad rows are skipped (then their count is
printed).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from draftsmith.distill.data import BUILTIN_PROMPTS, EVAL_PROMPTS, check_json_file
from draftsmith.distill.dataset_card import missing_manifest
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.prompts import parse_prompt_row, read_prompts

PROMPT_FIELDS = ("messages", "conversations", "prompt", "question", "instruction", "turns", "text")  # one needed
FIELDS = (*PROMPT_FIELDS, "input", "category")
FILE_KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class PromptRecord:
    """One prompt to answer: the conversation awaiting the assistant's reply."""

    id: str  # stable within its source: the row number, or a hash of the text for self-written prompts
    messages: list[dict] = field(default_factory=list)  # [{"role", "content"}, ...], last one from the user
    source: str = ""
    topic: str = ""  # the row's category, or the topic a self-written prompt was steered to

    @property
    def text(self) -> str:
        """The last user message (what a plain-text tokenizer without a chat template encodes)."""
        return self.messages[-1]["content"]


def parse_column_map(text: str | None) -> dict[str, str]:
    """``"prompt=question,input=context"`` -> ``{"prompt": "question", "input": "context"}``."""
    if not text:
        return {}
    mapping = {}
    for item in text.split(","):
        key, sep, column = item.partition("=")
        key, column = key.strip(), column.strip()
        if not sep or not key or not column:
            raise DraftsmithError(f"--column-map takes FIELD=COLUMN pairs separated by commas, got {item!r}")
        if key not in FIELDS:
            raise DraftsmithError(f"--column-map: unknown field {key!r}; the fields are {', '.join(FIELDS)}")
        mapping[key] = column
    return mapping


def sharegpt_messages(turns: object) -> object:
    """ShareGPT ``{from, value}`` turns as ``{role, content}`` messages; other turns are left as they are."""
    if not isinstance(turns, list):
        return turns
    return [
        {"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]}
        if isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and "value" in t
        else t
        for t in turns
    ]


def canonical_row(row: dict) -> dict:
    """A row in the forms the project's one prompt parser (``specdec.prompts.parse_prompt_row``) reads:
    ``conversations`` becomes ``messages``, ``instruction`` + ``input`` and ``text`` become ``prompt``."""
    row = {k: v for k, v in row.items() if v is not None}  # dataset rows carry every column
    if "conversations" in row and "messages" not in row:
        row["messages"] = sharegpt_messages(row.pop("conversations"))
    extra = row.pop("input", None)
    if isinstance(row.get("instruction"), str) and isinstance(extra, str) and extra.strip():
        row["prompt"] = f"{row.pop('instruction')}\n\n{extra}"
    if "text" in row and not any(key in row for key in PROMPT_FIELDS if key != "text"):
        row["prompt"] = row.pop("text")
    return row


def row_messages(row: dict, where: str) -> list[dict] | None:
    """The conversation of a row in one of the usual formats; None when it has none of the fields."""
    row = canonical_row(row)
    if not any(key in row for key in PROMPT_FIELDS):
        return None
    return parse_prompt_row(row, where).turns[0]


def rows_to_prompts(rows: datasets.Dataset, source: str, column_map: dict[str, str], skip_bad_rows: bool):
    """PromptRecords of a dataset's rows, ids = row numbers (counted from 0)."""
    missing = [column for column in column_map.values() if column not in rows.column_names]
    if missing:
        raise DraftsmithError(
            f"{source}: --column-map names column(s) {', '.join(missing)} that the data does not have; "
            f"its columns are {', '.join(rows.column_names)}"
        )
    renamed = {column: key for key, column in column_map.items()}
    prompts, skipped = [], 0
    for index, raw in enumerate(rows):
        row = {renamed[k]: v for k, v in raw.items() if k in renamed} if renamed else dict(raw)
        row.setdefault("category", raw.get("category"))
        where = f"{source}, row {index} (counting from 0)"
        try:
            messages = row_messages(row, where)
            if messages is None:
                raise DraftsmithError(
                    f"{where}: none of the fields {', '.join(PROMPT_FIELDS)} (columns: {', '.join(raw)}); "
                    "name the prompt column with --column-map prompt=COLUMN, or pass --skip-bad-rows"
                )
        except DraftsmithError:
            if not skip_bad_rows:
                raise
            skipped += 1
            continue
        prompts.append(PromptRecord(str(index), messages, source, str(row.get("category") or "")))
    if skipped:
        print(f"{source}: skipped {skipped} bad row(s) of {len(rows)}", file=sys.stderr)
    return prompts


def builtin_prompts() -> list[PromptRecord]:
    """The packaged training prompts (never the held-out evaluation prompts)."""
    return [PromptRecord(p.id, p.turns[0], "builtin", p.category) for p in read_prompts(BUILTIN_PROMPTS)]


def load_rows(spec: str, config: str | None = None, split: str = "train") -> datasets.Dataset:
    """The rows of a local file, a ``save_to_disk`` folder, or a hub dataset (``config``, ``split``)."""
    path = Path(spec).expanduser()
    if path.exists() and path.resolve() == EVAL_PROMPTS.resolve():
        raise DraftsmithError(f"{spec} holds the held-out evaluation prompts; training data must not use them")
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError as err:
            raise DraftsmithError(
                missing_manifest(path)
                or f"{spec} is a folder but neither a draftsmith data folder (no manifest.json) nor one written by "
                "datasets' save_to_disk; give such a folder, or a .jsonl, .json, .csv or .parquet file"
            ) from err
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DraftsmithError(f"{spec} has no split {split!r}; it has {', '.join(loaded)} (use --split)")
            loaded = loaded[split]
        return loaded
    if path.is_file():
        kind = FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise DraftsmithError(f"{spec}: unsupported file type {path.suffix!r}; use .jsonl, .json, .csv or .parquet")
        if path.stat().st_size == 0:
            raise DraftsmithError(f"{spec} is empty; give a file with one prompt per row")
        if kind == "json":
            check_json_file(path)  # a bad line named, not the datasets library's generic error
        try:
            return datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as err:  # datasets raises many types for a malformed file
            raise DraftsmithError(f"{spec} could not be read as {kind}: {err}") from err
    if path.exists():
        raise DraftsmithError(
            f"{spec} is not a regular file (a device or pipe); give a .jsonl, .json, .csv or .parquet file"
        )
    if path.suffix.lower() in FILE_KINDS or spec.startswith((".", "/", "~")):
        raise DraftsmithError(f"prompt file not found: {spec}")
    try:
        return datasets.load_dataset(spec, config, split=split)
    except Exception as err:  # offline, unknown id, unknown config or split
        raise DraftsmithError(f"could not load the dataset {spec!r} (config {config}, split {split!r}): {err}") from err


def load_prompts(
    spec: str,
    config: str | None = None,
    split: str = "train",
    column_map: dict[str, str] | None = None,
    max_samples: int | None = None,
    skip_bad_rows: bool = False,
) -> list[PromptRecord]:
    """Prompts from ``builtin`` or a dataset source, the first ``max_samples`` rows at most."""
    if max_samples is not None and max_samples < 1:
        raise DraftsmithError(f"--max-samples must be >= 1, got {max_samples}")
    if spec == "builtin":
        return builtin_prompts()[:max_samples]
    rows = load_rows(spec, config, split)
    if max_samples is not None:
        rows = rows.select(range(min(max_samples, len(rows))))
    prompts = rows_to_prompts(rows, spec, column_map or {}, skip_bad_rows)
    if not prompts:
        raise DraftsmithError(f"{spec} holds no usable prompts")
    return prompts


def source_settings(spec: str, config: str | None, split: str, column_map: dict[str, str]) -> dict:
    """What identifies a dataset source in a manifest (a local path is made absolute)."""
    if spec == "builtin":
        return {"kind": "builtin"}
    path = Path(spec).expanduser()
    if path.exists():
        return {"kind": "local", "path": str(path.resolve()), "split": split, "column_map": column_map}
    return {"kind": "hub", "name": spec, "config": config, "split": split, "column_map": column_map}
