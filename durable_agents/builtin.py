"""Workflows shipped with the app: `noop` (N no-op steps) for tests, smoke checks and benchmarks."""

from __future__ import annotations

from typing import Any

from durable_agents.errors import InvalidInputError
from durable_agents.workflows import PlannedStep, call, workflow

NOOP_MAX_STEPS = 100_000


def _validate_noop(run_input: Any) -> None:
    steps = run_input.get("steps", 1) if isinstance(run_input, dict) else None
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= NOOP_MAX_STEPS:
        raise InvalidInputError(f'noop takes {{"steps": N}} with N an integer from 0 to {NOOP_MAX_STEPS}')


def _noop_plan(run_input: dict[str, Any]) -> list[PlannedStep]:
    return [PlannedStep(step_id=f"tick-{i}", name="tick") for i in range(1, run_input.get("steps", 1) + 1)]


def _tick(ctx: Any) -> dict[str, Any]:
    return {"step": ctx.step_id}


noop = workflow(
    "noop",
    version=1,
    steps=[call("tick", _tick)],
    plan=_noop_plan,
    validate_input=_validate_noop,
    description="N no-op steps, for tests and benchmarks",
)
