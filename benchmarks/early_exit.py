"""Early-exit drafts with and without KV reuse, and a standalone truncated draft, side by side.

On the default target, greedy, the same prompts: (1) an early-exit draft (--early-exit: a checkpoint of
configs/smollm2-135m-early-exit.yaml, or early_exit:K untrained) decoded with the shared cache, (2) the
same draft with reuse off (the full target verifies), (3) a standalone truncated draft (--truncated:
a checkpoint, or truncate:N). Each measured against the target-only decoder in the same run.
Prints alpha, tau, c, v and speedup for each.

Run: .venv/bin/python benchmarks/early_exit.py --early-exit runs/smollm2-135m-early-exit/checkpoint-100 \
         --truncated quickstart/draft
"""

from __future__ import annotations

import argparse

import torch
from common import PROMPTS, default_target, save

from draftsmith.distill.drafts import load_draft
from draftsmith.specdec.measure.pair import evaluate_pair
from draftsmith.specdec.measure.settings import MeasureSettings
from draftsmith.specdec.options import DecodeOptions
from draftsmith.specdec.prompts import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--early-exit", default="early_exit:4")
    parser.add_argument("--truncated", default="truncate:2")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, tokenizer, eos = default_target()
    prompts = read_prompts(PROMPTS)[: args.prompts]
    early = load_draft(args.early_exit, target, target.device, torch.float32)
    truncated = load_draft(args.truncated, target, target.device, torch.float32)
    rows = {
        "early-exit, KV reuse": (early, True),
        "early-exit, full verification": (early, False),
        "truncated, standalone": (truncated, True),
    }
    result = {}
    for name, (draft, kv_reuse) in rows.items():
        r = evaluate_pair(
            target,
            draft,
            tokenizer,
            MeasureSettings(
                prompts,
                options=DecodeOptions(gamma=args.gamma, draft_options={"kv_reuse": kv_reuse}),
                max_new_tokens=args.max_new_tokens,
                eos_ids=eos,
                repeats=args.repeats,
                progress=False,
            ),
        ).to_json()
        result[name] = {
            k: r[k]
            for k in (
                "acceptance_rate",
                "mean_accepted_tokens",
                "cost_ratio_c",
                "verify_ratio_v",
                "speedup",
                "predicted_speedup",
                "greedy_match",
            )
        }
        print(
            f"{name:<32} alpha {r['acceptance_rate']:.3f}  tau {r['mean_accepted_tokens']:.2f}  "
            f"c {r['cost_ratio_c']:.3f}  v {r['verify_ratio_v']:.3f}  speedup {r['speedup']:.3f}  "
            f"(predicted {r['predicted_speedup']:.3f}, greedy match {r['greedy_match']:.0%})"
        )
    save(
        "early_exit", {"gamma": args.gamma, "early_exit": args.early_exit, "truncated": args.truncated, "rows": result}
    )


if __name__ == "__main__":
    main()
