"""Workflows the tests run on real workers: each step records its execution in a side table."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from durable_agents.api import PlannedStep, RetryableError, RetryPolicy, StepContext, call, workflow
from durable_agents.models import Step, StepStatus
from tests.testapp.models import Execution


def record_execution(ctx: StepContext) -> int:
    """Insert an Execution row (autocommit); returns how many times this step body ran, this one included."""
    already = Step.objects.filter(pk=ctx.step.pk, status=StepStatus.DONE).exists()
    Execution.objects.create(
        run_id=ctx.run_id, step_id=ctx.step_id, pid=os.getpid(), attempt=ctx.attempt, after_commit=already
    )
    return Execution.objects.filter(run_id=ctx.run_id, step_id=ctx.step_id).count()


def _record_step(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    low, high = ctx.input.get("sleep_ms", [0, 0])
    if high:
        time.sleep(random.uniform(low, high) / 1000)
    return {"step": ctx.step_id}


workflow(
    "record",
    steps=[call("work", _record_step)],
    plan=lambda inp: [PlannedStep(f"s{i:03d}", "work") for i in range(1, inp.get("steps", 1) + 1)],
    description="N steps that record each execution",
)


def _flaky(ctx: StepContext) -> dict[str, Any]:
    runs = record_execution(ctx)
    if runs <= ctx.input.get("failures", 0):
        raise RetryableError(f"flaky failure {runs}")
    return {"ok_after": runs}


def _permanent(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    raise ValueError("the order data is malformed")


def _slow(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    time.sleep(ctx.input.get("seconds", 1.0))
    return {"slept": ctx.input.get("seconds", 1.0)}


def _big(ctx: StepContext) -> dict[str, Any]:
    return {"blob": "x" * ctx.input.get("size", 100_000)}


def _reads_big(ctx: StepContext) -> dict[str, Any]:
    return {"length": len(ctx.result("big")["blob"])}


workflow("flaky", steps=[call("flaky", _flaky, retry=RetryPolicy(max_attempts=4)), call("after", _record_step)])
workflow("broken", steps=[call("first", _record_step), call("broken", _permanent), call("never", _record_step)])
workflow("slow", steps=[call("slow", _slow), call("after", _record_step)])
workflow("big", steps=[call("big", _big), call("reads_big", _reads_big)])
