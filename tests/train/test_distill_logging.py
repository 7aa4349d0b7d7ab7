"""What a distill run reports as it goes: console lines per log.steps, grad norm in metrics.jsonl,
TensorBoard event files with log.report_to, and a closing summary with the next command."""

import json
import re

import pytest

from draftsmith.cli import main
from draftsmith.train.config import config_path

TINY = config_path("tiny")


def test_tensorboard_events_console_lines_and_summary(tmp_path, capsys):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    args = [f"output_dir={run}", "optim.max_steps=4", "save.steps=4", "log.steps=2", "log.report_to=tensorboard"]
    assert main(["distill", "--config", TINY, *args]) == 0
    captured = capsys.readouterr()
    out = captured.out + captured.err

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 2, 4]
    assert all(m["grad_norm"] > 0 for m in metrics[1:])

    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"]
    expected = f"loss {metrics[1]['loss']:.4f}, alpha {metrics[1]['acceptance_rate']:.3f}"
    assert expected in lines[0] and re.search(r"tokens/s, lr \S+, grad norm \S+, ETA \d+:\d\d:\d\d$", lines[0])

    best = max(metrics, key=lambda m: m["acceptance_rate"])
    assert f"best held-out alpha {best['acceptance_rate']:.3f} at step {best['step']}" in out
    assert f"next: draftsmith eval-run {run} " in out

    events = list((run / "distill").glob("events.out.tfevents.*"))
    assert len(events) == 1
    reader = event_accumulator.EventAccumulator(str(events[0]))
    reader.Reload()
    alpha = [(e.step, e.value) for e in reader.Scalars("acceptance_rate")]
    assert alpha == [(m["step"], pytest.approx(m["acceptance_rate"], rel=1e-6)) for m in metrics[1:]]


def test_tracker_that_is_not_known_is_refused(tmp_path, capsys):
    assert main(["distill", "--config", TINY, f"output_dir={tmp_path / 'run'}", "log.report_to=neptune"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "log.report_to must be none or a comma-separated list of tensorboard, wandb, trackio" in err
