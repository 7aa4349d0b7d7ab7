"""Fixtures of the dataset tests: the tiny target and its tokenizer (32 words)."""

import pytest

from tests.helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=32, sharpness=8.0)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(32)
