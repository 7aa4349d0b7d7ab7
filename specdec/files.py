"""Files and folders written so that no reader ever sees half of one.

Everything is written under a hidden temporary name beside its destination and renamed into place
when complete. A rename within one folder is atomic (``os.replace``), so a process killed while
writing leaves the previous version or nothing, never a truncated file; the temporary is removed
when writing fails. Every package may use this module: it imports nothing from draftsmith.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def replace(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` (a file or a folder) to ``final``, replacing what is there.

    A folder cannot be renamed over a non-empty one, so an existing folder at ``final`` is removed
    first; only the rename itself is atomic then.
    """
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    os.replace(tmp, final)


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """A fresh temporary path beside ``final``: write a file or a folder there; on success it becomes ``final``.

    The path does not exist yet (the caller creates the file or folder); it is unique, so two
    processes writing the same destination do not mix their halves.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        replace(tmp, final)
    finally:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(text, encoding="utf-8")
