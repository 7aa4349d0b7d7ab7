"""Batched decoding on the default target: aggregate tokens/s of the speculative decoder and of the
batched target-only decoder at several batch sizes, and the speedup at each, side by side in one run.

The draft is the target's first 2 layers, or a trained checkpoint with --draft. Greedy.
Run: .venv/bin/python benchmarks/batch_sizes.py [--sizes 1,4,8 --repeats 2]
"""

from __future__ import annotations

import argparse

import torch
from common import default_target, median, prompt_ids, save

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.specdec.decoder import speculative_generate, target_generate
from draftsmith.specdec.loading import load_model
from draftsmith.specdec.options import DecodeOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft", default=None, help="draft model folder (default: the target's first 2 layers)")
    args = parser.parse_args()
    target, tokenizer, eos = default_target()
    draft = truncate_target(target, 2) if args.draft is None else load_model(args.draft, target.device, torch.float32)
    sizes = [int(s) for s in args.sizes.split(",")]
    prompts = prompt_ids(tokenizer)
    pool = (prompts * ((max(sizes) // len(prompts)) + 1))[: max(sizes)]
    n, options = args.max_new_tokens, DecodeOptions(gamma=args.gamma)
    target_generate(target, pool[:2], 8, eos_ids=eos)
    speculative_generate(target, draft, pool[:2], 8, options=options, eos_ids=eos)
    result = {}
    for size in sizes:
        batch = pool[:size]
        ratios, base_tps, spec_tps, alphas, identical = [], [], [], [], True
        for _ in range(args.repeats):
            base, b = target_generate(target, batch, n, eos_ids=eos)
            spec, s = speculative_generate(target, draft, batch, n, options=options, eos_ids=eos)
            identical &= base == spec
            base_tps.append(b.tokens_per_s)
            spec_tps.append(s.tokens_per_s)
            ratios.append(s.tokens_per_s / b.tokens_per_s)
            alphas.append(s.acceptance_rate)
        result[size] = {
            "target_tokens_per_s": median(base_tps),
            "spec_tokens_per_s": median(spec_tps),
            "speedup": median(ratios),
            "acceptance_rate": median(alphas),
            "identical": identical,
        }
        r = result[size]
        print(
            f"batch {size:>2}: target {r['target_tokens_per_s']:7.1f} t/s  spec {r['spec_tokens_per_s']:7.1f} t/s  "
            f"speedup {r['speedup']:.2f}  alpha {r['acceptance_rate']:.3f}  identical {identical}"
        )
    save(
        "batch_sizes", {"gamma": args.gamma, "max_new_tokens": n, "draft": args.draft or "truncate:2", "sizes": result}
    )


if __name__ == "__main__":
    main()
