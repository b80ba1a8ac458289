"""Child runs (tests/integration/test_children.py): parents that fan out to `child_work` runs.

A child's input: `{"item": n}` plus options — `fail`: its work fails; `hold`: it waits for signal "go" first;
`order_id`: it first charges that order (a ledger row per key: a duplicate child would charge twice).
Each execution of a child's work is an Execution row (step id "work"); each evaluation of a parent's fan-out
list is an Execution row (step id "<step>:each") of the parent.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from durable_agents.api import PermanentError, PlannedStep, StepContext, call, children, wait_for_signal, workflow
from durable_agents.engine.control import Park
from tests.testapp.models import Execution
from tests.testapp.workflows import _charge_step, _record_step, pause_once, record_execution


def _child_work(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    pause_once(ctx, "child_work")
    if ctx.input.get("fail"):
        raise PermanentError(f"child {ctx.input.get('item')} fails on purpose")
    return {"item": ctx.input.get("item"), "double": 2 * int(ctx.input.get("item", 0))}


def _child_plan(inp: dict[str, Any]) -> list[PlannedStep]:
    plan = [PlannedStep("charge", "charge", {"amount": "5.00"})] if inp.get("order_id") else []
    plan += [PlannedStep("go", "go")] if inp.get("hold") else []
    return [*plan, PlannedStep("work", "work")]


workflow(
    "child_work",
    steps=[call("charge", _charge_step), wait_for_signal("go"), call("work", _child_work)],
    plan=_child_plan,
)


def _items(ctx: StepContext) -> list[Any]:
    Execution.objects.create(run_id=ctx.run_id, step_id=f"{ctx.step_id}:each", pid=os.getpid(), attempt=ctx.attempt)
    return ctx.input["items"]


def paused(definition: Any) -> Any:
    """The fan-out step with SIGKILL windows (`pauses` in the parent's input, the first time only): after its
    children are started and before it parks (`after_spawn`), and after it gathered and before its checkpoint
    (`after_gather`)."""
    inner = definition.fn

    def run(ctx: StepContext) -> Any:
        try:
            result = inner(ctx)
        except Park:
            pause_once(ctx, "after_spawn")
            raise
        pause_once(ctx, "after_gather")
        return result

    return dataclasses.replace(definition, fn=run)


AFTER = call("after", _record_step)
workflow("fan_all", steps=[paused(children("fan", workflow="child_work", each=_items)), AFTER])
workflow(
    "fan_all_compensating",
    steps=[children("fan", workflow="child_work", each=_items), AFTER],
    on_failure="compensate",
)
workflow("fan_collect", steps=[children("fan", workflow="child_work", each=_items, on_failure="collect"), AFTER])
workflow("fan_any", steps=[children("fan", workflow="child_work", each=_items, join="any"), AFTER])
workflow("fan_two", steps=[children("fan", workflow="child_work", each=_items, join=2, on_failure="collect"), AFTER])
workflow("fan_one", steps=[children("fan", workflow="child_work", input=lambda ctx: {"item": 7}), AFTER])
workflow("fan_nested", steps=[children("fan", workflow="fan_all", each=_items), AFTER])


def _growing(ctx: StepContext) -> list[Any]:
    """A live query that keeps growing: one item more at every evaluation."""
    Execution.objects.create(run_id=ctx.run_id, step_id=f"{ctx.step_id}:each", pid=os.getpid(), attempt=ctx.attempt)
    seen = Execution.objects.filter(run_id=ctx.run_id, step_id=f"{ctx.step_id}:each").count()
    return [{"item": i} for i in range(seen)]


workflow("fan_growing", steps=[children("fan", workflow="child_work", each=_growing), AFTER])


# Concurrency keys in families (tests/integration/test_concurrency_keys.py): a child workflow keyed by customer, and
# a parent keyed the same way.
workflow(
    "keyed_child_work",
    steps=[call("charge", _charge_step), wait_for_signal("go"), call("work", _child_work)],
    plan=_child_plan,
    concurrency_key=lambda inp: inp["customer"],
)
workflow("fan_keyed_children", steps=[children("fan", workflow="keyed_child_work", each=_items), AFTER])
workflow(
    "fan_keyed",
    steps=[children("fan", workflow="keyed_child_work", each=_items), AFTER],
    concurrency_key=lambda inp: inp["customer"],
)
workflow(
    "fan_keyed_plain_children",
    steps=[children("fan", workflow="child_work", each=_items), AFTER],
    concurrency_key=lambda inp: inp["customer"],
)
workflow("keyed_inner", steps=[call("work", _record_step)], concurrency_key=lambda inp: inp["key"])
workflow(
    "keyed_mid",
    steps=[children("fan", workflow="keyed_inner", each=lambda ctx: [{"key": ctx.input["inner_key"]}])],
    concurrency_key=lambda inp: inp["key"],
)
workflow(
    "keyed_outer",
    steps=[
        children(
            "fan", workflow="keyed_mid", each=lambda ctx: [{"key": ctx.input["mid_key"], "inner_key": ctx.input["key"]}]
        )
    ],
    concurrency_key=lambda inp: inp["key"],
)
workflow(
    "fan_bad",
    steps=[children("fan", workflow="child_work", each=lambda ctx: [{"item": 0}, {"item": float("nan")}]), AFTER],
)


def _noop_items(ctx: StepContext) -> list[Any]:
    return [{"steps": int(ctx.input.get("steps", 1))}] * int(ctx.input["n"])


# bench/children.py: one parent fanning out to n `noop` runs.
workflow("fan_noop", steps=[children("fan", workflow="noop", each=_noop_items)])
# Child runs found by their own order numbers (tests/integration/test_search.py).
workflow(
    "fan_searchable",
    steps=[children("fan", workflow="searchable", each=lambda ctx: [{"order_id": o} for o in ctx.input["orders"]])],
)
