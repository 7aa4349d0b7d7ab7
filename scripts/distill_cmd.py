"""``draftsmith distill``: distill the target into a draft (see configs/*.yaml)."""

from __future__ import annotations

import argparse

from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train

EPILOG = """examples:
  draftsmith distill --config configs/tiny.yaml
  draftsmith distill --config configs/smollm2-135m.yaml max_steps=200 loss=forward_kl output_dir=runs/fkl
  accelerate launch --config_file configs/accelerate/ddp.yaml -m draftsmith.cli distill --config ...

Any config field can be overridden with key=value. Re-running the same command resumes from the
last complete checkpoint in output_dir."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="draftsmith distill",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML config file (fields of DistillConfig)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    args = p.parse_args(argv)
    cfg = load_config(DistillConfig, args.config, args.overrides)
    run_dir = train(cfg)
    print(f"run folder: {run_dir}")
    return 0
