"""A tiny random target with a character-level tokenizer, built from a config: self-contained runs
(``configs/tiny.yaml``) and tests that need no model files."""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, plus chat markers."""
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_target(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A random Llama over ``char_tokenizer``; ``overrides`` are LlamaConfig fields."""
    tokenizer = char_tokenizer()
    fields = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    } | overrides
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    with torch.no_grad():  # peaked distributions, as a trained LM has
        model.model.embed_tokens.weight.mul_(4.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
