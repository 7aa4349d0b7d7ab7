"""The ``draftsmith`` command: one subcommand per stage, each a thin module in ``scripts/``."""

from __future__ import annotations

import importlib
import sys

from draftsmith.options import attach_dashed_values, refuse_repeated
from draftsmith.specdec.errors import DraftsmithError

COMMANDS = {
    "data": ("draftsmith.data", "build a training set of the target's answers (self-written or given prompts)"),
    "distill": ("draftsmith.distill_cmd", "distill the target into a draft with acceptance-oriented losses"),
    "eval-run": ("draftsmith.eval_run", "measure every checkpoint of a run, choose gamma, mark the best one"),
    "publish": ("draftsmith.publish", "write a checkpoint as a standard draft model folder, optionally push it"),
    "quickstart": ("draftsmith.quickstart", "the whole job on the embedded default target: distill, measure, publish"),
    "eval": ("draftsmith.eval", "measure a (target, draft) pair: acceptance rate, tau, real and predicted speedup"),
}

USAGE = "usage: draftsmith COMMAND [options]   (draftsmith COMMAND --help for its options)\n\ncommands:\n" + "\n".join(
    f"  {name:<12}{about}" for name, (_, about) in COMMANDS.items()
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # draftsmith shows its own progress
    hf_logging.set_verbosity_error()
    module = importlib.import_module(COMMANDS[name][0])
    try:
        refuse_repeated(rest)
        return module.main(attach_dashed_values(rest)) or 0
    except DraftsmithError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
