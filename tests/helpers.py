"""Tiny models and statistics shared by the tests."""

from __future__ import annotations

import copy
import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(
    vocab: int = 32, layers: int = 2, hidden: int = 32, seed: int = 0, sharpness: float = 1.0, max_positions: int = 256
) -> LlamaForCausalLM:
    """A random Llama in fp32; ``sharpness`` scales the LM head so its distributions are peaked, like a real LM's."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that agrees with ``model`` partly: the same weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return draft


def chi_square_z(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square of ``counts`` against ``probs``, as a z-score (Wilson-Hilferty).

    Cells with an expected count below 5 are pooled. z below ~4 is a fit at any sane
    significance level; a broken sampler gives z in the tens or hundreds. Counts in cells of
    probability 0 give z = inf.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    if bool((counts[probs <= 0] > 0).any()):
        return math.inf
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    # Wilson-Hilferty: (X/df)^(1/3) is close to normal with mean 1 - 2/(9df) and variance 2/(9df).
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def tiny_tokenizer(words: int = 32, chat: bool = True):
    """A word-level fast tokenizer over ``<s> </s> <unk> w3 .. w{words-1}`` (ids 0, 1, 2, ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    if chat:
        tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
    return tok


def save_tiny_pair(folder, vocab: int = 32, sharpness: float = 8.0, noise: float = 0.3):
    """Write a tiny target and a noisy draft, each with a tokenizer, under ``folder``; return both paths."""
    target = tiny_llama(vocab=vocab, sharpness=sharpness)
    draft = noisy_copy(target, noise=noise)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = folder / name
        model.save_pretrained(path)
        tiny_tokenizer(vocab).save_pretrained(path)
        paths.append(path)
    return paths
