"""Planner steps: the model proposes a plan through a structured tool; it is validated, then stored as rows.

The plan is a list of tool calls (tool + arguments, optional freshness budget, optional human approval),
checked against the workflow's allowed tools and their schemas. An invalid plan goes back to the model as
an is_error tool result (bounded attempts), never into the table; on models that refuse forced tool use the
plan is asked for as agents/structured.py describes. Each planned step then runs one per
task like any static step. A planned effect's key is derived from its tool and canonical arguments, so a
re-plan that proposes the same refund again reuses the applied one instead of refunding twice.

Example::

    planner("plan", instructions="Plan the refund.", tools=[lookup_order, issue_refund, email_customer])
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.agents.capabilities import ModelChoice, check_choice, thinking_param
from durable_agents.agents.participants import participants
from durable_agents.agents.structured import Form, ask_for_call
from durable_agents.conf import settings
from durable_agents.engine.control import ExtendPlan
from durable_agents.engine.planned import PlannedCall, planned_rows
from durable_agents.errors import DefinitionError, ToolArgumentsError
from durable_agents.models import StepKind
from durable_agents.tools import Tool
from durable_agents.workflows import Batch, StepDef, delivery_param

PLAN_TOOL = "submit_plan"


def _plan_tool(tools: Sequence[Tool[..., Any]]) -> dict[str, Any]:
    return {
        "name": PLAN_TOOL,
        "description": "Submit the plan: the tool calls to make, in order. Only these tools may be used: "
        + "; ".join(f"{t.name}: {t.description.splitlines()[0]}" for t in tools),
        "input_schema": {
            "type": "object",
            "properties": {
                "steps": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "tool": {"type": "string", "enum": [t.name for t in tools]},
                            "args": {"type": "object"},
                            "fresh_for_seconds": {"type": "integer", "minimum": 1},
                            "approval": {"type": "boolean", "description": "ask a human before this step"},
                        },
                        "required": ["tool", "args"],
                    },
                }
            },
            "required": ["steps"],
        },
    }


def planner(
    name: str,
    *,
    instructions: str,
    tools: Sequence[Tool[..., Any]],
    prompt: Callable[[Any], Any] | None = None,
    participant: str | None = None,
    model: str | None = None,
    max_tokens: int = 8192,
    max_attempts: int = 3,
    thinking: str | dict[str, Any] | None = None,
    effort: str | None = None,
    delivery: Batch | str | None = None,
) -> StepDef:
    """A planner step: the model submits a plan of calls to `tools`; valid plans become plan rows.

    `max_attempts` bounds the asks for a valid plan; `thinking`, `effort`, `max_tokens` and `delivery` as for
    `agent()`.
    """
    if not tools:
        raise DefinitionError(f"planner {name!r}: give the tools a plan may use")
    if max_attempts < 1:
        raise DefinitionError(f"planner {name!r}: max_attempts must be at least 1")
    allowed = {t.name: t for t in tools}
    plan_tool = _plan_tool(tools)
    choice = ModelChoice(model, thinking_param(thinking), effort, max_tokens)
    check_choice(f"planner {name!r}", choice)
    delivery = delivery_param(delivery, f"planner {name!r}")

    def read(data: dict[str, Any]) -> tuple[list[PlannedCall] | None, str | None]:
        calls, errors = _read_plan(name, data, allowed)
        return (None, "The plan was refused: " + "; ".join(errors)) if errors else (calls, None)

    def run(ctx: Any) -> Any:
        chosen = ctx.run.participant or participant or settings.DEFAULT_PARTICIPANT
        answerer = participants.get(chosen)
        first = prompt(ctx) if prompt else json.dumps(ctx.input, cls=DjangoJSONEncoder)
        form = Form(
            "planner", plan_tool, instructions, first, choice, read, max_attempts, answer="plan", delivery=delivery
        )
        calls, _turn = ask_for_call(ctx, answerer, form)
        result = {"plan": [{"tool": c.tool, "args": c.args, "step_id": c.step_id} for c in calls]}
        raise ExtendPlan(planned_rows(calls), result)

    options = {"tools": tuple(allowed), "participant": participant, "model_choice": choice}
    return StepDef(name=name, kind=StepKind.PLANNER, fn=run, options=options)


def _read_plan(
    name: str, data: dict[str, Any], allowed: dict[str, Tool[..., Any]]
) -> tuple[list[PlannedCall], list[str]]:
    steps = data.get("steps")
    if not isinstance(steps, list) or not steps:
        return [], ["the plan needs at least one step"]
    calls, errors = [], []
    for i, element in enumerate(steps, start=1):
        tool = allowed.get(element.get("tool")) if isinstance(element, dict) else None
        if tool is None:
            errors.append(
                f"step {i}: unknown tool {element.get('tool') if isinstance(element, dict) else element!r}"
                f"; allowed: {', '.join(allowed)}"
            )
            continue
        try:
            args = tool.validate(element.get("args") or {})
        except ToolArgumentsError as exc:
            errors.append(f"step {i}: {exc}")
            continue
        seconds = element.get("fresh_for_seconds")
        calls.append(
            PlannedCall(
                step_id=f"{name}.{i}.{tool.name}",
                tool=tool.name,
                args=args,
                fresh_for=timedelta(seconds=seconds) if isinstance(seconds, int) and seconds > 0 else tool.fresh_for,
                approval=bool(element.get("approval")),
            )
        )
    return calls, errors
