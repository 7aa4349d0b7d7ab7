"""One writer per folder: a command that writes a run or dataset folder holds its lock until it ends.

The lock is ``fcntl.flock`` on a hidden file in the folder (``.draftsmith.lock``). The kernel drops it
when its holder ends, however it ends (``kill -9`` included), so a killed command never leaves a
folder locked; the file itself is removed by a holder that ends normally. A second command asking
for a held folder is refused at once, in one line naming the holder, rather than waiting or writing
beside it (two writers would each add every row or step).

Under ``torchrun`` / ``accelerate launch`` the processes of one launch write the same folder
together: only the launch's first process (``RANK`` 0, or a process started alone) takes the lock.
When it is refused it exits, and the launcher ends the launch's other processes, which wait for it
in the process group's set-up before they write anything. Like ``files``, this module imports
nothing from draftsmith but its error type.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from draftsmith.specdec.errors import DraftsmithError

LOCK_FILE = ".draftsmith.lock"


def launch_leader() -> bool:
    """Whether this process takes a folder's lock for its launch: the first of a multi-process launch
    (its global ``RANK`` is 0), or a process started alone."""
    return int(os.environ.get("RANK", "0")) == 0


def holder(path: Path) -> str:
    """Who holds the lock at ``path``, as its holder wrote it (its pid and command), or "another command"."""
    try:
        text = path.read_text().strip()
    except OSError:
        return "another command"
    return text or "another command"


def acquire(folder: Path) -> int:
    """The descriptor of ``folder``'s lock file, locked; refused in one line while another process holds it.

    A file removed by a holder that ended between our open and our lock is not the lock any more
    (a third command may have made a new one): then the lock is taken again on the file now there.
    """
    path = folder / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DraftsmithError(
                f"{folder} is being written by {holder(path)}; run this command once that one ends, "
                "or give another folder"
            ) from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)


@contextmanager
def folder_lock(folder: Path, command: str) -> Iterator[None]:
    """Hold ``folder``'s lock for the ``with`` block, on the launch's first process; ``command`` (e.g.
    "draftsmith distill") names the holder to a command refused meanwhile. A folder made here for the
    lock alone (the command wrote nothing into it) is removed again."""
    folder = Path(folder)
    if not launch_leader():
        yield
        return
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    fd = acquire(folder)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} ({command})".encode())
        yield
    finally:
        (folder / LOCK_FILE).unlink(missing_ok=True)  # while still held: a waiter re-checks the file it locked
        os.close(fd)
        if made and not any(folder.iterdir()):
            folder.rmdir()
