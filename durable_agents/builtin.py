"""Workflows shipped with the app: `noop` (N no-op steps) for tests, smoke checks, benchmarks and the demo."""

from __future__ import annotations

import time
from typing import Any

from durable_agents.errors import InvalidInputError
from durable_agents.workflows import PlannedStep, call, workflow

NOOP_MAX_STEPS = 100_000


def _validate_noop(run_input: Any) -> None:
    steps = run_input.get("steps", 1) if isinstance(run_input, dict) else None
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= NOOP_MAX_STEPS:
        raise InvalidInputError(f'noop takes {{"steps": N}} with N an integer from 0 to {NOOP_MAX_STEPS}')
    sleep_ms = run_input.get("sleep_ms", 0)
    if not isinstance(sleep_ms, int) or isinstance(sleep_ms, bool) or not 0 <= sleep_ms <= 60_000:
        raise InvalidInputError('noop\'s optional "sleep_ms" (time each step takes) is an integer from 0 to 60000')


def _noop_plan(run_input: dict[str, Any]) -> list[PlannedStep]:
    return [PlannedStep(step_id=f"tick-{i}", name="tick") for i in range(1, run_input.get("steps", 1) + 1)]


def _tick(ctx: Any) -> dict[str, Any]:
    if ctx.input.get("sleep_ms"):
        time.sleep(ctx.input["sleep_ms"] / 1000)
    return {"step": ctx.step_id}


noop = workflow(
    "noop",
    version=1,
    steps=[call("tick", _tick)],
    plan=_noop_plan,
    validate_input=_validate_noop,
    description='N no-op steps: {"steps": N, "sleep_ms": 0}',
)
