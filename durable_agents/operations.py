"""What operators can ask and do, shared by the management commands and the admin: list, show, sweep."""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

from django.db.models import QuerySet

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.plans import version_drift as drifted_runs
from durable_agents.engine.runs import get_run
from durable_agents.errors import InvalidInputError
from durable_agents.models import Effect, EffectStatus, Run, RunStatus, Step

DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
DURATION_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str) -> timedelta:
    """'90s', '30m', '2h', '3d', '1w' → timedelta; anything else is a clear InvalidInputError."""
    match = DURATION_RE.match(text or "")
    if not match:
        raise InvalidInputError(f"invalid duration {text!r}: use a number and a unit, e.g. 90s, 30m, 2h, 3d, 1w")
    return timedelta(**{DURATION_UNITS[match.group(2)]: float(match.group(1))})


def list_runs(
    *,
    status: str | None = None,
    workflow: str | None = None,
    stuck: bool = False,
    older_than: timedelta | None = None,
    version_drift: bool = False,
    limit: int = 100,
) -> QuerySet[Run]:
    """Runs, newest first, filtered as an operator asks."""
    runs = drifted_runs() if version_drift else Run.objects.all()
    if status:
        if status not in RunStatus.values:
            raise InvalidInputError(f"unknown status {status!r}; choose from {', '.join(RunStatus.values)}")
        runs = runs.filter(status=status)
    if workflow:
        runs = runs.filter(workflow=workflow)
    now = clock.now()
    if stuck:
        runs = runs.stuck(now=now, stuck_after=timedelta(seconds=float(settings.STUCK_AFTER_SECONDS)))
    if older_than is not None:
        runs = runs.filter(created_at__lt=now - older_than)
    return runs.order_by("-created_at")[:limit]


def run_summary(run: Run) -> dict[str, Any]:
    return {
        "id": str(run.id),
        "workflow": run.workflow,
        "version": run.workflow_version,
        "status": run.status,
        "cursor": run.cursor,
        "steps": run.step_count,
        "idempotency_key": run.idempotency_key,
        "created_at": _iso(run.created_at),
        "updated_at": _iso(run.updated_at),
        "finished_at": _iso(run.finished_at),
        "error": run.error,
    }


def describe_run(run_id: uuid.UUID | str, *, events: int = 200) -> dict[str, Any]:
    """Everything an operator needs about one run: the row, its live and superseded steps, its history."""
    run = get_run(run_id)
    steps = Step.objects.filter(run=run).order_by("position", "id")
    history = list(run.events.order_by("-id")[:events])[::-1]
    return {
        **run_summary(run),
        "input": run.input,
        "output": run.output,
        "lease": {
            "owner": run.lease_owner,
            "token": run.lease_token,
            "expires_at": _iso(run.lease_expires_at),
        },
        "attempt": run.attempt,
        "cancel_requested_at": _iso(run.cancel_requested_at),
        "usage": {
            "input_tokens": run.input_tokens,
            "output_tokens": run.output_tokens,
            "cache_write_tokens": run.cache_write_tokens,
            "cache_read_tokens": run.cache_read_tokens,
            "cost_usd": str(run.cost_usd),
            "token_budget": run.token_budget,
            "cost_budget_usd": str(run.cost_budget_usd) if run.cost_budget_usd is not None else None,
        },
        "step_rows": [
            {
                "step_id": s.step_id,
                "name": s.name,
                "kind": s.kind,
                "position": s.position,
                "status": s.status,
                "attempts": s.attempts,
                "started_at": _iso(s.started_at),
                "finished_at": _iso(s.finished_at),
                "duration_ms": _ms(s),
                "error": s.error,
                "result_ref": s.result_ref,
                "tokens": {
                    "input": s.input_tokens,
                    "output": s.output_tokens,
                    "cache_write": s.cache_write_tokens,
                    "cache_read": s.cache_read_tokens,
                },
                "cost_usd": str(s.cost_usd),
            }
            for s in steps
        ],
        "finish_as": run.finish_as,
        "effects": [
            {
                "key": e.idempotency_key,
                "tool": e.tool,
                "kind": e.kind,
                "status": e.status,
                "attempts": e.attempts,
                "step_id": e.step.step_id if e.step else None,
                "compensates": e.compensates.idempotency_key if e.compensates else None,
                "applied_at": _iso(e.applied_at),
                "next_attempt_at": _iso(e.next_attempt_at),
                "error": e.error,
                "needs_attention": e.needs_attention,
                "skipped": skip_reason(e),
            }
            for e in run.effects.select_related("step", "compensates").order_by("id")
        ],
        "waits": [
            {
                "id": w.pk,
                "kind": w.kind,
                "name": w.name,
                "status": w.status,
                "question": w.question,
                "brief": w.brief,
                "deadline": _iso(w.deadline),
                "reminders_sent": w.reminders_sent,
                "decided_by": w.decided_by,
                "decided_at": _iso(w.decided_at),
                "decision": w.decision,
            }
            for w in run.waits.order_by("id")
        ],
        "events": [
            {
                "at": _iso(e.created_at),
                "kind": e.kind,
                "step_id": e.step_id,
                "actor": e.actor,
                "detail": e.detail,
            }
            for e in history
        ],
    }


def skip_reason(effect: Effect) -> str | None:
    """Why a `skipped` notification was not sent ("no recipients", "wait 7 is already approved"), else None."""
    if effect.status != EffectStatus.SKIPPED:
        return None
    return (effect.result or {}).get("skipped") if isinstance(effect.result, dict) else None


def _iso(value: Any) -> str | None:
    return value.isoformat() if value else None


def _ms(step: Step) -> float | None:
    if step.started_at and step.finished_at:
        return round((step.finished_at - step.started_at).total_seconds() * 1000, 3)
    return None
