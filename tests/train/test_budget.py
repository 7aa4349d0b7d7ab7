"""A budget of minutes: the run plans its steps from the step time it measures, decays its schedule to
the last of them, spreads its checkpoints over them, and keeps the plan when it is resumed."""

import json
import time
from pathlib import Path

import pytest

from draftsmith.train import budget, loop
from draftsmith.train.checkpoint import checkpoint_dirs
from draftsmith.train.config import DistillConfig, load_config
from draftsmith.train.loop import train

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def test_a_plan_fits_the_budget_within_max_steps():
    plan = budget.make_plan(minutes=2, step_seconds=1.5, done=5, max_steps=900, checkpoints=3, log_steps=10)
    assert (plan.max_steps, plan.save_steps, plan.log_steps) == (80, 27, 10)  # 120 s / 1.5 s
    assert budget.make_plan(2, 0.01, 5, 900, 3, 10).max_steps == 900  # a fast machine stops at optim.max_steps
    assert budget.make_plan(0.01, 5.0, 5, 900, 3, 10).max_steps == 6  # a spent budget ends after one more step
    assert budget.make_plan(1, 1.0, 0, 900, 3, 50).log_steps == 20  # logs no sparser than checkpoints
    # The first step pays for warm-up and is left out of the step time.
    cfg = load_config(DistillConfig, TINY, ["optim.max_minutes=1"])
    assert budget.timed_plan(cfg, 5, [9.0, 1.0, 1.0, 1.0, 1.0]) is None  # PLAN_AFTER steps after the first
    assert budget.timed_plan(cfg, 6, [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]).step_seconds == 1.0


def test_a_store_that_takes_over_gets_the_minutes_left_at_its_own_pace():
    # 2 minutes: 40 live steps at 1.5 s take 1 minute, the other minute fits 120 steps at 0.5 s
    plan = budget.make_plan(2, 1.5, 45, 900, 4, 10, switch_step=40, store_step_seconds=0.5)
    assert (plan.max_steps, plan.save_steps) == (160, 40)
    assert (plan.minutes_at(40), plan.minutes_at(100), plan.minutes_at(160)) == pytest.approx((1.0, 1.5, 2.0))
    assert budget.make_plan(2, 1.5, 95, 900, 4, 10, switch_step=90, store_step_seconds=0.5).max_steps == 96  # spent
    cfg = load_config(DistillConfig, TINY, ["optim.max_minutes=2", "optim.max_steps=900"])
    live = budget.make_plan(2, 1.5, 6, 900, 3, 10)
    store = [9.0, 0.5, 0.5, 0.5, 0.5]
    assert budget.store_plan(cfg, live, 45, 40, [], store) is None  # PLAN_AFTER steps after the first
    assert budget.store_plan(cfg, live, 46, 40, [], [*store, 0.5]).max_steps == 160
    # No plan before the switch (a short first epoch): its live steps' mean is the live pace.
    assert budget.store_plan(cfg, None, 46, 40, [1.5] * 40, [*store, 0.5]).max_steps == 160
    # Every process plans with the pace they agree on (the loop passes the slowest).
    assert budget.store_plan(cfg, live, 46, 40, [], [*store, 0.5], agree=lambda pace: 1.0).max_steps == 100


class StepClock:
    """``time.perf_counter`` on which a training step takes ``step`` seconds (``store_step`` once the
    teacher reads its store, when given) and anything else a microsecond; ``live``: whether each
    step ran the target."""

    def __init__(self, step: float, store_step: float | None = None):
        self.now, self.step, self.store_step, self.live = 1000.0, step, store_step, []

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


def timed_steps(monkeypatch, clock: StepClock) -> StepClock:
    """Training steps that take ``clock``'s seconds."""
    monkeypatch.setattr(time, "perf_counter", clock)
    train_step = loop.train_step

    def timed_step(run, micro):
        clock.live.append(run.teacher.runs_target)
        live = run.teacher.runs_target or clock.store_step is None
        clock.now += clock.step if live else clock.store_step
        return train_step(run, micro)

    monkeypatch.setattr(loop, "train_step", timed_step)
    return clock


