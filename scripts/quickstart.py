"""``draftsmith quickstart``: the whole job on the embedded default target, end to end.

Converts SmolLM2-135M-Instruct (once), builds a draft from its first layers, has the target answer
the built-in prompts, distills the draft (configs/smollm2-135m.yaml), measures every checkpoint's
real speedup on held-out prompts, publishes the best draft, and prints a before/after table.
Re-running it resumes: finished steps are not repeated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train
from scripts import eval_run, publish

CONFIG = Path(__file__).parents[1] / "configs" / "smollm2-135m.yaml"
EVAL_PROMPTS = Path(__file__).parents[1] / "distill" / "data" / "eval_prompts.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="draftsmith quickstart", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--output-dir", default="quickstart", help="run goes to DIR/run, the draft to DIR/draft")
    p.add_argument("--config", default=str(CONFIG), help=f"distillation config (default: {CONFIG.name})")
    p.add_argument("--eval-prompts", default=str(EVAL_PROMPTS), help="held-out prompts for the speedup")
    p.add_argument("--eval-limit", type=int, default=6, help="held-out prompts used (default: 6)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt when measuring")
    p.add_argument("--gammas", default="1,2,3,4,6")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="the draft's head scores only the N tokens most frequent in the training answers (0 = full head)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the distillation config")
    args = p.parse_args(argv)
    out = Path(args.output_dir)
    run_dir = out / "run"
    cfg = load_config(DistillConfig, args.config, [*args.overrides, f"output_dir={run_dir}"])

    print(f"[1/3] distilling a draft into {run_dir}")
    if not (run_dir / f"checkpoint-{cfg.max_steps}").is_dir():
        train(cfg)
    print(f"[2/3] measuring the real speedup of every checkpoint on {args.eval_prompts}")
    report = eval_run.run(
        run_dir,
        args.eval_prompts,
        eval_run.parse_list(args.gammas, int, "gammas"),
        [0.0],
        args.max_new_tokens,
        args.eval_limit,
        draft_vocab_size=args.draft_vocab,
    )
    best = report["best"]
    if best is None:
        raise DraftsmithError(f"no draft of {run_dir} could be measured")
    print(f"[3/3] publishing {best} to {out / 'draft'}")
    draft_dir = publish.publish(run_dir / best, out / "draft", overwrite=True)

    before, after = report["results"]["initial"]["0.0"], report["results"][best]["0.0"]
    heldout = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print()
    print(f"{'':<30}{'before (initial)':>18}{f'after ({best})':>24}")
    print(f"{'held-out sum min(p,q)':<30}{heldout[0]['acceptance_rate']:>18.3f}{heldout[-1]['acceptance_rate']:>24.3f}")
    print(f"{'greedy acceptance rate':<30}{before['acceptance_rate']:>18.3f}{after['acceptance_rate']:>24.3f}")
    print(f"{'  per position (from tau)':<30}{before['alpha_per_position']:>18.3f}{after['alpha_per_position']:>24.3f}")
    print(f"{'best gamma':<30}{before['best_gamma']:>18}{after['best_gamma']:>24}")
    print(f"{'measured speedup':<30}{before['speedup']:>18.2f}{after['speedup']:>24.2f}")
    print(f"{'greedy output identical':<30}{before['greedy_match']:>18.0%}{after['greedy_match']:>24.0%}")
    print(f"\npublished draft: {draft_dir}\nreport: {run_dir / 'speedup_report.md'}, {run_dir / 'speedup.png'}")
    return 0
