"""``draftsmith eval-run``: every checkpoint's real speedup, and the best one marked."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from draftsmith.distill.draft_init import draft_decoder, load_draft
from draftsmith.distill.early_exit import META as EE_META
from draftsmith.distill.early_exit import WEIGHTS as EE_WEIGHTS
from draftsmith.distill.early_exit import is_early_exit
from draftsmith.specdec import draft_vocab
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import eos_token_ids, resolve_device, resolve_dtype
from draftsmith.specdec.prompts import read_prompts
from draftsmith.train import speedup
from draftsmith.train.config import DistillConfig
from draftsmith.train.loop import load_target

EPILOG = """Writes RUN_DIR/speedup_report.json, speedup_report.md, speedup.png and best.json.
Drafts already measured (same prompts, gammas, tokens) are not measured again unless --force.

example:
  draftsmith eval-run runs/smollm2-135m --prompts distill/data/eval_prompts.jsonl --gammas 1,2,3,4,6,8"""


def parse_list(text: str, kind, name: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise DraftsmithError(f"--{name} must be a comma-separated list, got {text!r}") from err
    if not values:
        raise DraftsmithError(f"--{name} is empty")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="draftsmith eval-run",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="a distillation run folder (holds config.yaml and checkpoint-*/)")
    p.add_argument("--prompts", required=True, help="held-out prompts JSONL (not the training prompts)")
    p.add_argument("--gammas", default="1,2,3,4,6,8", help="gammas to choose from (default: 1,2,3,4,6,8)")
    p.add_argument("--temperatures", default="0", help="temperatures, e.g. 0,1 (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--force", action="store_true", help="measure drafts again even if already in the report")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: CUDA when present)")
    p.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 (default: bfloat16 on CUDA and on CPUs with native bfloat16, else float32)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="score only the N tokens most frequent in the run's training answers in the draft's head "
        "(frequency-ranked drafting; exact, the target still verifies over its full vocabulary). 0 = full head",
    )
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    run(
        Path(args.run_dir),
        args.prompts,
        parse_list(args.gammas, int, "gammas"),
        parse_list(args.temperatures, float, "temperatures"),
        args.max_new_tokens,
        args.limit,
        args.repeats,
        args.force,
        args.device,
        not args.no_progress,
        args.dtype,
        args.draft_vocab,
    )
    return 0


def run(
    run_dir: Path,
    prompts_file: str,
    gammas: list[int],
    temperatures: list[float],
    max_new_tokens: int = 64,
    limit: int | None = None,
    repeats: int = 1,
    force: bool = False,
    device: str | None = None,
    progress: bool = True,
    dtype: str | None = None,
    draft_vocab_size: int = 0,
) -> dict:
    if any(g < 1 for g in gammas):
        raise DraftsmithError(f"gammas must be >= 1, got {gammas}")
    if not (run_dir / "config.yaml").is_file():
        raise DraftsmithError(f"{run_dir} is not a distillation run folder (no config.yaml)")
    drafts = speedup.drafts_of_run(run_dir)
    if not drafts:
        raise DraftsmithError(f"{run_dir} has no checkpoints yet (no initial/ or checkpoint-*/ folders)")
    prompts = read_prompts(prompts_file)[:limit]
    cfg = DistillConfig(**yaml.safe_load((run_dir / "config.yaml").read_text()))
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    target, tokenizer = load_target(cfg, dev, torch_dtype)
    eos = eos_token_ids(target, tokenizer)
    ranking = draft_vocab.load_ranking(run_dir, draft_vocab_size) if draft_vocab_size else None

    report = speedup.load_report(run_dir)
    settings = {
        "prompts": str(prompts_file),
        "gammas": gammas,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "draft_vocab": draft_vocab_size,
    }
    if force or any(report.get(k) != v for k, v in settings.items()):
        report = {"results": {}}
    report.update(
        settings,
        run=str(run_dir),
        target=cfg.target,
        temperatures=temperatures,
        hardware=speedup.hardware(),
    )
    for name, step, folder in drafts:
        for temp in temperatures:
            if str(temp) in report["results"].get(name, {}):
                continue
            needed = (EE_META, EE_WEIGHTS) if is_early_exit(folder) else ("config.json", "model.safetensors")
            missing = [f for f in needed if not (folder / f).is_file()]
            if missing:
                raise DraftsmithError(f"{folder} is missing {', '.join(missing)}; it is not a complete checkpoint")
            draft = load_draft(str(folder), target, dev, torch_dtype)
            if ranking and not is_early_exit(folder):
                draft = draft_vocab.SubsetHeadDraft(draft, ranking, eos)
            print(f"measuring {name} at temperature {temp}")
            result = speedup.measure_draft(
                target,
                draft,
                tokenizer,
                prompts,
                gammas,
                temp,
                eos,
                max_new_tokens,
                repeats,
                cfg.seed,
                progress,
                decode=draft_decoder(draft),
            )
            report["results"].setdefault(name, {})[str(temp)] = {"step": step, **result}
            speedup.write_report(run_dir, report)  # after each draft, so an interruption loses nothing
    best = speedup.write_report(run_dir, report)
    print((run_dir / "speedup_report.md").read_text())
    print(f"best draft: {best} (written to {run_dir / 'best.json'})")
    return report
