"""--draft-option KEY=VALUE: the decode options each drafter kind declares (``DraftKind.decode_options``),
taken by ``eval`` and ``eval-run`` without the commands naming a kind or an option."""

from __future__ import annotations

import argparse
import sys

import yaml

from draftsmith.distill.drafts import KINDS
from draftsmith.specdec.errors import DraftsmithError


class _RenamedFlag(argparse.Action):
    """A flag a decode option replaced: taken as ``--draft-option KEY=VALUE``, with a one-line hint."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{option_string} is now --draft-option {self.const}", file=sys.stderr)
        getattr(namespace, self.dest).append(self.const)


def draft_option_args() -> argparse.ArgumentParser:
    """--draft-option KEY=VALUE (repeatable), and the flags kinds' options replaced (hidden)."""
    declared = [
        f"{kind.name}: {key} ({option.type.__name__}) {option.help}"
        for kind in KINDS.values()
        for key, option in kind.decode_options.items()
    ]
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--draft-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a decode option of the draft's kind, repeatable; the kind checks it. "
        f"Declared: {'; '.join(declared) or 'none'}",
    )
    for kind in KINDS.values():
        for key, option in kind.decode_options.items():
            if option.old_flag is not None:
                const = f"{key}={yaml.safe_dump(option.old_value).splitlines()[0]}"
                p.add_argument(
                    option.old_flag,
                    dest="draft_option",
                    nargs=0,
                    const=const,
                    action=_RenamedFlag,
                    help=argparse.SUPPRESS,
                )
    return p


def parse_draft_options(pairs: list[str]) -> dict[str, object]:
    """``["share=false", "k=3"]`` -> ``{"share": False, "k": 3}``: values read as YAML scalars (true, 3, 0.5, text)."""
    options = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise DraftsmithError(f"--draft-option takes KEY=VALUE, got {pair!r}")
        if key.strip() in options:  # the last one would silently win
            raise DraftsmithError(f"--draft-option {key.strip()} is given twice; give it once")
        try:
            options[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise DraftsmithError(f"--draft-option {key}: cannot read {text!r} as a value") from err
    return options
