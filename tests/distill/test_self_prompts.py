"""Prompts written by the target itself (Magpie): the user-turn opening, topic shares, filters, dedup."""

import pytest

from draftsmith.distill.engines import BundledEngine, Writer
from draftsmith.distill.prompt_filters import Deduplicator, PromptFilter
from draftsmith.distill.self_prompts import (
    RoundPlan,
    SelfPromptSettings,
    prompt_id,
    topic_shares,
    user_turn,
    write_prompt_round,
)
from draftsmith.specdec.errors import DraftsmithError
from tests.helpers import tiny_llama, tiny_tokenizer

CHATML = "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread beats OpenMP's barriers


@pytest.fixture(scope="module")
def chatml():
    """The tiny word-level tokenizer with ChatML-like special tokens: ids 32 (<|im_start|>), 33 (<|im_end|>)."""
    tok = tiny_tokenizer(32)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def test_user_turn_is_the_template_up_to_the_user_message_and_its_end_token(chatml):
    turn = user_turn(chatml)
    assert turn.prefix_ids == [32, 2]  # <|im_start|>, then "user" (not in the tiny vocabulary: <unk>)
    assert turn.end_ids == {33}
    with_system = user_turn(chatml, "w5 w6")
    assert with_system.prefix_ids == [32, 2, 5, 6, 33, 32, 2]
    plain = user_turn(tiny_tokenizer(32))  # "<s> {{content}} ": the turn ends with no special token
    assert plain.prefix_ids == [0] and plain.end_ids == set()


def test_user_turn_needs_a_chat_template():
    with pytest.raises(DraftsmithError, match="need a chat template"):
        user_turn(tiny_tokenizer(32, chat=False))


def test_topic_shares_split_evenly():
    assert topic_shares(10, ("coding", "math", "chat")) == {"coding": 4, "math": 3, "chat": 3}
    assert topic_shares(5, ()) == {"any": 5}


def test_settings_refuse_unknown_topics_and_greedy_writing():
    with pytest.raises(DraftsmithError, match="unknown topic"):
        SelfPromptSettings(topics=("cooking",))
    with pytest.raises(DraftsmithError, match="must be > 0"):
        SelfPromptSettings(temperature=0.0)


def run_round(model, tokenizer, need, seed=0, tag="0", dedup=None):
    settings = SelfPromptSettings(topics=tuple(need), max_tokens=64)
    filters = PromptFilter(require_request=False)  # the tiny vocabulary has no English requests
    dedup = dedup or Deduplicator()
    eos = frozenset({1})
    writer = Writer(BundledEngine(model, batch_size=8), tokenizer, eos)
    return write_prompt_round(writer, RoundPlan(need, seed, tag, oversample=3), settings, filters, dedup)


def test_a_round_keeps_each_topics_share_of_finished_distinct_prompts():
    model, tokenizer = tiny_llama(vocab=32, sharpness=2.0), tiny_tokenizer(32)
    result = run_round(model, tokenizer, {"coding": 3, "math": 2})
    assert [p.topic for p in result.prompts] == ["coding"] * 3 + ["math"] * 2
    assert result.candidates == 9 + 6  # 3 candidates per prompt wanted
    assert result.dropped["surplus"] > 0  # more than enough were written: the shares are full
    assert len(result.prompts) + sum(result.dropped.values()) == result.candidates
    texts = [p.text for p in result.prompts]
    assert len(set(texts)) == 5
    for prompt in result.prompts:
        assert prompt.id == prompt_id(prompt.text) and prompt.source == "self"
        assert prompt.messages == [{"role": "user", "content": prompt.text}]
        assert len(prompt.text.split()) >= 3 and all(w.startswith("w") for w in prompt.text.split())


def test_rounds_are_reproducible_and_later_rounds_avoid_earlier_prompts():
    model, tokenizer = tiny_llama(vocab=32, sharpness=2.0), tiny_tokenizer(32)
    first = run_round(model, tokenizer, {"chat": 3})
    again = run_round(model, tokenizer, {"chat": 3})
    assert [p.text for p in first.prompts] == [p.text for p in again.prompts]
    dedup = Deduplicator()
    for p in first.prompts:
        dedup.add(p.text)
    second = run_round(model, tokenizer, {"chat": 3}, tag="1", dedup=dedup)
    assert not {p.text for p in first.prompts} & {p.text for p in second.prompts}
