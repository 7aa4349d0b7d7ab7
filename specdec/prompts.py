"""Prompts: one parser for a prompt row and one chat encoder, used by evaluation and by distillation.

A row (a JSONL line of a prompts file, or a dataset row) holds one of:

- ``{"prompt": "text"}``                                   plain text (chat template applied if the
                                                           tokenizer has one); ``instruction`` and
                                                           ``question`` are read the same way
- ``{"messages": [{"role": "user", "content": ...}, ...]}`` a chat; trailing assistant replies are
                                                           dropped (the model is to write them)
- ``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}``  the multi-turn format of
  public speculative-decoding benchmarks; the first turn is used unless all turns are asked for.

Optional keys: ``id`` / ``question_id`` and ``category``. Keys whose value is null count as absent
(dataset rows carry every column).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from draftsmith.specdec.errors import DraftsmithError

TEXT_KEYS = ("prompt", "instruction", "question")  # the last two: common column names of instruction datasets


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[list[dict]] = field(default_factory=list)  # one message list per user turn
    text: str | None = None  # a plain-text prompt (no chat structure)


def parse_prompt_row(row: object, where: str, default_id: int = 0, all_turns: bool = False) -> Prompt:
    """The prompt of one row; a malformed row raises ``DraftsmithError`` naming ``where`` and the problem."""
    if not isinstance(row, dict):
        raise DraftsmithError(f"{where}: each line must be a JSON object with 'prompt', 'messages' or 'turns'")
    row = {k: v for k, v in row.items() if v is not None}
    pid = str(row.get("id", row.get("question_id", default_id)))
    category = str(row.get("category", "all"))
    text_key = next((k for k in TEXT_KEYS if k in row), None)
    if text_key is not None:
        text = row[text_key]
        if not isinstance(text, str) or not text.strip():
            raise DraftsmithError(f"{where}: {text_key!r} must be a non-empty string")
        return Prompt(pid, category, turns=[[{"role": "user", "content": text}]], text=text)
    if "messages" in row:
        messages = row["messages"]
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)
        ):
            raise DraftsmithError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DraftsmithError(f"{where}: 'messages' holds only assistant replies; nothing to answer")
        return Prompt(pid, category, turns=[messages])
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise DraftsmithError(f"{where}: 'turns' must be a non-empty list of strings")
        used = turns if all_turns else turns[:1]
        return Prompt(pid, category, turns=[[{"role": "user", "content": t}] for t in used])
    raise DraftsmithError(
        f"{where}: the object has none of the keys 'prompt' (or 'instruction', 'question'), 'messages' or 'turns'"
    )


def read_prompts(path: str | Path, all_turns: bool = False) -> list[Prompt]:
    """Parse a prompts JSONL file; any bad line is reported with its number."""
    path = Path(path)
    if path.is_dir():
        raise DraftsmithError(f"prompts {path} is a folder; give a JSONL file (one JSON object per line)")
    if path.exists() and not path.is_file():
        raise DraftsmithError(f"prompts {path} is not a regular file (a device or pipe); give a JSONL file")
    if not path.is_file():
        raise DraftsmithError(f"prompts file not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DraftsmithError(f"{where}: not valid JSON ({err.msg})") from err
        prompts.append(parse_prompt_row(row, where, default_id=len(prompts), all_turns=all_turns))
    if not prompts:
        raise DraftsmithError(f"{path} holds no prompts (one JSON object per line is expected)")
    return prompts


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    text: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a conversation; by default it awaits the assistant's reply (the generation prompt).

    The chat template is applied when the tokenizer has one; otherwise plain text is encoded (``text``,
    or the messages' contents joined by blank lines).
    """
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return list(ids)
    plain = text if text is not None else "\n\n".join(m["content"] for m in messages)
    return tokenizer(plain)["input_ids"]


def check_length(ids: list[int], max_new_tokens: int, context: int | None, prompt_id: str) -> None:
    if context is not None and len(ids) + max_new_tokens > context:
        raise DraftsmithError(
            f"prompt {prompt_id} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the model's "
            f"context of {context} tokens. Shorten the prompt or lower --max-new-tokens"
        )
