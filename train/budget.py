"""A training budget in minutes: the run's length planned from the step speed it measures.

With ``optim.max_minutes`` a run trains its first steps (``PLAN_AFTER``), divides the budget by the
seconds those steps took, and from then on trains that many steps in all (never more than
``optim.max_steps``): its learning-rate schedule decays to that step, its checkpoints are spread over
it (``checkpoints`` of them) and held-out metrics are logged at least as often. So the same
config takes about the same minutes on a fast and a slow machine, where a step count would take
three times longer on one than on the other. Minutes count training steps only; the set-up, a
feature store's build, held-out evaluations and checkpoint writes come on top.

The plan is written into the run folder (``plan.json``, atomically) when it is made, and a resumed
run keeps it: the steps it trains do not depend on how fast the machine that resumes it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
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

    def settings(self) -> dict:
        """The run settings the plan replaces, by their dotted names (``config.with_settings``)."""
        return {"optim.max_steps": self.max_steps, "save.steps": self.save_steps, "log.steps": self.log_steps}


def make_plan(minutes: float, step_seconds: float, done: int, max_steps: int, checkpoints: int, log_steps: int) -> Plan:
    """The plan for a budget of ``minutes`` at ``step_seconds`` a step, with ``done`` steps already
    trained: as many steps as fit (at least one more than done, at most ``optim.max_steps``),
    ``checkpoints`` of them evenly spaced, held-out logs no sparser than the checkpoints."""
    fitting = int(60 * minutes / step_seconds)
    total = min(max_steps, max(done + 1, fitting))
    save_steps = max(1, math.ceil(total / checkpoints))
    return Plan(total, save_steps, min(log_steps, save_steps), minutes, step_seconds)


def timed_plan(cfg, step: int, step_seconds: list[float]) -> Plan | None:
    """The plan once this process has timed ``PLAN_AFTER`` steps after its first (which pays for
    allocations and warm-up, and is left out), else None. ``step_seconds``: its steps' seconds, in order."""
    if len(step_seconds) < PLAN_AFTER + 1:
        return None
    per_step = sum(step_seconds[1:]) / (len(step_seconds) - 1)
    return make_plan(
        cfg.optim.max_minutes, per_step, step, cfg.optim.max_steps, cfg.optim.budget_checkpoints, cfg.log.steps
    )


def save_plan(run_dir: Path, plan: Plan) -> None:
    write_text(run_dir / PLAN, json.dumps(dataclasses.asdict(plan), indent=2) + "\n")


def load_plan(run_dir: Path) -> Plan | None:
    """The plan a run made before it was interrupted, or None."""
    path = run_dir / PLAN
    return Plan(**json.loads(path.read_text())) if path.is_file() else None