@pytest.fixture
def half_second_steps(monkeypatch):
    return timed_steps(monkeypatch, StepClock(0.499))  # a hair under half a second: 12 s / 0.499 s = 24.05 steps fit


def budget_run(out: Path, stop_at_step: int | None = None):
    # 0.2 minutes at 0.5 s a step: 24 steps of the config's 100, checkpoints every 8.
    cfg = load_config(
        DistillConfig, TINY, [f"output_dir={out}", "optim.max_steps=100", "optim.max_minutes=0.2", "log.steps=4"]
    )
    return train(cfg, stop_at_step=stop_at_step)


def test_a_budget_plans_its_steps_schedule_and_checkpoints(tmp_path, half_second_steps):
    result = budget_run(tmp_path / "run")
    plan = json.loads((tmp_path / "run" / budget.PLAN).read_text())
    assert (plan["max_steps"], plan["save_steps"], plan["log_steps"]) == (24, 8, 4)
    assert plan["step_seconds"] == pytest.approx(0.499, abs=1e-4)
    assert result.step == 24
    assert [step for step, _ in checkpoint_dirs(tmp_path / "run")] == [16, 24]  # save.keep_last 2 of 8, 16, 24
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 4, 8, 12, 16, 20, 24]
    assert records[-1]["lr"] == pytest.approx(0.0, abs=1e-9)  # the cosine decays to the planned last step
    assert records[3]["lr"] > 0.001


def test_a_resumed_budget_run_keeps_its_plan_and_its_losses(tmp_path, half_second_steps):
    budget_run(tmp_path / "whole")
    budget_run(tmp_path / "cut", stop_at_step=10)  # planned at step 6, checkpoint-8 written
    half_second_steps.step = 5.0  # the resuming machine is ten times slower: the plan stands
    assert budget_run(tmp_path / "cut").step == 24
    whole, cut = (
        [json.loads(line) for line in (tmp_path / name / "losses.jsonl").read_text().splitlines()]
        for name in ("whole", "cut")
    )
    assert [r["step"] for r in cut] == list(range(1, 25))
    assert [r["loss"] for r in cut] == pytest.approx([r["loss"] for r in whole], rel=1e-5)


def test_a_budget_plans_again_when_the_store_filled_by_the_first_epoch_takes_over(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))  # no store another test filled
    # a step with the live target takes 0.499 s, one reading the store 0.099 s
    clock = timed_steps(monkeypatch, StepClock(0.499, store_step=0.099))
    items = ["optim.max_steps=200", "optim.max_minutes=0.2", "log.steps=4", "teacher.cache=true"]
    items += ["teacher.cache_fill=first_epoch", "teacher.top_k=16"]
    cfg = load_config(DistillConfig, TINY, [f"output_dir={tmp_path / 'run'}", *items])
    result = train(cfg)
    # 48 examples in batches of 8: the first epoch's 6 steps run the target, planned 24 steps at 0.499 s;
    # 6 steps reading the store later: 12 s - 6 x 0.499 s leaves 90 steps at 0.099 s, 96 in all.
    assert clock.live[:6] == [True] * 6 and not any(clock.live[6:])
    plan = json.loads((tmp_path / "run" / budget.PLAN).read_text())
    assert (plan["max_steps"], plan["switch_step"]) == (96, 6)
    assert (plan["step_seconds"], plan["store_step_seconds"]) == pytest.approx((0.499, 0.099), abs=1e-4)
    assert result.step == 96
    assert budget.Plan(**plan).minutes_at(96) == pytest.approx(0.1984, abs=1e-3)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 96 and records[-1]["lr"] == pytest.approx(0.0, abs=1e-9)
