"""Distillation data: what sequences the draft learns on (DistillSpec, Zhou et al. 2023).

- ``text``:   a fixed text or chat dataset; chat rows get the chat template and only assistant
              tokens count in the loss.
- ``target``: the target answers a prompt set (batched, KV-cached, sampling configurable); the
              answers are saved once as an on-disk ``datasets`` dataset and reused.

Examples are ``{"input_ids": [...], "loss_mask": [...]}``: ``loss_mask[t]`` is 1 when the logits
at position t predict a token the draft will have to propose (position t+1 is a response token).
The built-in prompt set (``distill/data/prompts.jsonl``, 56 prompts over chat, writing, code, math,
QA, translation and summarization) makes the default run need no download.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftsmith.distill.dataset_card import missing_manifest
from draftsmith.specdec.decoder import target_generate
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import atomic_path
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat, parse_prompt_row
from draftsmith.specdec.sampling import SamplingParams

BUILTIN_PROMPTS = Path(__file__).parent / "data" / "prompts.jsonl"
EVAL_PROMPTS = Path(__file__).parent / "data" / "eval_prompts.jsonl"  # held out: never used for training


def load_rows(source: str, split: str = "train", config: str | None = None) -> datasets.Dataset:
    """Rows from ``builtin``, a local json/jsonl/csv/parquet/text file, a ``save_to_disk`` folder, or a
    hub dataset name (with its ``config`` name and ``split``)."""
    if source == "builtin":
        source = str(BUILTIN_PROMPTS)
    path = Path(source)
    suffix = path.suffix.lower()
    if path.is_dir():
        return saved_rows(path, split)
    if path.is_file():
        kind = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}.get(suffix)
        if kind is None:
            raise DraftsmithError(
                f"{source}: unsupported data file type {suffix!r}; use .jsonl, .json, .csv, .parquet or .txt"
            )
        if kind == "json":
            check_json_file(path)
        try:
            return datasets.load_dataset(kind, data_files=str(path), split="train")
        except Exception as err:  # datasets raises many types for a malformed file
            raise DraftsmithError(f"{source}: could not be read as {kind}: {err}") from err
    if path.suffix or source.startswith((".", "/", "~")):
        raise DraftsmithError(f"data file not found: {source}")
    try:
        return datasets.load_dataset(source, config, split=split)
    except Exception as err:
        raise DraftsmithError(f"could not load dataset {source!r} (config {config}, split {split!r}): {err}") from err


# Fields a training row may hold: chat or text data (text mode), or a prompt in one of the usual spellings.
ROW_FIELDS = ("text", "messages", "prompt", "completion", "conversations", "question", "instruction", "turns")


def map_columns(rows: datasets.Dataset, column_map: dict, source: str) -> datasets.Dataset:
    """``rows`` with the columns named in ``data.column_map`` (field -> column) renamed to their fields;
    a field or column that does not exist is an error naming what there is."""
    if not column_map:
        return rows
    unknown = [field for field in column_map if field not in (*ROW_FIELDS, "category")]
    if unknown:
        fields = ", ".join(ROW_FIELDS)
        raise DraftsmithError(f"data.column_map: unknown field(s) {', '.join(unknown)}; the fields are {fields}")
    missing = [str(column) for column in column_map.values() if column not in rows.column_names]
    if missing:
        raise DraftsmithError(
            f"{source}: data.column_map names column(s) {', '.join(missing)} that the data does not have; "
            f"its columns are {', '.join(rows.column_names)}"
        )
    renamed = {column: field for field, column in column_map.items() if column != field}
    clashes = [field for field in renamed.values() if field in rows.column_names and field not in renamed]
    rows = rows.remove_columns(clashes)  # the mapped column replaces a column already named like the field
    return rows.rename_columns(renamed)


def saved_rows(folder: Path, split: str) -> datasets.Dataset:
    """The rows of a folder written by datasets' ``save_to_disk`` (a DatasetDict: its ``split``)."""
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as err:
        raise DraftsmithError(
            missing_manifest(folder) or f"{folder} is a folder but not one written by datasets' save_to_disk"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DraftsmithError(f"{folder} has no split {split!r}; it has {', '.join(loaded)} (set data.split)")
        loaded = loaded[split]
    return loaded


def check_json_file(path: Path) -> None:
    """Refuse a .json file that is not JSON, or a JSON-lines file with a line that is not, naming the line."""
    text = path.read_text()
    lines = text.splitlines()
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return
        except json.JSONDecodeError as err:
            first = next((line for line in lines if line.strip()), "")
            if not is_json(first):  # one JSON document, not JSON lines
                raise DraftsmithError(f"{path}, line {err.lineno}: not valid JSON ({err.msg}); fix it there") from err
    for number, line in enumerate(lines, start=1):
        if line.strip() and not is_json(line):
            raise DraftsmithError(f"{path}, line {number}: not valid JSON; fix that line (one JSON object per line)")


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def check_text_row(row: dict, where: str) -> None:
    """``text`` mode takes a row with a ``text`` string or a ``messages`` list."""
    pair = isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str)
    if not row.get("messages") and not isinstance(row.get("text"), str) and not pair:
        keys = ", ".join(k for k, v in row.items() if v is not None)
        raise DraftsmithError(
            f"{where}: text data rows need a 'text' string, a 'messages' list or 'prompt' and 'completion' "
            f"strings (the row has {keys})"
        )


