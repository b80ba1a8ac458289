"""Workflows for the trust tests (issue 13): approvals around re-plans, sagas over calls of unknown outcome,
zombies, forks at failed effects, judge redos, long keys. Driven in-process unless a test starts workers.

`AMOUNTS` is what an order "costs" right now (an observation reads it); `HOOKS` lets a test act at a named
point inside a step (take the lease away, lose an answer) — both per process, for in-process tests.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

from durable_agents.agents.participants import text, tool_use
from durable_agents.api import (
    FunctionParticipant,
    PlannedStep,
    RetryableError,
    StepContext,
    agent,
    call,
    judge,
    tool,
    tool_step,
    workflow,
)
from durable_agents.errors import ModelUnavailableError
from tests.testapp.models import LedgerEntry
from tests.testapp.workflows import _permanent, _record_step, big_refund, charge, pause_once, record_execution

AMOUNTS: dict[str, str] = {}
HOOKS: dict[str, Callable[[Any], None]] = {}
FRAGILE = {"refuse": False}


def hook(ctx: Any, point: str) -> None:
    """Run the test's hook for `point`, if it set one; pause there if the run input asks (real workers)."""
    if point in HOOKS:
        HOOKS[point](ctx)
    if ctx is not None:
        pause_once(ctx, point)


# --- Approvals: the amount an approval showed, and the amount the call would refund -------------------------


def _observe(ctx: StepContext) -> dict[str, Any]:
    return {"amount": AMOUNTS.get(ctx.input["order_id"], "60.00")}


def _refund_now(ctx: StepContext) -> dict[str, Any]:
    # Reads the amount when it runs: after an approval the step re-executes and may see another amount.
    amount = AMOUNTS.get(ctx.input["order_id"], "60.00")
    return ctx.call_tool(big_refund, {"order_id": ctx.input["order_id"], "amount": amount})


workflow(
    "approval_replan",
    steps=[
        call("observe", _observe, fresh_for=timedelta(minutes=10)),
        tool_step(
            "refund",
            big_refund,
            lambda ctx: {"order_id": ctx.input["order_id"], "amount": ctx.result("observe")["amount"]},
            depends_on=["observe"],
        ),
    ],
)
workflow("approval_args", steps=[call("refund", _refund_now)])


# --- Sagas over an external call: ship (compensated by unship) through a receiver that dedupes on the key -----


def _post(url: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.URLError as exc:
        raise RetryableError(f"the carrier did not answer: {exc.reason}") from exc


@tool(effectful=True, compensate="unship")
def ship(url: str, order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Ship an order through an outside carrier; the carrier dedupes on the idempotency key."""
    hook(ctx, "before_post")  # a test may fail the call before it leaves (the carrier never sees it)
    answer = _post(f"{url}/ship", {"order_id": order_id}, idempotency_key)
    hook(ctx, "after_ship")  # the call landed; a test may lose its answer here (a crash, a reset connection)
    return answer


@tool(effectful=True)
def unship(url: str, order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Call a shipment back at the carrier."""
    return _post(f"{url}/unship", {"order_id": order_id}, idempotency_key)


def _ship(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, "before_ship")
    return ctx.call_tool(ship, {"url": ctx.input["url"], "order_id": ctx.input["order_id"]})


workflow("ship_then_hold", steps=[call("ship", _ship), call("hold", _record_step), call("after", _record_step)])
workflow("ship_then_break", steps=[call("ship", _ship), call("broken", _permanent)], on_failure="compensate")


# --- Forks at a failed effect step ---------------------------------------------------------------------------


@tool(effectful=True, transactional=True)
def fragile_charge(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
    """Charge an order; the ledger refuses while FRAGILE["refuse"] is set."""
    if FRAGILE["refuse"]:
        raise ValueError("the ledger refused the charge")
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=amount, kind="charge")
    return {"charged": str(amount)}


def _fragile(ctx: StepContext) -> dict[str, Any]:
    return ctx.call_tool(fragile_charge, {"order_id": ctx.input["order_id"], "amount": "15.00"})


workflow("fragile", steps=[call("load", _record_step), call("charge", _fragile)])


# --- A judge redo: the writer charges again, with another amount ---------------------------------------------


def _writer_script(request: Any) -> Any:
    amount = "20.00" if "too small" in json.dumps(request.messages[0]) else "10.00"
    if request.turn == 0:
        return [tool_use("charge", {"order_id": "J-1", "amount": amount})]  # no id: the participant derives one
    return f"charged {amount}"


def _verdict(request: Any) -> Any:
    passed = "20.00" in json.dumps(request.messages)
    reasons = "fine" if passed else "too small"
    return [tool_use("submit_verdict", {"passed": passed, "score": 1.0 if passed else 0.0, "reasons": reasons})]


workflow(
    "redo_charge",
    steps=[
        agent(
            "writer",
            instructions="Charge the order.",
            tools=[charge],
            prompt=lambda ctx: f"Charge order J-1. Reviewer: {ctx.feedback() or 'none yet'}",
            participant=FunctionParticipant(_writer_script, name="writer-script"),
        ),
        judge(
            "review",
            rubric="The charge is 20.00.",
            subject=lambda ctx: ctx.result("writer")["text"],
            on_fail="redo",
            redo_step="writer",
            participant=FunctionParticipant(_verdict, name="judge-script"),
        ),
    ],
)


# --- A throttled service: its first answer asks to retry after `retry_after` seconds ------------------------


def _throttled(ctx: StepContext) -> dict[str, Any]:
    if record_execution(ctx) == 1:
        raise ModelUnavailableError("429 rate limited", retry_after=float(ctx.input["retry_after"]), status=429)
    return {"served": True}


workflow("throttled", steps=[call("ask", _throttled)])


# --- An agent whose read-only tool is in flight when another worker takes the run over ---------------------


@tool
def peek(order_id: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Look at an order without changing it."""
    hook(ctx, "in_peek")
    return {"order_id": order_id, "status": "paid"}


def _peeker_script(request: Any) -> Any:
    return [tool_use("peek", {"order_id": "P-1"})] if request.turn == 0 else "it is paid"


workflow(
    "peeker",
    steps=[
        agent(
            "assistant",
            instructions="Look the order up.",
            tools=[peek],
            participant=FunctionParticipant(_peeker_script, name="peeker-script"),
        )
    ],
)


# --- Keys longer than their column: a 200-character step id and a 64-character tool name -------------------

LONG_TOOL = "c" * 64
LONG_STEP = "s" * 200


@tool(effectful=True, transactional=True, name=LONG_TOOL)
def long_named_charge(order_id: str, *, idempotency_key: str) -> dict[str, Any]:
    """Charge an order under a long tool name."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=1, kind="charge")
    return {"key_length": len(idempotency_key)}


workflow(
    "long_keys",
    steps=[call("work", lambda ctx: ctx.call_tool(long_named_charge, {"order_id": "L-1"}))],
    plan=lambda inp: [PlannedStep(LONG_STEP, "work")],
)

__all__ = ["AMOUNTS", "FRAGILE", "HOOKS", "LONG_STEP", "LONG_TOOL", "charge", "text"]
