"""Files and folders written so that no reader ever sees half of one.

Everything is written under a hidden temporary name beside its destination and renamed into place
when complete. A rename within one folder is atomic (``os.replace``), so a process killed while
writing leaves the previous version or nothing, never a truncated file; the temporary is removed
when writing fails. Every package may use this module: it imports nothing from draftsmith but its
error type. ``check_writable`` says before any work starts whether an output path can be written.

Atomic replacement is for regular files and folders. A device, FIFO or socket, and a symbolic link
to a file (``/dev/stdout``, a pipe, a link into ``/proc/self/fd``) are written through, in place, never
renamed over: the link stays and what it points to receives the bytes. A link to a folder is followed,
and the folder it points to replaced; a folder cannot be written to a device.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftsmith.specdec.errors import DraftsmithError


def replace(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` (a file or a folder) to ``final``, replacing what is there.

    A folder cannot be renamed over a non-empty one, so an existing folder at ``final`` is first
    renamed aside, then ``tmp`` renamed into place, and only then the old one removed: at every
    moment one complete version is on disk (a process killed in between leaves the old one under
    its hidden name, beside the destination).
    """
    if final.is_dir() and not final.is_symlink():
        aside = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.old.tmp")
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside, ignore_errors=True)
        return
    os.replace(tmp, final)


def is_special(path: Path) -> bool:
    """Whether ``path`` is (or links to) something other than a regular file or folder: a device, FIFO or socket."""
    try:
        mode = os.stat(path).st_mode  # follows symbolic links
    except OSError:  # missing, or a link to nothing
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def destination(path: Path) -> Path:
    """Where writing ``path`` lands: the file or folder a symbolic link points to, else ``path`` itself."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def write_through(tmp: Path, special: Path) -> None:
    """Copy the finished file ``tmp`` into ``special`` (a device, FIFO or link to a file), in place."""
    if tmp.is_dir():
        raise DraftsmithError(f"{special} is a device or pipe, not a folder: give a folder path")
    try:
        with open(tmp, "rb") as source, open(special, "wb") as out:
            shutil.copyfileobj(source, out)
    except OSError as err:
        raise DraftsmithError(f"cannot write {special} ({err.strerror}); give a file path") from err


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """A fresh temporary path beside ``final``: write a file or a folder there; on success it becomes ``final``.

    The path does not exist yet (the caller creates the file or folder); it is unique, so two
    processes writing the same destination do not mix their halves. A ``final`` that is a device or
    FIFO is written through instead, and one that is a symbolic link replaces what it points to.
    """
    final = Path(final)
    through = is_special(final) or (final.is_symlink() and not final.is_dir())
    special = final if through else None
    final = Path(tempfile.gettempdir()) / "draftsmith-through" if through else destination(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        if special is not None:
            write_through(tmp, special)
        else:
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


def check_writable(path: Path, what: str, folder: bool = False) -> None:
    """Refuse, in one line, an output path this process cannot create or replace, before any work starts.

    what: how the user gave the path (``--json out.json``, ``output_dir=runs/x``), named in the message.
    folder: the path is to be a folder (an existing file there is refused), else a file (an existing
    folder is refused). Nothing is created: the nearest existing folder on the way is probed with a
    temporary file, which is also how a read-only file system or a missing permission shows.
    """
    path = Path(path).expanduser()
    if is_special(path) or (path.is_symlink() and not path.is_dir() and path.exists()):
        if folder:
            raise DraftsmithError(f"{what} is a device, pipe or link to a file, not a folder: give a folder path")
        if not os.access(path, os.W_OK):
            raise DraftsmithError(f"{what}: cannot write to it (permission denied); give a file path")
        return  # written through in place (``atomic_path``)
    path = destination(path)
    if path.exists() and path.is_dir() != folder:
        kind, wanted = ("a file", "folder") if folder else ("a folder", "file")
        raise DraftsmithError(f"{what} is {kind}, not a {wanted}: give a {wanted} path")
    existing = path if folder and path.is_dir() else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DraftsmithError(f"{what}: {existing} is a file, so nothing can be written under it")
    try:
        probe = existing / f".draftsmith-write-check-{uuid.uuid4().hex[:8]}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise DraftsmithError(
            f"{what}: cannot write in {existing} ({err.strerror}); choose a writable location"
        ) from err
