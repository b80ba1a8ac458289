"""Planned tool calls: how the plan rows a planner step adds are built and executed.

A planner (above the engine) validates a model-made plan into `PlannedCall`s and raises `ExtendPlan`
with `planned_rows(calls)`; each row then runs one per task like any step. A planned effect's key is
derived from its tool and canonical arguments (and its occurrence in the plan), not its position, so a
re-plan that proposes the same refund again reuses the applied one instead of refunding twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.engine.approvals import require_approval
from durable_agents.engine.control import PlannedRow
from durable_agents.models import StepKind
from durable_agents.tools import Tool
from durable_agents.workflows import StepDef

TOOL_STEP_PREFIX = "tool:"


@dataclass(frozen=True)
class PlannedCall:
    """One validated element of a model-made plan."""

    step_id: str
    tool: str
    args: dict[str, Any]
    fresh_for: timedelta | None
    approval: bool


def planned_rows(calls: list[PlannedCall]) -> list[PlannedRow]:
    """Plan rows for validated calls; the n-th identical call of a plan is its own effect (occurrence n)."""
    seen: dict[tuple[str, str], int] = {}
    rows = []
    for call in calls:
        same = (call.tool, json.dumps(call.args, sort_keys=True, cls=DjangoJSONEncoder))
        seen[same] = seen.get(same, 0) + 1
        args = {"args": call.args, "approval": call.approval, "occurrence": seen[same]}
        rows.append(PlannedRow(call.step_id, f"{TOOL_STEP_PREFIX}{call.tool}", args, call.fresh_for))
    return rows


def is_planned(name: str) -> bool:
    return name.startswith(TOOL_STEP_PREFIX)


def planned_step(tool: Tool[..., Any]) -> StepDef:
    """How a planned call executes: its tool, keyed by tool and canonical arguments, approved if asked."""

    def run(ctx: Any) -> Any:
        args = ctx.args.get("args", {})
        # Keyed by tool and canonical arguments, not by position: a re-plan proposing it again reuses it.
        digest = tool.args_hash(tool.validate(args))[:32]
        key = f"{ctx.run.effect_scope or ctx.run_id}:plan:{tool.name}:{digest}:{ctx.args.get('occurrence', 1)}"
        if ctx.args.get("approval") and tool.effectful:
            require_approval(ctx, tool, args, key, always=True)
        return ctx.call_tool(tool, args, key=key)

    return StepDef(name=f"{TOOL_STEP_PREFIX}{tool.name}", kind=StepKind.TOOL, fn=run)
