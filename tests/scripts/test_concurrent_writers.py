"""Two commands writing one folder at once: while one runs, a second into the same run or dataset folder is
refused in one line naming the first (eval-run too: a run being trained loses checkpoints to keep_last), and a
first one killed with SIGKILL leaves no lock behind. The first command runs as a child process; the second
runs in-process through the command line while the first holds the folder."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.cli import main
from draftsmith.distill.dataset_builder import load_built
from draftsmith.specdec.errors import DraftsmithError
from draftsmith.specdec.locks import LOCK_FILE, folder_lock
from tests.helpers import child_env, save_tiny_pair

ROOT = Path(__file__).parents[2]
RUN = ["optim.max_steps=6", "save.steps=3", "log.steps=3", "data.max_samples=16", "generate.max_new_tokens=8"]


def is_held(folder: Path) -> bool:
    """Whether a process holds ``folder``'s lock now (a shared lock on its file cannot be had)."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def start_holding(argv: list[str], folder: Path, ready: Path) -> subprocess.Popen:
    """``draftsmith ARGV`` in a child process, once it holds ``folder``'s lock and ``ready`` exists."""
    child = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.cli", *argv],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (is_held(folder) and ready.exists()):
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"the first command did not get to work:\n{child.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return child


def one_line_refusal(argv: list[str], capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_run_being_trained_is_refused_to_a_second_writer_and_freed_when_its_trainer_is_killed(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["distill", "--config", "tiny", f"output_dir={run}", *RUN]
    first = start_holding(argv, run, run / "config.yaml")
    try:
        holder = f"{run} is being written by pid {first.pid} (draftsmith distill); run this command once that one"
        assert holder in one_line_refusal(argv, capsys)
        evaluated = ["eval-run", str(run), "--gammas", "1", "--limit", "1", "--max-new-tokens", "4", "--no-progress"]
        assert holder in one_line_refusal(evaluated, capsys)
        assert is_held(run) and first.poll() is None  # refused while the first one was still training
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    assert not is_held(run)  # the lock died with its holder; its file is left, and taken over
    assert main(argv) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 3, 6]  # each step logged once
    assert not (run / LOCK_FILE).exists()


def test_a_dataset_being_built_is_refused_to_a_second_build(tmp_path, capsys):
    target = save_tiny_pair(tmp_path / "pair")[0]
    out = tmp_path / "data"
    argv = ["data", "--target", str(target), "--prompts", "builtin", "--max-samples", "16", "--max-new-tokens", "16"]
    argv += ["--batch-size", "4", "--shard-rows", "4", "--temperature", "0", "--no-progress", "--output", str(out)]
    first = start_holding(argv, out, out / "manifest.json")
    try:
        assert f"{out} is being written by pid {first.pid} (draftsmith data)" in one_line_refusal(argv, capsys)
    finally:
        output, _ = first.communicate(timeout=600)
    assert first.returncode == 0, output[-3000:]
    rows = load_built(out)
    keys = list(zip(rows["prompt_id"], rows["sample"], strict=True))
    assert len(keys) == len(set(keys)) == 16  # every prompt answered once
    assert json.loads((out / "manifest.json").read_text())["counts"]["rows"] == 16
    assert not (out / LOCK_FILE).exists()


def test_a_lock_is_one_launchs(tmp_path, monkeypatch):
    """Processes of one launch other than its first (RANK > 0) write beside it without the lock; a lock file
    whose holder has gone is taken over; a folder made for the lock alone goes with it."""
    folder = tmp_path / "run"
    with folder_lock(folder, "draftsmith distill"):
        monkeypatch.setenv("RANK", "1")
        with folder_lock(folder, "draftsmith distill"):  # the same launch's second process
            assert is_held(folder)
        monkeypatch.setenv("RANK", "0")
        refused = pytest.raises(DraftsmithError, match=f"pid {os.getpid()} \\(draftsmith distill\\)")
        with refused, folder_lock(folder, "draftsmith data"):
            pass
    assert not folder.exists()
    folder.mkdir()
    (folder / LOCK_FILE).write_text("pid 1 (a holder killed long ago)")
    with folder_lock(folder, "draftsmith data"):
        assert (folder / LOCK_FILE).read_text() == f"pid {os.getpid()} (draftsmith data)"
    assert folder.is_dir() and not any(folder.iterdir())
