"""Checkpoints: ``checkpoint-{step}/`` = a complete Hugging Face model folder of the draft plus
``state/`` (optimizer, scheduler, RNG: accelerate's ``save_state``) and ``draftsmith.json``.

Each is written to a hidden temporary folder and renamed into place, and ``draftsmith.json`` is
written last, so a folder without it is incomplete (an interrupted save) and is skipped on resume.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

MARKER = "draftsmith.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first; incomplete ones are reported and ignored."""
    found = []
    for path in sorted(run_dir.glob("checkpoint-*")):
        match = _NAME.match(path.name)
        if not match or not path.is_dir():
            continue
        if not (path / MARKER).is_file():
            print(f"skipping incomplete checkpoint {path} (no {MARKER}; an interrupted save)", file=sys.stderr)
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def begin(run_dir: Path, step: int | str) -> Path:
    """A fresh temporary folder for checkpoint ``step`` (or ``"initial"``, the draft before training)."""
    tmp = run_dir / f".checkpoint-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_initial(run_dir: Path, tmp: Path, info: dict) -> Path:
    """Mark ``tmp`` complete and rename it to ``initial/``: the draft as it was before any step."""
    (tmp / MARKER).write_text(json.dumps(info, indent=2))
    final = run_dir / "initial"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def commit(run_dir: Path, tmp: Path, step: int, info: dict, keep_last: int) -> Path:
    """Mark ``tmp`` complete, rename it to ``checkpoint-{step}``, and drop the oldest beyond ``keep_last``."""
    (tmp / MARKER).write_text(json.dumps(info, indent=2))
    final = run_dir / f"checkpoint-{step}"
    if final.exists():  # only an incomplete one can be here: complete ones are never re-saved
        shutil.rmtree(final)
    tmp.rename(final)
    for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old)
    return final
