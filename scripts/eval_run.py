"""``draftsmith eval-run``: every checkpoint's real speedup, and the best one marked."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.checks import check_measure_options, run_context, run_vocab_size
from draftsmith.distill.drafts import kind_named
from draftsmith.draft_options import draft_option_args, parse_draft_options
from draftsmith.engine_eval import (
    ENGINE_REPORT,
    check_engine_eval_options,
    engine_eval_options,
    engine_run_report,
    engine_run_schedule,
)
from draftsmith.options import (
    device_options,
    draft_vocab_option,
    gammas_option,
    pace_option,
    parse_list,
    progress_option,
    prompt_options,
)
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.files import check_writable
from draftsmith.specdec.locks import folder_lock
from draftsmith.specdec.tree import TreeShape
from draftsmith.train.batch_schedule import parse_batch_sizes
from draftsmith.train.config import load_run_config
from draftsmith.train.eval_run import RunEvalSettings, evaluate_run
from draftsmith.train.speedup import card_figures, does_not_pay

EPILOG = """Writes RUN_DIR/speedup_report.json, speedup_report.md, speedup.png and best.json.
Drafts already measured (same prompts, gammas, tokens) are not measured again unless --force.
With --batch-sizes the best draft's gamma is chosen at each size too (gamma_by_batch_size).
With --engine vllm the best draft is then measured in vLLM too (RUN_DIR/engine_report.md).

example:
  draftsmith eval-run runs/smollm2-135m --gammas 1,2,3,4,6,8 --temperatures 0,1
  draftsmith eval-run runs/smollm2-135m --gammas 1,2,3,4 --trees 3,2,1,1 3,2,2,1:12
  draftsmith eval-run runs/smollm2-135m --batch-sizes 1,4,16"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith eval-run",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[
            prompt_options(),
            gammas_option(),
            device_options(),
            draft_vocab_option(None),
            progress_option(),
            pace_option(),
            draft_option_args(),
            engine_eval_options(),
        ],
    )
    p.add_argument("run_dir", help="a distillation run folder (holds config.yaml and checkpoint-*/)")
    p.add_argument("--temperatures", default="0", help="temperatures, e.g. 0,1 (default: 0)")
    p.add_argument("--repeats", type=int, default=1, help="timed repeats per measurement (default: 1)")
    p.add_argument("--force", action="store_true", help="measure drafts again even if already in the report")
    p.add_argument(
        "--trees",
        nargs="+",
        action="extend",
        default=[],
        metavar="SHAPE",
        help="token-tree shapes to measure beside the chain gammas, as eval --tree takes them (3,2,1,1 or "
        "3,2,2,1:12); the fastest is chosen over the chain when it measured faster, and publish carries it "
        "(default: none, chains only)",
    )
    p.add_argument(
        "--batch-sizes",
        default="1",
        help="batch sizes the best draft's gamma is chosen at (e.g. 1,4,16): each size past 1 is measured beside the "
        "target alone at that size, and where drafting does not pay the size gets gamma 0; publish writes the "
        "schedule where transformers, vLLM and draftsmith read it (default: 1, the draft's own measurement)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine_batch_sizes = check_engine_eval_options(args, {})
    run_dir = Path(args.run_dir)
    cfg = load_run_config(run_dir)
    draft_options = parse_draft_options(args.draft_option)
    kind_named(cfg.draft.kind).check_decode_options(draft_options)  # the run's kind, before anything loads
    check_writable(run_dir, f"the run folder {run_dir} (the reports go there)", folder=True)
    gammas = check_measure_options(args, run_vocab_size(cfg), context=run_context(cfg))
    temperatures = parse_list(args.temperatures, float, "temperatures")
    if any(t < 0 for t in temperatures):
        raise DraftsmithError(f"--temperatures must all be >= 0 (0 = greedy), got {args.temperatures}")
    if args.repeats < 1:
        raise DraftsmithError(f"--repeats must be >= 1, got {args.repeats}")
    settings = RunEvalSettings(
        args.prompts,
        gammas=gammas,
        temperatures=temperatures,
        trees=tuple(TreeShape.parse(shape, "--trees") for shape in args.trees),
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        repeats=args.repeats,
        force=args.force,
        device=args.device,
        dtype=args.dtype,
        draft_vocab_size=args.draft_vocab,
        pace=args.pace,
        draft_options=draft_options,
        progress=not args.no_progress,
        batch_sizes=tuple(parse_batch_sizes(args.batch_sizes)),
    )
    # a run being trained is not measured: keep_last could delete a checkpoint under the measurement
    with folder_lock(run_dir, "draftsmith eval-run"):
        report = evaluate_run(run_dir, settings)
        print((run_dir / "speedup_report.md").read_text())
        print(f"best draft: {report['best']} (written to {run_dir / 'best.json'})")
        if report["best"] is not None:
            chosen = card_figures(report["results"][report["best"]][str(settings.temperatures[0])])
            verdict = does_not_pay(f"the best draft, {report['best']},", chosen["speedup"])
            if verdict is not None:
                print(f"note: {verdict}")
        if engine_batch_sizes:  # --engine vllm: the best draft in vLLM beside the bundled decoder
            engine_run_report(run_dir, report, args, engine_batch_sizes)
            print((run_dir / ENGINE_REPORT).read_text())
        if engine_batch_sizes and len(settings.batch_sizes) > 1:  # and its fastest gamma at each size there
            print(engine_run_schedule(run_dir, report, args, gammas, list(settings.batch_sizes)))
    return 0
