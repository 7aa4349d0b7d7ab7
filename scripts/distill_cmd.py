"""``draftsmith distill``: distill the target into a draft (see the configs shipped in draftsmith.configs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.checks import check_run_inputs
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.locks import folder_lock
from draftsmith.train.config import DistillConfig, config_path, load_config, shipped_configs
from draftsmith.train.loop import train

EPILOG = """examples:
  draftsmith distill --config tiny
  draftsmith distill --config smollm2-135m optim.max_steps=200 loss.name=tvd output_dir=runs/tvd
  draftsmith distill --config smollm2-135m-eagle3 draft.options.ttt_steps=2 optim.lr=3e-4
  draftsmith distill --config my-run.yaml
  accelerate launch --config_file configs/accelerate/ddp.yaml -m draftsmith.cli distill --config ...

--config takes a YAML file or the name of a shipped config (tiny, smollm2-135m, smollm2-135m-early-exit).
A config groups its settings by what they configure: draft (kind, init, layers, options: the kind's
own), data, generate (the target's answers), teacher, loss, optim, on_policy, save, log, eval, beside
output_dir, target, device, seed and resume. Any setting can be overridden with its dotted name,
section.key=value (a key inside a mapping too: draft.options.k=4); the flat keys of earlier configs
(lr, draft_layers, kind_options, ...) still work, with a hint naming their place. Re-running the same
command resumes from the last complete checkpoint in output_dir."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith distill",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML config file, or a shipped config's name (e.g. tiny); required")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (e.g. optim.lr=1e-3 draft.layers=3)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.config is None:
        # Every field has a default, but a run nobody chose (100 steps on the default target) is no default.
        raise DraftsmithError(
            f"distill needs --config: a YAML file, or a shipped config ({', '.join(shipped_configs())})"
        )
    cfg = load_config(DistillConfig, config_path(args.config), args.overrides)
    check_run_inputs(cfg)
    with folder_lock(Path(cfg.output_dir), "draftsmith distill"):  # one command at a time writes a run
        result = train(cfg)
    print(f"run folder: {result.run_dir}")
    return 0