def usable_rows(rows: datasets.Dataset, data: str, source: str, skip_bad_rows: bool) -> datasets.Dataset:
    """``rows`` checked one by one before anything is built: the first bad one is an error naming its row
    number, or with ``data.skip_bad_rows`` every bad one is left out and their count printed."""
    bad = []
    for index, row in enumerate(rows):
        where = f"{source}, row {index} (counting from 0)"
        try:
            if data == "text":
                check_text_row(row, where)
            else:
                parse_prompt_row(row, where, default_id=index)
        except DraftsmithError as err:
            if not skip_bad_rows:
                raise DraftsmithError(
                    f"{err}; fix the row, or pass data.skip_bad_rows=true to leave bad rows out"
                ) from err
            bad.append(index)
    if not bad:
        return rows
    print(f"{source}: skipped {len(bad)} bad row(s) of {len(rows)} (data.skip_bad_rows)", file=sys.stderr)
    skipped = set(bad)
    return rows.select([i for i in range(len(rows)) if i not in skipped])


def encode_prompt_rows(rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, source: str) -> list[list[int]]:
    """Chat-encoded prompts of dataset rows (``prompt``, ``messages`` or ``turns``: ``parse_prompt_row``)."""
    prompts = []
    for index, row in enumerate(rows):
        prompt = parse_prompt_row(row, f"{source}, row {index}", default_id=index)
        prompts.append(encode_chat(tokenizer, prompt.turns[0], prompt.text))
    return prompts


def chat_example(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int) -> dict | None:
    """Token ids of a chat with a mask on the positions that predict assistant tokens."""
    ids = encode_chat(tokenizer, messages, add_generation_prompt=False)
    target = [0] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(encode_chat(tokenizer, messages[:k]))
        end = len(encode_chat(tokenizer, messages[: k + 1], add_generation_prompt=False))
        for t in range(start, min(end, len(ids))):
            target[t] = 1
    return _example(ids, target, max_length)


def _example(ids: list[int], is_target: list[int], max_length: int) -> dict | None:
    """Cut to ``max_length`` and shift the mask: position t counts when token t+1 is a target token."""
    ids, is_target = ids[:max_length], is_target[:max_length]
    loss_mask = is_target[1:] + [0]
    if sum(loss_mask) == 0:
        return None
    return {"input_ids": ids, "loss_mask": loss_mask}


