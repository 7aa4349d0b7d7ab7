"""A distill process SIGKILLed between two checkpoints resumes with the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# 48 training sequences in batches of 8: 6 steps per epoch, so the checkpoint at step 8 lies inside
# the second epoch and the resumed run must rebuild that epoch's order and skip its first 2 batches.
# On-policy data is mixed in, its pool refreshed every 3 steps (steps 9 and 12 after the resume).
SETTINGS = [
    "optim.max_steps=12",
    "save.steps=4",
    "log.steps=4",
    "on_policy.fraction=0.5",
    "on_policy.refresh_steps=3",
    "on_policy.pool=8",
    "generate.temperature=0.8",
]


def distill_command(output_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "draftsmith.cli", "distill", "--config", "tiny"]
    return [*command, f"output_dir={output_dir}", *SETTINGS]


def environment() -> dict:
    # One thread in every run: the same reduction order, hence bit-identical float32 sums.
    return os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def logged_steps(path: Path) -> list[int]:
    if not path.is_file():
        return []
    # the last line may be half-written while the process runs
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "losses.jsonl").read_text().splitlines())}


def run_to_end(output_dir: Path) -> None:
    done = subprocess.run(
        distill_command(output_dir), cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]


def run_and_kill_after(output_dir: Path, step: int) -> None:
    """Start distill and SIGKILL it as soon as ``step`` is in losses.jsonl."""
    process = subprocess.Popen(
        distill_command(output_dir), cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 600
    while step not in logged_steps(output_dir / "losses.jsonl"):
        assert process.poll() is None, f"distill ended (exit code {process.returncode}) before step {step}"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_sigkill_between_checkpoints_then_resume_equals_an_uninterrupted_run(tmp_path):
    run_to_end(tmp_path / "straight")
    killed = tmp_path / "killed"
    run_and_kill_after(killed, step=9)
    checkpoints = sorted(p.name for p in killed.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4", "checkpoint-8"]  # killed between the checkpoints of steps 8 and 12
    assert max(logged_steps(killed / "losses.jsonl")) in (9, 10, 11)

    run_to_end(killed)  # the same command again resumes from checkpoint-8
    straight, resumed = losses(tmp_path / "straight"), losses(killed)
    assert sorted(resumed) == list(range(1, 13))
    assert resumed == straight  # float32 on CPU, one thread: equal step for step, bit for bit
