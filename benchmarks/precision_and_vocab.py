"""What bfloat16, row-exact decoding and a frequency-ranked draft head are worth, side by side in one run.

For one trained draft (a checkpoint folder of a run, whose ``draft_vocab.json`` ranks the tokens),
per prompt and repeat, back to back:

- the target-only decoder in float32 and in bfloat16 (row-exact: one-token steps go through two rows),
  and in bfloat16 with plain one-row steps, to price the exactness;
- speculative decoding at gamma in float32, in bfloat16 with the full draft head, and in bfloat16
  with the head cut to the N most frequent tokens.

Ratios are medians over repeats of tokens/s ratios. Greedy outputs are checked against the target-only
decoder of the same dtype. Needs a CPU with native bfloat16 to say anything about this machine's default.
Run: .venv/bin/python benchmarks/precision_and_vocab.py quickstart/run/checkpoint-150 [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import torch
from common import default_target, interleaved, median, prompt_ids, save

from draftsmith.specdec import stream as stream_module
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.draft_vocab import SubsetHeadDraft, load_ranking
from draftsmith.specdec.loading import load_model
from draftsmith.specdec.options import DecodeOptions


def print_result(result: dict, vocab: int, gamma: int, alpha: dict) -> None:
    """The ratios, the acceptance and greedy identity, one line each."""
    print()
    print(f"target-only tokens/s, bfloat16 / float32:                    {result['bf16_vs_fp32_target']:.2f}x")
    print(f"target-only, one-row steps / row-exact two-row steps:        {result['row_exact_cost']:.3f}x")
    print(f"speculative / target-only, float32:                          {result['speedup_fp32']:.2f}x")
    print(f"speculative / target-only, bfloat16:                         {result['speedup_bf16']:.2f}x")
    print(f"speculative / target-only, bfloat16, head cut to {vocab}:   {result['speedup_bf16_cut_head']:.2f}x")
    print(
        "the same, against the (not row-exact) one-row target-only decoder: "
        f"{result['speedup_bf16_cut_head_vs_one_row_target']:.2f}x"
    )
    print(f"alpha at gamma {gamma}: " + ", ".join(f"{k} {v:.3f}" for k, v in alpha.items()))
    print("greedy output identical to the same dtype's target-only decoder: " + str(result["identical"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a trained draft: checkpoint folder inside a run folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=1)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    args = parser.parse_args()
    ckpt = Path(args.checkpoint)
    ranking = load_ranking(ckpt.parent, args.draft_vocab)
    models = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        target, tokenizer, eos = default_target(dtype=dtype)
        draft = load_model(str(ckpt), torch.device("cpu"), dtype)
        models[name] = (target, draft)
    cut = SubsetHeadDraft(models["bf16"][1], ranking, eos)
    prompts = prompt_ids(tokenizer, args.prompts)
    n, options = args.max_new_tokens, DecodeOptions(gamma=args.gamma)

    def plain_steps(target, ids):
        with mock.patch.object(stream_module, "needs_row_padding", lambda model: False):
            return target_generate(target, [ids], n, eos_ids=eos)

    runs = {
        "base_fp32": lambda ids: target_generate(models["fp32"][0], [ids], n, eos_ids=eos),
        "base_bf16": lambda ids: target_generate(models["bf16"][0], [ids], n, eos_ids=eos),
        "base_bf16_one_row": lambda ids: plain_steps(models["bf16"][0], ids),
        "spec_fp32": lambda ids: speculative_generate(*models["fp32"], [ids], n, options=options, eos_ids=eos),
        "spec_bf16": lambda ids: speculative_generate(*models["bf16"], [ids], n, options=options, eos_ids=eos),
        "spec_bf16_cut_head": lambda ids: speculative_generate(
            models["bf16"][0], cut, [ids], n, options=options, eos_ids=eos
        ),
    }
    ratios = {
        k: []
        for k in (
            "bf16_vs_fp32_target",
            "row_exact_cost",
            "speedup_fp32",
            "speedup_bf16",
            "speedup_bf16_cut_head",
            "cut_head_vs_full_head",
            "speedup_bf16_cut_head_vs_one_row_target",
        )
    }
    identical = {"fp32": [], "bf16": [], "bf16_cut_head": []}
    alpha = {}
    for rep, done in enumerate(interleaved(runs, prompts, args.repeats)):
        outs = done.outputs
        for i in range(len(prompts)):
            identical["fp32"].append(outs["spec_fp32", i] == outs["base_fp32", i])
            identical["bf16"].append(outs["spec_bf16", i] == outs["base_bf16", i])
            identical["bf16_cut_head"].append(outs["spec_bf16_cut_head", i] == outs["base_bf16", i])
        tps = done.tokens_per_s
        ratios["bf16_vs_fp32_target"].append(tps["base_bf16"] / tps["base_fp32"])
        ratios["row_exact_cost"].append(tps["base_bf16_one_row"] / tps["base_bf16"])
        ratios["speedup_fp32"].append(tps["spec_fp32"] / tps["base_fp32"])
        ratios["speedup_bf16"].append(tps["spec_bf16"] / tps["base_bf16"])
        ratios["speedup_bf16_cut_head"].append(tps["spec_bf16_cut_head"] / tps["base_bf16"])
        ratios["cut_head_vs_full_head"].append(tps["spec_bf16_cut_head"] / tps["spec_bf16"])
        ratios["speedup_bf16_cut_head_vs_one_row_target"].append(tps["spec_bf16_cut_head"] / tps["base_bf16_one_row"])
        alpha = done.alpha()
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v:.1f} t/s" for k, v in tps.items()))

    result = {k: median(v) for k, v in ratios.items()}
    result["alpha"] = alpha
    result["identical"] = {k: sum(v) / len(v) for k, v in identical.items()}
    result.update(
        checkpoint=str(ckpt),
        gamma=args.gamma,
        draft_vocab=len(ranking),
        max_new_tokens=n,
        prompts=len(prompts),
        repeats=args.repeats,
        torch_threads=torch.get_num_threads(),
    )
    print_result(result, len(ranking), args.gamma, alpha)
    save("precision_and_vocab", result)


if __name__ == "__main__":
    main()
