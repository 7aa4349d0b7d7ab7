"""The decoder on random-weight models of real shapes, eager vs compiled: c, v, tau, measured and predicted
speedup for a Llama-1B-shaped target with its first 2 layers as draft and with itself as draft, and
an 8B-shaped target where memory (and ``--budget-s``) allow. Models are built from configs, so
nothing is downloaded; ``benchmarks/gpu_check.sh`` runs this on a GPU machine.

Random weights give near-uniform distributions: a truncated draft is then accepted about as often as
chance, while the target drafting for itself is accepted always, so the two bound what a trained
draft does. Greedy decoding, one sequence, the two decoders interleaved prompt by prompt after a
warm-up (in compiled mode the warm-up compiles and captures every graph; its seconds are printed
apart). Figures as ``draftsmith eval`` computes them (``measure.figures.pair_metrics``).

Run: python benchmarks/real_shapes.py [--device cuda] [--dtype bfloat16] [--shapes 1b,8b]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import save
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import resolve_dtype
from draftsmith.specdec.measure.figures import pair_metrics
from draftsmith.specdec.measure.tally import Tally
from draftsmith.specdec.options import DecodeOptions

# The shapes of Llama 3.2 1B and Llama 3.1 8B (their vocabulary, grouped-query attention, RoPE base).
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False),
}
COMMON = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0)


def random_model(shape: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A Llama of ``shape`` with random weights, built directly on ``device``."""
    config = LlamaConfig(**COMMON, **SHAPES[shape], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def fits(shape: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a random ``shape`` model, its caches and activations fit the device's free memory."""
    if device.type != "cuda":
        return shape == "1b"
    config = LlamaConfig(**COMMON, **SHAPES[shape])
    layer = 4 * config.hidden_size**2 * 3 // 4 + 3 * config.hidden_size * config.intermediate_size
    params = config.num_hidden_layers * layer + 2 * config.vocab_size * config.hidden_size
    free, _ = torch.cuda.mem_get_info(device)
    return 2.5 * params * torch.finfo(dtype).bits // 8 < free


def measure(target, draft, prompts, *, gamma: int, max_new_tokens: int, repeats: int, compiled: bool) -> dict:
    """pair_metrics over ``repeats`` passes over ``prompts`` (after a warm-up pass), the warm-up's seconds,
    and the share of outputs identical to the target's own (``greedy_match``)."""
    options = DecodeOptions(gamma=gamma, compile=compiled)
    start = time.perf_counter()
    for prompt in prompts[:1]:
        target_generate(target, [prompt], max_new_tokens, options)
        speculative_generate(target, draft, [prompt], max_new_tokens, options=options)
    warm_up = time.perf_counter() - start
    base, spec, identical = Tally(), Tally(), []
    for _ in range(repeats):
        for prompt in prompts:
            expected, stats = target_generate(target, [prompt], max_new_tokens, options)
            base.add(stats)
            out, stats = speculative_generate(target, draft, [prompt], max_new_tokens, options=options)
            spec.add(stats)
            identical.append(out == expected)
    figures = pair_metrics(base, spec, gamma).to_json()
    return {**figures, "warm_up_s": warm_up, "greedy_match": sum(identical) / len(identical)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both, comma-separated")
    parser.add_argument("--budget-s", type=float, default=None, help="skip shapes that start after this many seconds")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    generator = torch.Generator().manual_seed(0)
    start, results = time.perf_counter(), {}
    header = f"{'shape':<6}{'draft':<8}{'mode':<10}{'c':>7}{'v':>7}{'tau':>7}{'speedup':>9}{'predicted':>10}"
    print(f"{header}{'identical':>10}{'warm-up s':>11}")
    for shape in args.shapes.split(","):
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"{shape}: skipped, the time budget of {args.budget_s:.0f} s is spent")
            continue
        if not fits(shape, device, dtype):
            print(f"{shape}: skipped, it does not fit this device's free memory")
            continue
        target = random_model(shape, device, dtype)
        vocab = target.config.vocab_size
        prompts = [
            torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(args.prompts)
        ]
        for draft_name, draft in (("2-layer", truncate_target(target, 2)), ("self", target)):
            for mode in args.modes.split(","):
                row = measure(
                    target,
                    draft,
                    prompts,
                    gamma=args.gamma,
                    max_new_tokens=args.max_new_tokens,
                    repeats=args.repeats,
                    compiled=mode == "compiled",
                )
                results[f"{shape}/{draft_name}/{mode}"] = row
                print(
                    f"{shape:<6}{draft_name:<8}{mode:<10}{row['cost_ratio_c']:>7.3f}{row['verify_ratio_v']:>7.2f}"
                    f"{row['mean_accepted_tokens']:>7.2f}{row['speedup']:>9.2f}{row['predicted_speedup']:>10.2f}"
                    f"{row['greedy_match']:>10.0%}{row['warm_up_s']:>11.1f}",
                    flush=True,
                )
        del target, draft
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = f"real_shapes_{device.type}"
    save(name, {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "settings": vars(args), **results})


if __name__ == "__main__":
    main()
