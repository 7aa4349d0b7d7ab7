"""A training budget in minutes: the run's length planned from the step speed it measures.

With ``optim.max_minutes`` a run trains its first steps (``PLAN_AFTER``), divides the budget by the
seconds those steps took, and from then on trains that many steps in all (never more than
``optim.max_steps``): its learning-rate schedule decays to that step, its checkpoints are spread over
it (``checkpoints`` of them) and held-out metrics are logged at least as often. So the same
config takes about the same minutes on a fast and a slow machine, where a step count would take
three times longer on one than on the other. Minutes count training steps only; the set-up, a
feature store's build, held-out evaluations and checkpoint writes come on top.

A teacher that fills its store during the first epoch (``teacher.cache_fill: first_epoch``) runs
the target in every step of that epoch and only reads the store after it, so later steps are
faster. When the store takes over, the run times its first steps there too and plans again: the
minutes left after the live steps, at the store's pace (``switch_step``, ``store_step_seconds``).

The plan is written into the run folder (``plan.json``, atomically) when it is made, and a resumed
run keeps it: the steps it trains do not depend on how fast the machine that resumes it is. Every
process plans from the slowest process's step time, so all of them train the same steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.specdec.files import write_text

PLAN = "plan.json"
PLAN_AFTER = 5  # steps timed before the plan is made (the first one pays for allocations)


@dataclass(frozen=True)
class Plan:
    """What a budget came to: the steps in all, checkpoint and log intervals, and what they rest on."""

    max_steps: int
    save_steps: int
    log_steps: int
    minutes: float
    step_seconds: float  # the measured seconds per step the plan divided by
    switch_step: int | None = None  # the step from which the teacher was read from its store, if it changed
    store_step_seconds: float | None = None  # the measured seconds per step from then on

    def settings(self) -> dict:
        """The run settings the plan replaces, by their dotted names (``config.with_settings``)."""
        return {"optim.max_steps": self.max_steps, "save.steps": self.save_steps, "log.steps": self.log_steps}

    def minutes_at(self, step: int) -> float:
        """The training minutes ``step`` steps come to at the plan's paces."""
        if self.store_step_seconds is None:
            return step * self.step_seconds / 60
        live = min(step, self.switch_step)
        return (live * self.step_seconds + (step - live) * self.store_step_seconds) / 60


def make_plan(
    minutes: float,
    step_seconds: float,
    done: int,
    max_steps: int,
    checkpoints: int,
    log_steps: int,
    switch_step: int | None = None,
    store_step_seconds: float | None = None,
) -> Plan:
    """The plan for a budget of ``minutes`` at ``step_seconds`` a step (up to ``switch_step``, then
    ``store_step_seconds`` a step, when given), with ``done`` steps already trained: as many steps as
    fit (at least one more than done, at most ``optim.max_steps``), ``checkpoints`` of them evenly
    spaced, held-out logs no sparser than the checkpoints."""
    if store_step_seconds is None:
        fitting = int(60 * minutes / step_seconds)
    else:
        left = max(0.0, 60 * minutes - switch_step * step_seconds)
        fitting = switch_step + int(left / store_step_seconds)
    total = min(max_steps, max(done + 1, fitting))
    save_steps = max(1, math.ceil(total / checkpoints))
    return Plan(total, save_steps, min(log_steps, save_steps), minutes, step_seconds, switch_step, store_step_seconds)


def pace(step_seconds: list[float], agree: Callable[[float], float]) -> float | None:
    """Seconds per step once ``PLAN_AFTER`` steps after the first were timed (the first pays for
    allocations and warm-up, and is left out), agreed between processes by ``agree``; else None."""
    if len(step_seconds) < PLAN_AFTER + 1:
        return None
    return agree(sum(step_seconds[1:]) / (len(step_seconds) - 1))


def timed_plan(cfg, step: int, step_seconds: list[float], agree: Callable[[float], float] = float) -> Plan | None:
    """The plan once this process has timed enough steps (``pace``), else None. ``step_seconds``: its
    steps' seconds, in order; ``agree``: every process's pace to the one all of them plan with."""
    per_step = pace(step_seconds, agree)
    if per_step is None:
        return None
    return make_plan(
        cfg.optim.max_minutes, per_step, step, cfg.optim.max_steps, cfg.optim.budget_checkpoints, cfg.log.steps
    )


def store_plan(
    cfg,
    plan: Plan | None,
    step: int,
    switch_step: int,
    live_seconds: list[float],
    store_seconds: list[float],
    agree: Callable[[float], float] = float,
) -> Plan | None:
    """The plan once the steps after the teacher turned to its store at ``switch_step`` are timed
    (``store_seconds``), else None: the live steps at the live pace (``plan``'s, or ``live_seconds``'
    mean where no plan was made yet), the rest at the store's."""
    store_pace = pace(store_seconds, agree)
    if store_pace is None:
        return None
    minutes, max_steps, checkpoints, log_steps = (
        cfg.optim.max_minutes,
        cfg.optim.max_steps,
        cfg.optim.budget_checkpoints,
        cfg.log.steps,
    )
    if plan is not None:
        live_pace = plan.step_seconds
    elif live_seconds:
        live_pace = agree(sum(live_seconds) / len(live_seconds))
    else:  # nothing ran live in this process: the whole budget at the store's pace
        live_pace = store_pace
    return make_plan(minutes, live_pace, step, max_steps, checkpoints, log_steps, switch_step, store_pace)


def save_plan(run_dir: Path, plan: Plan) -> None:
    write_text(run_dir / PLAN, json.dumps(dataclasses.asdict(plan), indent=2) + "\n")


def load_plan(run_dir: Path) -> Plan | None:
    """The plan a run made before it was interrupted, or None."""
    path = run_dir / PLAN
    return Plan(**json.loads(path.read_text())) if path.is_file() else None
