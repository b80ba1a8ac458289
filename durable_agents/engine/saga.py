"""Sagas: undo a run's applied effects in reverse order, as ordinary durable steps appended to its plan.

Compensation steps run one per task like any step (leases, retries, crash recovery); each invokes the
effect's compensating tool as an idempotent effect keyed `<original key>:compensate`, so a crash
mid-compensation never undoes anything twice. The run then ends as `finish_as` (cancelled or failed).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.db.models import F

from durable_agents.engine.effects import invoke_tool
from durable_agents.engine.events import record_event
from durable_agents.errors import PermanentError, UnknownToolError
from durable_agents.models import Effect, EffectKind, EffectStatus, Run, Step, StepKind, StepStatus
from durable_agents.tools import tools
from durable_agents.workflows import StepDef

logger = logging.getLogger("durable_agents.saga")

COMPENSATE_STEP = "compensate"


def compensation_key(effect_key: str) -> str:
    return f"{effect_key}:compensate"


def plan_compensation_txn(run_id: Any, *, finish_as: str, now: datetime, fields: dict[str, Any]) -> int:
    """Skip the run's remaining steps and append one compensation step per applied, compensable effect.

    Must run inside the transaction that releases the run; `fields` are the run's other changes.
    Returns how many compensation steps were planned (0: nothing to undo, nothing changed).
    """
    run = Run.objects.select_for_update().only("id", "cursor", "step_count").get(pk=run_id)
    applied = Effect.objects.filter(run_id=run_id, kind=EffectKind.EFFECT, status=EffectStatus.APPLIED).order_by(
        "-applied_at", "-id"
    )
    keys = [effect.idempotency_key for effect in applied if _compensator_name(effect.tool)]
    if not keys:
        return 0
    Step.objects.live().filter(run_id=run_id, position__gte=run.cursor, status=StepStatus.PENDING).update(
        status=StepStatus.SKIPPED, updated_at=now
    )
    base = run.step_count
    Step.objects.bulk_create(
        Step(
            run_id=run_id,
            step_id=f"compensate-{i}",
            name=COMPENSATE_STEP,
            kind=StepKind.COMPENSATE,
            position=base + i - 1,
            args={"effect": key},
        )
        for i, key in enumerate(keys, start=1)
    )
    Run.objects.filter(pk=run_id).update(
        cursor=base,
        step_count=F("step_count") + len(keys),
        finish_as=finish_as,
        attempt=0,
        updated_at=now,
        **fields,
    )
    record_event(run_id, "compensation_planned", finish_as=finish_as, effects=keys)
    return len(keys)


def _compensator_name(tool_name: str) -> str | None:
    try:
        return tools.get(tool_name).compensate
    except UnknownToolError:
        logger.warning("effect of unknown tool %s cannot be compensated", tool_name)
        return None


def _compensate(ctx: Any) -> dict[str, Any]:
    original = Effect.objects.get(idempotency_key=ctx.args["effect"])
    if original.status == EffectStatus.COMPENSATED:
        return {"compensated": original.idempotency_key}
    if original.status != EffectStatus.APPLIED:
        raise PermanentError(f"effect {original.idempotency_key} is {original.status}; only applied effects compensate")
    tool = tools.get(original.tool)
    compensator = tools.compensator_of(tool)
    result = invoke_tool(
        compensator,
        original.args,
        key=compensation_key(original.idempotency_key),
        run_id=ctx.run_id,
        step_pk=ctx.step.pk,
        ctx=ctx,
        compensates=original,
        lease_token=ctx.lease_token,
    )
    return {"compensated": original.idempotency_key, "by": compensator.name, "result": result}


COMPENSATION = StepDef(name=COMPENSATE_STEP, kind=StepKind.COMPENSATE, fn=_compensate)

__all__ = ["COMPENSATION", "compensation_key", "plan_compensation_txn"]
