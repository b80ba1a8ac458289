"""Parallel tool calls (tests/integration/test_parallel_tools.py): one response with several tool_use blocks.

The run input lists the calls of the first response: `{"calls": [{"tool": "fan_call", "slot": 0}, ...]}`;
the `fan-script` participant answers turn 0 with one tool_use block per call (ids `toolu_<slot>`) and says
"done" after. Each call records its start and finish (Execution rows `fan:<slot>:start|finish`, committed at
once) and lands once at a receiver that dedupes on the key (ReceiverCall rows, receiver "fan"). Options:

* `meet`: a call waits (up to `meet_s`) until that many calls of the run started before any finished, and
  answers whether they did: all `met` proves the calls overlapped, without measuring time;
* `fail`: slots that raise ToolFailedError (the model sees an is_error result);
* `pauses`: `{"fan<slot>_before_land": s, "fan<slot>_after_land": s}`, the first time only (a SIGKILL window).
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from durable_agents.agents.participants import FunctionParticipant, participants, text, tool_use
from durable_agents.api import StepContext, agent, tool, workflow
from durable_agents.errors import ToolFailedError
from durable_agents.models import Run
from tests.testapp.models import Execution, ReceiverCall
from tests.testapp.workflows import pause_once

RECEIVER = "fan"


def _script(request: Any) -> Any:
    if request.turn_number:
        return [text("done")]
    run_id = uuid.UUID(request.metadata["user_id"].split(":")[0])
    calls = Run.objects.get(pk=run_id).input["calls"]
    return [tool_use(c["tool"], {"slot": c["slot"]}, id=f"toolu_{c['slot']}") for c in calls]


participants.register("fan-script", FunctionParticipant(_script, name="fan-script"))


def _record(ctx: StepContext, slot: int, what: str) -> None:
    Execution.objects.create(run_id=ctx.run_id, step_id=f"fan:{slot}:{what}", pid=os.getpid(), attempt=ctx.attempt)


def _met(ctx: StepContext) -> bool:
    """Whether `meet` calls of this run were in flight at once (started before any finished), polled for `meet_s`."""
    meet = ctx.input.get("meet")
    if not meet:
        return False
    deadline = time.monotonic() + ctx.input.get("meet_s", 60)
    while _started_together(ctx) < meet:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _started_together(ctx: StepContext) -> int:
    """How many calls started before the first one finished (a call finishes only after it started)."""
    names = Execution.objects.filter(run_id=ctx.run_id, step_id__startswith="fan:").order_by("id")
    started = 0
    for name in names.values_list("step_id", flat=True):
        if name.endswith(":finish"):
            break
        started += 1
    return started


def _call(ctx: StepContext, slot: int, key: str) -> dict[str, Any]:
    _record(ctx, slot, "start")
    met = _met(ctx)
    if slot in ctx.input.get("fail", []):
        _record(ctx, slot, "finish")
        raise ToolFailedError(f"slot {slot} is out of order")
    pause_once(ctx, f"fan{slot}_before_land")
    seen = ReceiverCall.objects.filter(receiver=RECEIVER, idempotency_key=key, deduped=False).exists()
    ReceiverCall.objects.create(
        receiver=RECEIVER,
        kind="apply",
        idempotency_key=key,
        run_id=ctx.run_id,
        args={"slot": slot},
        token=ctx.lease_token,
        held=True,
        deduped=seen,
    )
    pause_once(ctx, f"fan{slot}_after_land")
    _record(ctx, slot, "finish")
    return {"slot": slot, "met": met}


@tool(effectful=True)
def fan_call(slot: int, *, idempotency_key: str, ctx: StepContext) -> dict[str, Any]:
    """Do slot `slot`'s part at the outside receiver (it dedupes on the key)."""
    return _call(ctx, slot, idempotency_key)


@tool(effectful=True, needs_approval=True)
def fan_gated(slot: int, *, idempotency_key: str, ctx: StepContext) -> dict[str, Any]:
    """Do slot `slot`'s part, once a human approved it."""
    return _call(ctx, slot, idempotency_key)


@tool(effectful=True, parallel_safe=False)
def fan_alone(slot: int, *, idempotency_key: str, ctx: StepContext) -> dict[str, Any]:
    """Do slot `slot`'s part, never at the same time as another call."""
    return _call(ctx, slot, idempotency_key)


workflow(
    "parallel_tools",
    steps=[
        agent(
            "work",
            instructions="Do every slot's part.",
            tools=[fan_call, fan_gated, fan_alone],
            participant="fan-script",
            max_tool_errors=10,
        )
    ],
)
