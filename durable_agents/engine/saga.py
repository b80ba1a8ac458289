"""Sagas: a cancelled (or, by the workflow's policy, failed) run undoes its effects, newest first.

`transitions.compensate_txn` plans one compensation step per effect to undo — applied effects, and
external effects invoked with no recorded outcome — and skips the rest of the plan. Compensation steps run
one per task like any step (leases, retries, crash recovery); each invokes the effect's compensating tool as
an idempotent effect keyed `<original key>:compensate`, so a crash mid-compensation never undoes anything
twice. An effect whose outcome is unknown is first learned by invoking it again under its own key (the
receiver dedupes: it answers with what it did); if that cannot tell, the saga stops with the effect
flagged `needs_attention` and the run failed, saying what is left to undo — never finished as if nothing
happened. Once an operator records the outcome (`durable_effect`), resuming the run continues the saga.
"""

from __future__ import annotations

import logging
from typing import Any

from durable_agents.engine.effects import invoke_tool
from durable_agents.engine.events import record_event
from durable_agents.engine.reliance import standing_on
from durable_agents.engine.transitions import COMPENSATE_STEP
from durable_agents.errors import (
    EffectOutcomeUnknownError,
    LeaseLostError,
    PermanentError,
    RetryableError,
    ToolFailedError,
)
from durable_agents.models import Effect, EffectStatus, StepKind
from durable_agents.storable import storable_text
from durable_agents.tools import tools
from durable_agents.workflows import StepDef

logger = logging.getLogger("durable_agents.saga")


def compensation_key(effect_key: str) -> str:
    return f"{effect_key}:compensate"


def _compensate(ctx: Any) -> dict[str, Any]:
    original = Effect.objects.get(idempotency_key=ctx.args["effect"])
    key = original.idempotency_key
    if original.status == EffectStatus.COMPENSATED:
        return {"compensated": key}
    # Checked again now: a run may have come to rely on it since the saga was planned (a fork).
    standing = standing_on(original, but=ctx.run_id)
    if standing:
        record_event(ctx.run_id, "compensation_kept", step_id=ctx.step_id, effects={key: standing})
        return {"kept": key, "for": standing}
    if original.status == EffectStatus.PENDING:
        _learn_outcome(ctx, original)
        original.refresh_from_db()
    if original.status == EffectStatus.FAILED:
        return {"skipped": key, "reason": "it was not applied"}
    if original.status != EffectStatus.APPLIED:
        raise PermanentError(f"effect {key} is {original.status}; only applied effects are compensated")
    compensator = tools.compensator_of(tools.get(original.tool))
    result = invoke_tool(
        compensator,
        original.args,
        key=compensation_key(key),
        run_id=ctx.run_id,
        step_pk=ctx.step.pk,
        ctx=ctx,
        compensates=original,
        lease_token=ctx.lease_token,
    )
    return {"compensated": key, "by": compensator.name, "result": result}


def _learn_outcome(ctx: Any, original: Effect) -> None:
    """An external call whose outcome is unknown: invoke it again under its own key, so the receiver says
    what it did (applied: we then undo it; refused: nothing to undo). If it cannot say, stop for a human."""
    tool = tools.get(original.tool)
    try:
        invoke_tool(tool, original.args, key=original.idempotency_key, run_id=ctx.run_id, step_pk=None, ctx=ctx)
    except ToolFailedError:
        return  # the receiver refused it: it changed nothing (the effect is now failed), nothing to undo
    except (RetryableError, EffectOutcomeUnknownError, LeaseLostError):
        raise  # retried; or already flagged for an operator; or a zombie, which writes nothing
    except Exception as exc:
        reason = (
            f"compensation could not learn whether {tool.name} under key {original.idempotency_key!r} was applied "
            f"({type(exc).__name__}: {storable_text(str(exc))}); check the receiving system, record the outcome with "
            f"`manage.py durable_effect {original.idempotency_key} --applied` or `--failed`, then resume run "
            f"{ctx.run_id} to finish the compensation"
        )
        Effect.objects.filter(pk=original.pk).update(needs_attention=reason[:2000])
        raise EffectOutcomeUnknownError(reason) from exc


COMPENSATION = StepDef(name=COMPENSATE_STEP, kind=StepKind.COMPENSATE, fn=_compensate)

__all__ = ["COMPENSATION", "compensation_key"]
