"""``draftsmith quickstart``: the whole job on the embedded default target, end to end.

Converts SmolLM2-135M-Instruct (once), builds a draft from its first layers, distills it on the
shipped dataset of the target's own answers (smollm2-self; the shipped config smollm2-135m) for a
budget of training minutes (--minutes: the run plans its steps from the step time it measures, so
the job takes about as long on a fast machine as on a slow one; every step reads the target's top-k
log-probs that ship with the dataset, so no training minute runs the target), measures every checkpoint's real
speedup on held-out prompts side by side with the target alone, publishes the best draft, and prints
a before/after table. Re-running it resumes: finished steps are not repeated. Works from any folder.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from draftsmith.checks import check_measure_options, check_run_inputs, run_context, run_vocab_size
from draftsmith.distill.drafts import kind_named
from draftsmith.options import draft_vocab_option, gammas_option, pace_option, prompt_options
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import check_writable
from draftsmith.specdec.locks import folder_lock
from draftsmith.train import budget, checkpoint
from draftsmith.train.config import DistillConfig, config_path, dotted_name, load_config
from draftsmith.train.eval_run import RunEvalSettings, evaluate_run
from draftsmith.train.loop import train
from draftsmith.train.models import RunModels
from draftsmith.train.publish import check_output_folder, publish
from draftsmith.train.speedup import card_figures, does_not_pay

CONFIG = "smollm2-135m"
# The recipe measures on 6 held-out prompts, with the draft's head cut to the 8192 tokens most
# frequent in the training answers (exact; faster drafting on a 49 k vocabulary).
LIMIT, DRAFT_VOCAB = 6, 8192
# Training minutes: with measuring 4 drafts (about 12 minutes on a 2-core AVX2 CPU in float32, the
# slowest we run on) and loading, the whole job stays within about 30 minutes there.
MINUTES = 12.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith quickstart",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[prompt_options(limit=LIMIT), gammas_option(), draft_vocab_option(DRAFT_VOCAB), pace_option()],
    )
    p.add_argument("--output-dir", default="quickstart", help="run goes to DIR/run, the draft to DIR/draft")
    p.add_argument(
        "--config", default=CONFIG, help=f"distillation config: a YAML file or a shipped name (default: {CONFIG})"
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=MINUTES,
        help="training minutes (steps only; loading and measuring come on top): the run measures its step time "
        "over its first steps and trains as many as fit, at most the config's optim.max_steps, with its schedule and "
        f"checkpoints spread over them; the config's optim.max_minutes=... overrides it (default: {MINUTES:g})",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the distillation config")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.output_dir)
    run_dir = out / "run"
    if any(item.startswith("output_dir=") for item in args.overrides):
        raise DraftsmithError(
            "quickstart trains into --output-dir DIR (DIR/run); give --output-dir instead of output_dir="
        )
    check_writable(out, f"--output-dir {out}", folder=True)
    if not (args.minutes > 0 and math.isfinite(args.minutes)):
        raise DraftsmithError(f"--minutes must be a number of minutes > 0, got {args.minutes}")
    given = any(dotted_name(item.split("=", 1)[0]) == "optim.max_minutes" for item in args.overrides)
    budget_minutes = [] if given else [f"optim.max_minutes={args.minutes}"]
    cfg = load_config(
        DistillConfig, config_path(args.config), [*budget_minutes, *args.overrides, f"output_dir={run_dir}"]
    )
    gammas = check_before_training(args, cfg, out)

    with folder_lock(run_dir, "draftsmith quickstart"):  # one command at a time writes the run
        print(f"[1/3] distilling a draft into {run_dir}")
        models = RunModels(cfg)  # the config and the target, loaded once for the three stages
        plan = budget.load_plan(run_dir) if cfg.optim.max_minutes is not None else None
        last_step = plan.max_steps if plan is not None else cfg.optim.max_steps
        if not checkpoint.is_complete(run_dir / f"checkpoint-{last_step}"):
            trained = train(cfg)
            models.tokenizer = trained.tokenizer
            models.targets[(str(trained.target.device), trained.target.dtype)] = trained.target
        print(f"[2/3] measuring the real speedup of every checkpoint on {args.prompts}")
        settings = RunEvalSettings(
            args.prompts,
            gammas=gammas,
            max_new_tokens=args.max_new_tokens,
            limit=args.limit,
            draft_vocab_size=args.draft_vocab,
            pace=args.pace,
        )
        report = evaluate_run(run_dir, settings, models)
        best = report["best"]
        if best is None:
            raise DraftsmithError(f"no draft of {run_dir} could be measured")
        print(f"[3/3] publishing {best} to {out / 'draft'}")
        draft_dir = publish(run_dir / best, out / "draft", overwrite=True, models=models)
        print_summary(run_dir, report, best)
        print(f"\npublished draft: {draft_dir}\nreport: {run_dir / 'speedup_report.md'}, {run_dir / 'speedup.png'}")
    return 0


def check_before_training(args: argparse.Namespace, cfg: DistillConfig, out: Path) -> list[int]:
    """Everything the three stages will need, checked before the first one starts: the run's inputs,
    the measuring options (the gammas are returned), and that ``out/draft`` may be replaced (it is
    new, empty, or a draft published there before, as ``publish --overwrite`` takes it)."""
    check_run_inputs(cfg)
    kind_named(cfg.draft.kind).check_publishable()  # before training what could not be published
    draft_dir, run_dir = out / "draft", Path(cfg.output_dir)
    check_output_folder(draft_dir, {"its run": run_dir}, overwrite=True, name=f"--output-dir {out}: {draft_dir}")
    gammas = check_measure_options(args, run_vocab_size(cfg), default_draft_vocab=DRAFT_VOCAB, context=run_context(cfg))
    return gammas


def print_summary(run_dir: Path, report: dict, best: str) -> None:
    """The before/after table: the untrained draft against the best checkpoint."""
    before, after = report["results"]["initial"]["0.0"], card_figures(report["results"][best]["0.0"])
    heldout = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print()
    print(f"{'':<30}{'before (initial)':>18}{f'after ({best})':>24}")
    print(f"{'held-out sum min(p,q)':<30}{heldout[0]['acceptance_rate']:>18.3f}{heldout[-1]['acceptance_rate']:>24.3f}")
    print(f"{'greedy acceptance rate':<30}{before['acceptance_rate']:>18.3f}{after['acceptance_rate']:>24.3f}")
    print(f"{'  per position (from tau)':<30}{before['alpha_per_position']:>18.3f}{after['alpha_per_position']:>24.3f}")
    print(f"{'best gamma':<30}{before['best_gamma']:>18}{after['best_gamma']:>24}")
    print(f"{'measured speedup':<30}{before['speedup']:>18.2f}{after['speedup']:>24.2f}")
    print(f"{'greedy output identical':<30}{before['greedy_match']:>18.0%}{after['greedy_match']:>24.0%}")
    verdict = does_not_pay(f"the published draft ({best})", after["speedup"])
    if verdict is not None:
        print(f"\nnote: {verdict}")
