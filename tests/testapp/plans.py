"""Test workflows for plans that stay true: freshness budgets, judges, forks (imported by workflows.py)."""

from __future__ import annotations

import time
from datetime import timedelta
from decimal import Decimal
from typing import Any

from durable_agents.agents.participants import FunctionParticipant, ModelRequest, tool_use
from durable_agents.api import (
    StepContext,
    approval,
    call,
    judge,
    participants,
    planner,
    tool,
    tool_step,
    workflow,
)
from tests.testapp.models import LedgerEntry
from tests.testapp.workflows import _record_step, charge, lookup_order, record_execution


def _observe(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    return {"balance": "100.00", "seen": ctx.now().isoformat()}


workflow(
    "fresh_refund",
    steps=[
        call("observe", _observe, fresh_for=timedelta(minutes=10)),
        tool_step("refund", charge, lambda ctx: {"order_id": "F-1", "amount": "25.00"}, depends_on=["observe"]),
        call("notify", _record_step, depends_on=["observe"]),
    ],
)


def _draft(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    feedback = ctx.feedback()
    return {
        "text": "Your refund is on its way." + (" Sorry for the trouble." if feedback else ""),
        "feedback": feedback,
    }


def reviewer(request: ModelRequest) -> list[dict[str, Any]]:
    """The scripted judge: an email passes only if it apologises."""
    subject = request.messages[-1]["content"]
    passed = "Sorry" in subject
    reasons = "Apologises and states the refund." if passed else "The customer waited a week: apologise."
    return [tool_use("submit_verdict", {"passed": passed, "score": 0.9 if passed else 0.2, "reasons": reasons})]


participants.register("reviewer", FunctionParticipant(reviewer, name="reviewer"))

for _route in ("fail", "redo", "ask_human"):
    workflow(
        f"judged_{_route}",
        steps=[
            call("draft", _draft),
            judge(
                "review",
                rubric="The email apologises for the delay and states the refund.",
                subject=lambda ctx: ctx.result("draft")["text"],
                on_fail=_route,
                redo_step="draft" if _route == "redo" else None,
                participant="reviewer",
            ),
            call("after", _record_step),
        ],
    )


# --- Planner: a model-made plan, refused twice before a valid one ------------------------------------------


def plan_maker(request: ModelRequest) -> list[dict[str, Any]]:
    """Proposes an unknown tool, then bad arguments, then a valid plan: each refusal is sent back."""
    attempt = request.turn
    if attempt == 0:
        steps = [{"tool": "wire_money", "args": {"to": "me"}}]
    elif attempt == 1:
        steps = [{"tool": "charge", "args": {"order_id": "PL-1", "amount": "lots"}}]
    else:
        steps = [
            {"tool": "lookup_order", "args": {"order_id": "PL-1"}, "fresh_for_seconds": 600},
            {"tool": "charge", "args": {"order_id": "PL-1", "amount": "12.00"}},
        ]
    return [tool_use("submit_plan", {"steps": steps})]


participants.register("plan-maker", FunctionParticipant(plan_maker, name="plan-maker"))
participants.register(
    "bad-planner",
    FunctionParticipant(lambda request: [tool_use("submit_plan", {"steps": [{"tool": "nope", "args": {}}]})]),
)

for _name, _participant in (("planned", "plan-maker"), ("badly_planned", "bad-planner")):
    workflow(
        _name,
        steps=[
            call("observe", _observe, fresh_for=timedelta(minutes=10)),
            planner(
                "plan",
                instructions="Plan how to charge the order.",
                tools=[lookup_order, charge],
                participant=_participant,
            ),
            call("after", _record_step, depends_on=["observe"]),
        ],
    )


# --- A brief written by the participant ---------------------------------------------------------------------

participants.register(
    "brief-writer",
    FunctionParticipant(lambda request: "Charging 40.00 settles the customer's open invoice.", name="brief-writer"),
)
workflow("approve_briefed", steps=[approval("approve", question="Charge 40.00?", brief="participant")])


@tool(effectful=True, transactional=True)
def slow_charge(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
    """Charge an order, slowly: holds its effect's row lock for a second (for concurrency tests)."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=amount, kind="charge")
    time.sleep(1.0)
    return {"charged": str(amount)}


participants.register(
    "double-planner",
    FunctionParticipant(
        lambda request: [
            tool_use("submit_plan", {"steps": [{"tool": "charge", "args": {"order_id": "DB-1", "amount": "5.00"}}] * 2})
        ],
        name="double-planner",
    ),
)
workflow(
    "double_planned",
    steps=[planner("plan", instructions="Charge twice.", tools=[charge], participant="double-planner")],
)
