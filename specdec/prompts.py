"""Prompt files for evaluation: JSONL rows with ``prompt``, ``messages`` or ``turns``.

- ``{"prompt": "text"}``                                   plain text (chat template applied if the
                                                           tokenizer has one)
- ``{"messages": [{"role": "user", "content": ...}, ...]}`` a chat
- ``{"question_id": 81, "category": "writing", "turns": ["...", "..."]}``  the multi-turn format of
  public speculative-decoding benchmarks; the first turn is used unless all turns are asked for.

Optional keys: ``id`` / ``question_id`` and ``category``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from draftsmith.specdec.errors import DraftsmithError


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[list[dict]] = field(default_factory=list)  # one message list per user turn
    text: str | None = None  # a plain-text prompt (no chat structure)


def read_prompts(path: str | Path, all_turns: bool = False) -> list[Prompt]:
    """Parse a prompts JSONL file; any bad line is reported with its number."""
    path = Path(path)
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
        if not isinstance(row, dict):
            raise DraftsmithError(f"{where}: each line must be a JSON object with 'prompt', 'messages' or 'turns'")
        pid = str(row.get("id", row.get("question_id", len(prompts))))
        category = str(row.get("category", "all"))
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise DraftsmithError(f"{where}: 'prompt' must be a non-empty string")
            prompts.append(
                Prompt(pid, category, turns=[[{"role": "user", "content": row["prompt"]}]], text=row["prompt"])
            )
        elif "messages" in row:
            messages = row["messages"]
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)
            ):
                raise DraftsmithError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]  # the model is to write that reply itself
            if not messages:
                raise DraftsmithError(f"{where}: 'messages' holds only an assistant reply; nothing to answer")
            prompts.append(Prompt(pid, category, turns=[messages]))
        elif "turns" in row:
            turns = row["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise DraftsmithError(f"{where}: 'turns' must be a non-empty list of strings")
            used = turns if all_turns else turns[:1]
            prompts.append(Prompt(pid, category, turns=[[{"role": "user", "content": t}] for t in used]))
        else:
            raise DraftsmithError(f"{where}: the object has none of the keys 'prompt', 'messages' or 'turns'")
    if not prompts:
        raise DraftsmithError(f"{path} holds no prompts (one JSON object per line is expected)")
    return prompts


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str | None = None) -> list[int]:
    """Token ids for a conversation awaiting the assistant's reply.

    The chat template is applied when the tokenizer has one; otherwise plain text is encoded (the
    messages' contents joined by blank lines).
    """
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
    plain = text if text is not None else "\n\n".join(m["content"] for m in messages)
    return tokenizer(plain)["input_ids"]


def check_length(ids: list[int], max_new_tokens: int, context: int | None, prompt_id: str) -> None:
    if context is not None and len(ids) + max_new_tokens > context:
        raise DraftsmithError(
            f"prompt {prompt_id} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the model's "
            f"context of {context} tokens. Shorten the prompt or lower --max-new-tokens"
        )
