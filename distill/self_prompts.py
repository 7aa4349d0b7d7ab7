"""Prompts written by the target itself ("Magpie", Xu et al. 2024).

An instruction-tuned model, given only the opening of a user turn in its chat template (for
ChatML: ``<|im_start|>user\\n``), writes a plausible user message: its training has taught it what
users ask. The opening is derived from the tokenizer's own template, by rendering a conversation
whose user message is a sentinel string and cutting at the sentinel; what follows the sentinel
(``<|im_end|>``) tells which token ends the turn.

Topic seeds steer the mix: each topic is a system message placed before the user turn ("You are
asking an AI assistant for help with a math problem."), used only while the prompt is written; the
prompt that is then answered is the user message alone. Prompts come in rounds of candidates, each
topic with an equal share; every candidate passes the quality filters and de-duplication
(``prompt_filters``) or is dropped, and rounds continue until every topic has its share.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

from transformers import PreTrainedTokenizerBase

from draftsmith.distill.engines import Writer
from draftsmith.distill.prompt_filters import Deduplicator, PromptFilter, normalized
from draftsmith.distill.prompt_sources import PromptRecord
from draftsmith.specdec.continuous import Progress
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.sampling import SamplingParams

SENTINEL = "DRAFTSMITH_USER_MESSAGE_SENTINEL"
TOPICS = {
    "coding": "You are a programmer asking an AI assistant to write, fix or explain a program.",
    "math": "You are asking an AI assistant for help with a math problem.",
    "writing": "You are asking an AI assistant to write or edit a text for you: a story, a poem, an email or an essay.",
    "chat": "You are chatting casually with an AI assistant about your day, your interests or your plans.",
    "qa": "You are asking an AI assistant a factual question about science, history, geography or everyday life.",
    "summarization": "You are asking an AI assistant to summarize a passage that you paste into your message.",
    "translation": "You are asking an AI assistant to translate a sentence or a short text into another language.",
    "reasoning": "You are asking an AI assistant to solve a logic puzzle, step by step.",
}
ANY = "any"  # the topic of prompts written without a system message


@dataclass(frozen=True)
class UserTurn:
    """The tokens that open a user turn, and the special token that ends one (if the template has one)."""

    prefix_ids: list[int]
    end_ids: frozenset[int]


def user_turn(tokenizer: PreTrainedTokenizerBase, system: str | None = None) -> UserTurn:
    """The opening of a user turn in ``tokenizer``'s chat template, after an optional system message."""
    if not tokenizer.chat_template:
        raise DraftsmithError("prompts written by the target need a chat template; this tokenizer has none")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # jinja raises its own types for a template that refuses a role
        raise DraftsmithError(f"the chat template cannot render a system message, which topics need: {err}") from err
    if SENTINEL not in rendered:
        raise DraftsmithError("the chat template does not show the user's message; it cannot open a user turn")
    prefix, suffix = rendered.split(SENTINEL, 1)
    end = tokenizer(suffix.strip(), add_special_tokens=False)["input_ids"][:1]
    end_ids = frozenset(i for i in end if i in tokenizer.all_special_ids or i in tokenizer.added_tokens_decoder)
    return UserTurn(tokenizer(prefix, add_special_tokens=False)["input_ids"], end_ids)


@dataclass(frozen=True)
class SelfPromptSettings:
    """How the target writes prompts. topics: names from ``TOPICS``; empty means no steering."""

    topics: tuple[str, ...] = ()
    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 128  # a prompt still unfinished after this many tokens is dropped

    def __post_init__(self) -> None:
        unknown = [t for t in self.topics if t not in TOPICS]
        if unknown:
            raise DraftsmithError(f"unknown topic(s) {', '.join(unknown)}; choose from {', '.join(TOPICS)}")
        if len(set(self.topics)) != len(self.topics):
            raise DraftsmithError(f"topics listed twice: {', '.join(self.topics)}")
        if self.temperature <= 0:
            raise DraftsmithError(f"prompts are sampled: the prompt temperature must be > 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise DraftsmithError(f"the prompt token limit must be >= 1, got {self.max_tokens}")

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)

    def to_dict(self) -> dict:
        return {**asdict(self), "topics": list(self.topics)}


