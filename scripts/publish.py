"""``draftsmith publish``: write a checkpoint as a draft model folder that serving stacks load as is."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.loading import check_model_files
from draftsmith.train.publish import is_hub_id, publish, push

EPILOG = """example:
  draftsmith publish runs/smollm2-135m/checkpoint-120 --out drafts/smollm2-135m-draft
  draftsmith publish runs/smollm2-135m/checkpoint-120 --out drafts/x --push-to-hub me/smollm2-draft --private"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith publish",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a checkpoint-*/ or initial/ folder of a run, or a run folder (its best.json)")
    p.add_argument("--out", required=True, help="folder to write (must not exist or be empty, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--push-to-hub", default=None, metavar="REPO_ID", help="also upload the folder to this repo")
    p.add_argument("--private", action="store_true", help="create the hub repo as private")
    p.add_argument(
        "--license",
        default=None,
        help="the model card's license (default: the built-in target's, e.g. apache-2.0, else 'other')",
    )
    return p


def check_hub_options(args: argparse.Namespace) -> None:
    """--private shapes the hub repository: without --push-to-hub there is none."""
    if args.private and not args.push_to_hub:
        raise DraftsmithError("--private applies to the hub repository; add --push-to-hub REPO_ID or leave it out")
    if args.push_to_hub is not None and not is_hub_id(args.push_to_hub):
        raise DraftsmithError(
            f"--push-to-hub takes a hub repository id, owner/name (e.g. me/smollm2-draft), got {args.push_to_hub!r}"
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_hub_options(args)
    check_model_files(Path(args.checkpoint))  # a damaged checkpoint named before anything is written
    out = publish(
        Path(args.checkpoint), Path(args.out), overwrite=args.overwrite, repo_id=args.push_to_hub, license=args.license
    )
    print(f"published draft: {out}")
    if args.push_to_hub:
        push(out, args.push_to_hub, args.private)
    return 0