def text_examples(rows: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> list[dict]:
    """``text`` mode: plain text rows count every token, chat and prompt-completion rows only the assistant's."""
    examples = []
    for row in rows:
        if row.get("messages"):
            example = chat_example(tokenizer, row["messages"], max_length)
        elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
            # prompt-completion rows: the completion is the assistant's turn, only its tokens count
            turns = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
            example = chat_example(tokenizer, turns, max_length)
        elif isinstance(row.get("text"), str):
            ids = tokenizer(row["text"])["input_ids"]
            example = _example(ids, [1] * len(ids), max_length)
        else:
            raise DraftsmithError("text data rows need a 'text' string or a 'messages' list")
        if example is not None:
            examples.append(example)
    return examples


def target_examples(prompts: list[list[int]], responses: list[list[int]], max_length: int) -> list[dict]:
    examples = []
    for prompt, response in zip(prompts, responses, strict=True):
        example = _example(prompt + response, [0] * len(prompt) + [1] * len(response), max_length)
        if example is not None:
            examples.append(example)
    return examples


@dataclass(frozen=True)
class Answering:
    """How a model's answers to prompts are generated: at most ``max_new_tokens`` each, drawn with
    ``sampling`` (one generator seeded ``seed``), stopped at ``eos_ids``, ``batch_size`` prompts at a time."""

    max_new_tokens: int
    sampling: SamplingParams
    eos_ids: frozenset[int]
    batch_size: int
    seed: int


def generate_responses(
    model: PreTrainedModel,
    prompts: list[list[int]],
    answering: Answering,
    desc: str = "generating",
    progress: bool = True,
) -> list[list[int]]:
    """Answers of ``model`` to ``prompts`` (token ids), batched and KV-cached."""
    generator = torch.Generator(device=model.device).manual_seed(answering.seed)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch well
    answers: list[list[int]] = [[] for _ in prompts]
    batch_size = answering.batch_size
    for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=not progress, unit="batch"):
        chunk = order[start : start + batch_size]
        batch = [prompts[i] for i in chunk]
        options = DecodeOptions(sampling=answering.sampling)
        outs, _ = target_generate(model, batch, answering.max_new_tokens, options, answering.eos_ids, generator)
        for i, out in zip(chunk, outs, strict=True):
            answers[i] = out
    return answers


def cached_target_responses(
    cache_root: Path,
    target_name: str,
    target: PreTrainedModel,
    prompts: list[list[int]],
    answering: Answering,
    progress: bool = True,
) -> list[list[int]]:
    """The target's responses, generated once per (target and its dtype, prompts, settings), saved with ``datasets``."""
    settings = [answering.max_new_tokens, answering.sampling.__dict__, sorted(answering.eos_ids), answering.seed]
    key_src = json.dumps([target_name, str(target.dtype), *settings, prompts])
    folder = cache_root / f"target-responses-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
    if (folder / "dataset_info.json").is_file():
        return datasets.load_from_disk(str(folder))["response_ids"]
    responses = generate_responses(target, prompts, answering, desc="target answers", progress=progress)
    with atomic_path(folder) as tmp:
        datasets.Dataset.from_dict({"prompt_ids": prompts, "response_ids": responses}).save_to_disk(str(tmp))
    return responses


def length_buckets(order: list[int], lengths: list[int], batch_size: int, window: int) -> list[list[int]]:
    """Batches of examples of similar lengths: ``order`` cut into windows of ``window`` batches, each
    window sorted by length (stably) and cut into batches of ``batch_size``; only the last may be short.

    A batch pads to its longest sequence, so sorting within windows of a shuffled order leaves little
    padding while every epoch's shuffle still mixes different examples into each batch."""
    span = batch_size * window
    batches = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start : start + span], key=lengths.__getitem__)
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return batches


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples: input_ids (B, T), attention_mask (B, T), loss_mask (B, T) bool."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(examples), width, dtype=torch.long)
    loss = torch.zeros(len(examples), width, dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        attn[row, :n] = 1
        loss[row, :n] = torch.tensor(e["loss_mask"], dtype=torch.bool)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
    if "index" in examples[0]:  # position in the training set, for the teacher cache
        batch["index"] = torch.tensor([e["index"] for e in examples])
    return batch
