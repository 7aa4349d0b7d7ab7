"""Tiny models and statistics shared by the tests."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.distill.losses import row_losses
from draftsmith.specdec.decoder import speculative_generate
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.sampling import accept_sampled


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a test's child process: the checkout's root put before any PYTHONPATH already set
    (a checkout run without installing puts draftsmith there), plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path, **extra}


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
            p.add_(torch.randn(p.shape, generator=gen).to(p.device) * noise * p.std())
    return draft


def first_layers(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """A copy of ``model`` keeping its first ``layers`` decoder layers (embeddings, norm and head copied)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
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


def save_tiny_pair(folder, vocab: int = 32, sharpness: float = 8.0, noise: float = 0.3, max_positions: int = 256):
    """Write a tiny target and a noisy draft, each with a tokenizer, under ``folder``; return both paths."""
    target = tiny_llama(vocab=vocab, sharpness=sharpness, max_positions=max_positions)
    draft = noisy_copy(target, noise=noise)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = folder / name
        model.save_pretrained(path)
        tiny_tokenizer(vocab).save_pretrained(path)
        paths.append(path)
    return paths


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, top-k and top-p in float64, written apart from the decoder's own processing:
    (..., V) logits -> (..., V) probabilities.

    top-k keeps the tokens scoring at least the k-th best; top-p keeps a token when the mass of the
    tokens strictly more likely than it is below ``top_p`` (so the most likely token always stays).
    """
    scores = logits.double() / temperature
    weights = (scores - scores.max(-1, keepdim=True).values).exp()
    if top_k and top_k < scores.shape[-1]:
        kth_best = scores.sort(-1, descending=True).values[..., top_k - 1 : top_k]
        weights = torch.where(scores >= kth_best, weights, 0.0)
    if top_p < 1.0:
        probs = weights / weights.sum(-1, keepdim=True)
        more_likely = probs[..., None, :] > probs[..., :, None]  # (..., V, V): [x, y] = p(y) > p(x)
        mass_above = (probs[..., None, :] * more_likely).sum(-1)
        weights = torch.where(mass_above < top_p, weights, 0.0)
    return weights / weights.sum(-1, keepdim=True)


@torch.no_grad()
def target_conditionals(model, prompt: list[int], samples: torch.Tensor, params) -> torch.Tensor:
    """p(x_t | prompt, x_<t) of ``model`` for every sampled sequence and position: samples (N, T) ->
    (N, T, V) float64 on the CPU, processed by ``reference_probs`` with the temperature, top-k and
    top-p of ``params``."""
    inputs = torch.cat([torch.tensor(prompt).expand(len(samples), -1), samples], 1).to(model.device)
    logits = model(input_ids=inputs[:, :-1]).logits[:, len(prompt) - 1 :].cpu()  # row t predicts samples[:, t]
    return reference_probs(logits, params.temperature, params.top_k, params.top_p)


def fit_scores(samples: torch.Tensor, conditionals: torch.Tensor) -> dict[str, float]:
    """Chi-square z-scores of sampled sequences against the model they should follow, per position.

    samples (N, T) token ids; conditionals (N, T, V): each sequence's own p(x_t | x_<t) from the
    reference model. If the sequences follow the model, the count of token v at position t is
    centred on the sum of p(v | x_<t) over the sequences, so that sum is the expected count
    (a martingale argument: every term has mean zero given its prefix); Pearson's statistic with it
    is at most chi-square distributed. ``pos{t}`` tests x_t alone, ``pair{t}`` the pair
    (x_{t-1}, x_t), whose expected count is the sum of p(x_t | x_<t) over sequences with that x_{t-1}.
    """
    n, positions, vocab = conditionals.shape
    scores = {}
    for t in range(positions):
        counts = torch.bincount(samples[:, t], minlength=vocab)
        scores[f"pos{t}"] = chi_square_z(counts, conditionals[:, t].sum(0) / n)
        if t == 0:
            continue
        before = torch.nn.functional.one_hot(samples[:, t - 1], vocab).double()  # (N, V)
        expected = before.T @ conditionals[:, t]  # (V, V): [u, v] = sum over x_{t-1} = u of p(v | prefix)
        pairs = torch.bincount(samples[:, t - 1] * vocab + samples[:, t], minlength=vocab * vocab)
        scores[f"pair{t}"] = chi_square_z(pairs, expected.flatten() / n)
    return scores


# Sampled fits decode these two prompts interleaved in one ragged batch, so the fit also holds per
# sequence of a batch. Seven tokens: positions 0..6, so at gamma 3 the bonus token after a fully
# accepted first round (position 4) and tokens of the round after it are inside the window.
SAMPLING_PROMPTS = ([0, 4, 9], [0, 7, 7, 2, 5, 3])
FIT_TOKENS = 7


def sample_spec(target, draft, params, gamma: int, seed: int = 0, samples: int = 3000, **options):
    """``samples`` speculative continuations of each of ``SAMPLING_PROMPTS``: (tokens (N, 7) of the
    first prompt, of the second, stats). ``options``: more ``DecodeOptions`` fields."""
    prompts = [SAMPLING_PROMPTS[i % 2] for i in range(2 * samples)]
    generator = torch.Generator(device=target.device).manual_seed(seed)
    out, stats = speculative_generate(
        target,
        draft,
        prompts,
        FIT_TOKENS,
        options=DecodeOptions(gamma=gamma, sampling=params, **options),
        generator=generator,
    )
    tokens = torch.tensor(out)
    return tokens[0::2], tokens[1::2], stats


def sampled_fit(target, params, per_prompt) -> dict[str, float]:
    """``fit_scores`` of the samples of each prompt (``per_prompt``: one (N, T) tensor per prompt of
    ``SAMPLING_PROMPTS``, in order), keyed ``p{i}/...``."""
    scores = {}
    for i, samples in enumerate(per_prompt):
        conditionals = target_conditionals(target, SAMPLING_PROMPTS[i], samples, params)
        scores |= {f"p{i}/{name}": z for name, z in fit_scores(samples, conditionals).items()}
    return scores


def assert_fits(target, params, *per_prompt) -> None:
    """Every position and pair of every prompt fits the target (z < 4)."""
    scores = sampled_fit(target, params, per_prompt)
    assert max(scores.values()) < 4, scores


# Broken acceptance rules (in place of ``sampling.accept_sampled``): a sampled fit must reject their output.


def always_accept(tokens, q, p, counts, generator=None):
    """Every draft accepted, the bonus token drawn from p."""
    return counts.clone(), torch.multinomial(p[torch.arange(len(tokens)), counts], 1, generator=generator)[:, 0]


def correct_from_p(tokens, q, p, counts, generator=None):
    """The acceptance test is right, but a rejection is corrected from p instead of the residual."""
    n_accepted, _ = accept_sampled(tokens, q, p, counts, generator)
    return n_accepted, torch.multinomial(p[torch.arange(len(tokens)), n_accepted], 1, generator=generator)[:, 0]


def named_tiny_llama(**fields) -> LlamaForCausalLM:
    """``tiny_llama`` with a name, as a loaded target has (a saved draft's layout names its target)."""
    model = tiny_llama(**fields)
    model.name_or_path = "tests/tiny-llama"
    return model


def fit_forward_kl(kind, draft, next_batch, steps: int, lr: float = 3e-3):
    """``draft`` trained ``steps`` Adam steps through its kind's own training forward, on forward KL
    against the teacher: ``next_batch()`` gives (``Batch``, the teacher's log-probs at its loss rows
    (M, n)). Returns it in eval mode."""
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        batch, teacher = next_batch()
        predicted = kind.training_forward(draft, draft, batch)
        losses = row_losses("forward_kl", predicted.logits, teacher[predicted.teacher_rows])
        loss = (losses * predicted.weights).sum() / len(batch.rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def check_card_usage(folder, kind, gamma: int) -> str:
    """The published ``folder``'s model card names ``kind`` and its vLLM snippet is the kind's
    ``engine_config`` for the folder with ``gamma`` speculative tokens (parsed as the literal it is);
    a transformers snippet appears only for a kind transformers runs as an assistant. Returns the text."""
    import ast
    from pathlib import Path

    text = (Path(folder) / "README.md").read_text()
    assert f"A `{kind.name}` draft for speculative decoding" in text
    (line,) = [x for x in text.splitlines() if x.startswith("llm = LLM(")]
    config = ast.literal_eval(line.split("speculative_config=", 1)[1].removesuffix(")"))
    assert config == {**kind.engine_config(Path(folder).resolve()), "num_speculative_tokens": gamma}
    assert f"method `{config['method']}`" in text
    assert ("assistant_model=draft" in text) == kind.standalone
    return text
