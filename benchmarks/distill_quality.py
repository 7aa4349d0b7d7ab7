"""Distillation quality on the default target: TVD vs forward KL, same data, same step budget.

For each loss, train a 2-layer truncated draft (configs/smollm2-135m.yaml) for --steps steps, then
measure on the held-out prompts (never trained on), before and after:
- sum_x min(p, q): the expected acceptance rate per token, teacher-forced on the target's answers;
- greedy agreement: how often the draft's argmax equals the target's there;
- alpha of the bundled decoder: greedy speculative decoding (gamma 4) of the held-out prompts.

Run: .venv/bin/python benchmarks/distill_quality.py [--steps 150 --losses tvd,forward_kl]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from common import save

from draftsmith.distill.drafts.lm import truncate_target
from draftsmith.distill.losses import acceptance_probability
from draftsmith.specdec.decoder import speculative_generate
from draftsmith.specdec.loading import eos_token_ids, load_model
from draftsmith.specdec.options import DecodeOptions
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import build_examples, build_models, train

CONFIG = Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml"


@torch.no_grad()
def measure(draft, target, held: list[dict], eos) -> dict:
    mins, agree, count = 0.0, 0, 0
    prompts = []
    for ex in held:
        ids = torch.tensor([ex["input_ids"]])
        mask = torch.tensor(ex["loss_mask"], dtype=torch.bool)
        p, q = target(input_ids=ids).logits[0], draft(input_ids=ids).logits[0]
        mins += float(acceptance_probability(q[None], p[None])[0][mask].sum())
        agree += int((p.argmax(-1) == q.argmax(-1))[mask].sum())
        count += int(mask.sum())
        prompts.append(ex["input_ids"][: int(mask.nonzero()[0]) + 1])
    _, stats = speculative_generate(target, draft, prompts, 64, options=DecodeOptions(gamma=4), eos_ids=eos)
    return {
        "sum_min_pq": mins / count,
        "greedy_agreement": agree / count,
        "decoder_alpha": stats.acceptance_rate,
        "decoder_tau": stats.mean_accepted_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--losses", default="tvd,forward_kl")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="runs/quality")
    args = parser.parse_args()
    results = {}
    for loss in args.losses.split(","):
        cfg = load_config(
            DistillConfig,
            str(CONFIG),
            [
                f"output_dir={args.out}/{loss}",
                "data.dataset=builtin",  # the built-in prompts and the target's answers to them
                f"loss.name={loss}",
                "teacher.cache=false",  # every loss with the live target (TVD, JSD need its whole distribution)
                f"optim.lr={args.lr}",
                f"optim.max_steps={args.steps}",
                f"save.steps={args.steps}",
                "log.steps=25",
                "save.keep_last=1",
            ],
        )
        target, tokenizer, _ = build_models(cfg, torch.device("cpu"))
        _, held = build_examples(cfg, target, tokenizer, Accelerator(cpu=True))
        eos = eos_token_ids(target, tokenizer)
        before = measure(truncate_target(target, cfg.draft.layers), target, held, eos)
        start = time.perf_counter()
        run = train(cfg)
        minutes = (time.perf_counter() - start) / 60
        draft = load_model(str(run / f"checkpoint-{args.steps}"), torch.device("cpu"), torch.float32)
        after = measure(draft, target, held, eos)
        results[loss] = {"before": before, "after": after, "train_minutes": minutes, "steps": args.steps, "lr": args.lr}
        print(f"{loss}: {args.steps} steps in {minutes:.1f} min")
        for key in before:
            print(f"  {key:<18} {before[key]:.3f} -> {after[key]:.3f}")
    save("distill_quality", results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
