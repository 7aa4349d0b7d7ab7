"""A tiny random target with a character-level tokenizer, built from a config: self-contained runs
(``configs/tiny.yaml``) and tests that need no model files, on a target whose distributions vary."""

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

CONTEXT = 512  # tokens the tiny target attends over


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


def tiny_target(seed: int = 0, sharpness: float = 8.0, **overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A random Llama over ``char_tokenizer`` with an untied LM head scaled by ``sharpness``.

    ``overrides`` are LlamaConfig fields. With default initialization the residual stream carries
    the current token's embedding and a mix of the context's, and the scaled head turns that into
    next-token distributions that differ from position to position and from prompt to prompt (a
    tied head would instead echo the last token, the same reply after every prompt). So a draft made
    of fewer layers starts well short of the target and measurably closes the gap with training:
    on ``configs/tiny.yaml`` the held-out acceptance rate rises from about 0.63 to about 0.78.
    """
    tokenizer = char_tokenizer()
    fields = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    } | overrides
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields))
    with torch.no_grad():  # logits of std ~1.3 at the default sizes: peaked but not one-hot
        model.get_output_embeddings().weight.mul_(sharpness)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