def topic_shares(count: int, topics: tuple[str, ...]) -> dict[str, int]:
    """``count`` prompts split evenly over the topics (the first ones take the remainder)."""
    names = topics or (ANY,)
    return {name: count // len(names) + (i < count % len(names)) for i, name in enumerate(names)}


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit sampling seed fixed by a run seed and the identity of one row (its place, its prompt id)."""
    digest = hashlib.sha256(":".join(str(p) for p in (seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def prompt_id(text: str) -> str:
    """A written prompt's id: a hash of its normalized text (stable across runs and processes)."""
    return "self-" + hashlib.sha256(normalized(text).encode()).hexdigest()[:12]


@dataclass
class RoundResult:
    """What one round of prompt writing kept, and why the rest was dropped."""

    prompts: list[PromptRecord]
    candidates: int
    dropped: Counter  # reason -> count: a filter's name, "duplicate", or "surplus" (the topic's share was full)


@dataclass(frozen=True)
class RoundPlan:
    """What one round writes: ``need[topic]`` prompts kept per topic, from ``ceil(need * oversample)``
    candidates, each sampled with its own seed from ``seed`` and ``tag`` (which must differ between
    rounds and processes)."""

    need: dict[str, int]
    seed: int
    tag: str
    oversample: float = 1.25


def write_prompt_round(
    writer: Writer,
    round_plan: RoundPlan,
    settings: SelfPromptSettings,
    filters: PromptFilter,
    dedup: Deduplicator,
    on_progress: Callable[[Progress], None] | None = None,
) -> RoundResult:
    """One round of ``round_plan``: its candidates written by ``writer``, kept up to each topic's need.

    Candidates are judged in a fixed order (topic, then number), each sampled with its own seed, so
    a round's outcome does not depend on batching. ``dedup`` holds every prompt kept before and
    learns the new ones. The engine (the bundled decoder or vLLM) completes the bare user-turn
    opening as a plain completion prompt and stops at the end of the turn or an EOS id.
    """
    need, tokenizer = round_plan.need, writer.tokenizer
    turns = {topic: user_turn(tokenizer, TOPICS.get(topic)) for topic in need}
    count = {topic: math.ceil(n * round_plan.oversample) if n > 0 else 0 for topic, n in need.items()}
    plan = [(topic, k) for topic, n in count.items() for k in range(n)]
    if not plan:
        return RoundResult([], 0, Counter())
    stops = frozenset(writer.eos_ids).union(*(turn.end_ids for turn in turns.values()))
    written = dict(
        writer.engine.stream(
            [turns[topic].prefix_ids for topic, _ in plan],
            settings.max_tokens,
            sampling=settings.sampling(),
            stop_ids=stops,
            seeds=[derived_seed(round_plan.seed, round_plan.tag, topic, k) for topic, k in plan],
            on_progress=on_progress,
        )
    )
    left, kept, dropped = dict(need), [], Counter()
    for index, (topic, _) in enumerate(plan):
        ids = written[index]
        finished = bool(ids) and ids[-1] in stops
        text = tokenizer.decode(ids[:-1] if finished else ids, skip_special_tokens=True).strip()
        reason = filters.reject(text, finished)
        if reason is None and left[topic] == 0:
            reason = "surplus"
        if reason is None and not dedup.add(text):
            reason = "duplicate"
        if reason is not None:
            dropped[reason] += 1
            continue
        left[topic] -= 1
        kept.append(PromptRecord(prompt_id(text), [{"role": "user", "content": text}], "self", topic))
    return RoundResult(kept, len(plan), dropped)
