"""Greedy exactness on the real default target, SmolLM2-135M-Instruct (converted from its GGUF once)."""

import pytest
import torch

from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import DEFAULT_TARGET, eos_token_ids, load_model, load_tokenizer
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import encode_chat
from tests.helpers import first_layers

pytestmark = pytest.mark.slow

QUESTIONS = ["Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def default():
    model = load_model(DEFAULT_TARGET, torch.device("cpu"), torch.float32)
    tokenizer = load_tokenizer(DEFAULT_TARGET)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return model, tokenizer, prompts


def test_default_target_shape(default):
    model, tokenizer, _ = default
    assert model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert tokenizer.eos_token_id in eos_token_ids(model, tokenizer)


def test_truncated_draft_greedy_is_identical(default):
    model, tokenizer, prompts = default
    draft = first_layers(model, 2)
    eos = eos_token_ids(model, tokenizer)
    ref = [target_generate(model, [p], 24, eos_ids=eos)[0][0] for p in prompts]
    for gamma in (2, 5):
        out, stats = speculative_generate(model, draft, prompts, 24, options=DecodeOptions(gamma=gamma), eos_ids=eos)
        assert out == ref
        assert stats.proposed > 0
    one, _ = speculative_generate(model, draft, prompts[:1], 24, options=DecodeOptions(gamma=4), eos_ids=eos)
    assert one[0] == ref[0]


def test_target_as_its_own_draft(default):
    model, tokenizer, prompts = default
    gamma, rounds = 4, 3
    n = 1 + rounds * (gamma + 1)
    ref = target_generate(model, prompts[:1], n)[0]
    out, stats = speculative_generate(model, model, prompts[:1], n, options=DecodeOptions(gamma=gamma))
    assert out == ref
    assert stats.mean_accepted_tokens == gamma + 1
    assert stats.rounds == rounds
