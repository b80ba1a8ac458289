"""Run-level transitions: start, cancel, resume and rerun-from-step. Each is a compare-and-set UPDATE.

Transitions that take a run away from whoever holds it bump the lease token, so a worker still
executing a step of that run commits nothing.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce

from durable_agents import clock
from durable_agents.engine.events import record_event
from durable_agents.engine.payloads import check_input
from durable_agents.engine.saga import plan_compensation_txn
from durable_agents.engine.waits import cancel_open_waits_txn
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import (
    IdempotencyKeyReusedError,
    InvalidInputError,
    InvalidTransitionError,
    RunNotFoundError,
    StepNotFoundError,
)
from durable_agents.models import ACTIVE_RUN_STATUSES, Run, RunStatus, Step, StepStatus
from durable_agents.signals import run_finished, send_on_commit
from durable_agents.storable import decimal_amount, whole_number
from durable_agents.workflows import PlannedStep, Workflow, registry

IDEMPOTENCY_CONSTRAINT = "durable_run_idempotency_key_uniq"
COST_COLUMN = {"max_digits": 14, "decimal_places": 6}  # Run.cost_budget_usd


def get_run(run_id: uuid.UUID | str) -> Run:
    """The run with that id, or RunNotFoundError (also for strings that are not UUIDs)."""
    try:
        return Run.objects.get(pk=run_id)
    except (Run.DoesNotExist, ValidationError, ValueError):
        raise RunNotFoundError(f"no run has id {run_id!r}; list runs with `manage.py durable_runs`") from None


def _lease_is_free(now: Any) -> Q:
    return Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)


def start_run(
    workflow: str,
    run_input: Any = None,
    *,
    idempotency_key: str | None = None,
    version: int | None = None,
) -> Run:
    """Create a run and its plan rows in one transaction; a worker is woken once it commits."""
    run_input = {} if run_input is None else run_input
    definition = registry.get(workflow, version)
    input_hash = check_input(run_input)
    if idempotency_key is not None:
        if not isinstance(idempotency_key, str) or not idempotency_key.strip() or len(idempotency_key) > 255:
            raise InvalidInputError("idempotency key must be a non-empty string of at most 255 characters")
        existing = Run.objects.filter(idempotency_key=idempotency_key).first()
        if existing is not None:
            return _same_run_or_error(existing, definition.name, input_hash)
    plan = definition.build_plan(run_input)
    now = clock.now()
    run = Run(
        workflow=definition.name,
        workflow_version=definition.version,
        input=run_input,
        input_hash=input_hash,
        idempotency_key=idempotency_key,
        step_count=len(plan),
        created_at=now,
        updated_at=now,
    )
    try:
        with transaction.atomic():
            run.save(force_insert=True)
            Step.objects.bulk_create(
                plan_row(run.id, definition, element, position) for position, element in enumerate(plan)
            )
            wake_on_commit(run.id)
    except IntegrityError as exc:
        # Two starts with one key raced; the loser returns the winner's run (or the reuse error).
        existing = Run.objects.filter(idempotency_key=idempotency_key).first() if idempotency_key else None
        if existing is None:
            raise
        return _same_run_or_error(existing, definition.name, input_hash, cause=exc)
    return run


def plan_row(run_id: Any, definition: Workflow, element: PlannedStep, position: int) -> Step:
    """A Step row for one plan element, carrying its definition's freshness budget and dependencies."""
    step_def = definition.definition(element.name)
    return Step(
        run_id=run_id,
        step_id=element.step_id,
        name=element.name,
        kind=step_def.kind,
        position=position,
        args=dict(element.args),
        fresh_for=step_def.fresh_for,
        depends_on=list(step_def.depends_on),
    )


def _same_run_or_error(existing: Run, workflow: str, input_hash: str, cause: Exception | None = None) -> Run:
    if existing.workflow != workflow or existing.input_hash != input_hash:
        raise IdempotencyKeyReusedError(
            f"idempotency key {existing.idempotency_key!r} was used for run {existing.id} "
            f"({existing.workflow}) with a different input; use a new key for a new run"
        ) from cause
    return existing


def cancel_run(run_id: uuid.UUID | str, *, reason: str = "", actor: str = "", compensate: bool = False) -> Run:
    """Cancel a run. A run no worker holds stops now; a running step finishes first, then the run stops.

    With `compensate`, the run first undoes its applied effects, newest first, then ends `cancelled`.
    """
    run = get_run(run_id)
    now = clock.now()
    if run.is_finished:
        raise InvalidTransitionError(f"run {run.id} is already {run.status}; there is nothing to cancel")
    with transaction.atomic():
        if _take_txn(Q(pk=run.id, status__in=ACTIVE_RUN_STATUSES), now, cancel_reason=reason):
            _stop_txn(run.id, now, compensate=compensate, actor=actor, reason=reason)
        else:
            requested = Run.objects.filter(
                pk=run.id, status__in=ACTIVE_RUN_STATUSES, cancel_requested_at__isnull=True
            ).update(cancel_requested_at=now, cancel_reason=reason, cancel_compensate=compensate)
            if not requested and not Run.objects.filter(pk=run.id, status__in=ACTIVE_RUN_STATUSES).exists():
                run.refresh_from_db()
                raise InvalidTransitionError(f"run {run.id} is already {run.status}; there is nothing to cancel")
            record_event(
                run.id, "cancel_requested", actor=actor, reason=reason, holder=run.lease_owner, compensate=compensate
            )
    run.refresh_from_db()
    return run


def settle_cancellation(run_id: uuid.UUID | str) -> bool:
    """Finish a requested cancellation once no worker holds the run; True if it stopped (or compensates) now."""
    now = clock.now()
    with transaction.atomic():
        taken = _take_txn(Q(pk=run_id, status__in=ACTIVE_RUN_STATUSES, cancel_requested_at__isnull=False), now)
        if taken:
            compensate = Run.objects.filter(pk=run_id, cancel_compensate=True).exists()
            _stop_txn(run_id, now, compensate=compensate, reason="cancel requested while a step ran")
    return bool(taken)


def _take_txn(condition: Q, now: Any, **changes: Any) -> bool:
    """Take a run no worker holds: bump the token (fencing any zombie) and release the lease."""
    return bool(
        Run.objects.filter(_lease_is_free(now), condition).update(
            lease_token=F("lease_token") + 1,
            lease_owner="",
            lease_expires_at=None,
            wake_at=None,
            updated_at=now,
            **changes,
        )
    )


def _stop_txn(run_id: Any, now: Any, *, compensate: bool, reason: str, actor: str = "") -> None:
    """Cancel a taken run, or turn it into a compensating run that ends cancelled."""
    cancel_open_waits_txn(run_id)
    step_id = _current_step_id(Run.objects.only("id", "cursor").get(pk=run_id))
    already_compensating = Run.objects.filter(pk=run_id).exclude(finish_as="").exists()
    fields = {"status": RunStatus.PENDING, "cancel_requested_at": None, "cancel_compensate": False}
    if (
        compensate
        and not already_compensating
        and plan_compensation_txn(run_id, finish_as=RunStatus.CANCELLED, now=now, fields=fields)
    ):
        record_event(run_id, "cancel_compensating", step_id=step_id, actor=actor, reason=reason)
        wake_on_commit(run_id)
        return
    Run.objects.filter(pk=run_id).update(
        status=RunStatus.CANCELLED, finished_at=now, cancel_requested_at=Coalesce("cancel_requested_at", Value(now))
    )
    record_event(run_id, "cancelled", step_id=step_id, actor=actor, reason=reason)
    send_on_commit(run_finished, run_id=run_id, status=RunStatus.CANCELLED, error=None)


def resume_run(run_id: uuid.UUID | str, *, from_step: str | None = None, actor: str = "") -> Run:
    """Resume a failed or cancelled run at its current step, re-wake a runnable one, or rerun from a step."""
    run = get_run(run_id)
    if from_step is not None:
        return _rerun_from_step(run, from_step, actor=actor)
    now = clock.now()
    if run.status in (RunStatus.PENDING, RunStatus.RUNNING):
        record_event(run.id, "woken", actor=actor, reason="resume of a runnable run")
        with transaction.atomic():
            wake_on_commit(run.id)
        return run
    if run.status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        hint = "pass --from-step to run again from a step" if run.status == RunStatus.COMPLETED else "decide its wait"
        raise InvalidTransitionError(f"run {run.id} is {run.status}; only failed or cancelled runs resume ({hint})")
    with transaction.atomic():
        resumed = Run.objects.filter(pk=run.id, status=run.status).update(**_restarted(now))
        if not resumed:
            raise InvalidTransitionError(f"run {run.id} changed while resuming; look at it again and retry")
        Step.objects.filter(run_id=run.id, position=run.cursor, status=StepStatus.FAILED).update(
            status=StepStatus.PENDING, error=None, attempts=0, next_attempt_at=None
        )
        record_event(run.id, "resumed", step_id=_current_step_id(run), actor=actor, previous_status=run.status)
        wake_on_commit(run.id)
    run.refresh_from_db()
    return run


def _restarted(now: Any) -> dict[str, Any]:
    """A run made runnable again by an operator: errors and cancellation cleared, any holder fenced off."""
    return {
        "status": RunStatus.PENDING,
        "error": None,
        "finished_at": None,
        "cancel_requested_at": None,
        "cancel_reason": "",
        "attempt": 0,
        "wake_at": None,
        "updated_at": now,
        "lease_token": F("lease_token") + 1,
        "lease_owner": "",
        "lease_expires_at": None,
    }


def _rerun_from_step(run: Run, step_id: str, *, actor: str) -> Run:
    now = clock.now()
    target = Step.objects.live().filter(run_id=run.id, step_id=step_id).first()
    if target is None:
        raise StepNotFoundError(f"run {run.id} has no step {step_id!r}; see its steps with `durable_show {run.id}`")
    if run.status == RunStatus.WAITING:
        raise InvalidTransitionError(f"run {run.id} is waiting; decide or cancel its wait first")
    with transaction.atomic():
        taken = (
            Run.objects.filter(_lease_is_free(now), pk=run.id)
            .exclude(status=RunStatus.WAITING)
            .update(cursor=target.position, output=None, **_restarted(now))
        )
        if not taken:
            raise InvalidTransitionError(
                f"run {run.id} is being advanced or waiting; cancel it, decide its wait, or retry when its step ends"
            )
        cancel_open_waits_txn(run.id)
        superseded = supersede_from_txn(run.id, target.position, now)
        record_event(
            run.id,
            "rerun_from_step",
            step_id=step_id,
            actor=actor,
            previous_status=run.status,
            superseded=superseded,
        )
        wake_on_commit(run.id)
    run.refresh_from_db()
    return run


def supersede_from_txn(run_id: Any, position: int, now: Any) -> list[str]:
    """Mark the live steps from `position` on superseded (kept as history) and plan fresh copies of them.

    Effects keep their keys (run scope, step id, call), so a re-executed step reuses what it applied.
    """
    later = list(Step.objects.live().filter(run_id=run_id, position__gte=position).order_by("position"))
    Step.objects.filter(pk__in=[s.pk for s in later]).update(status=StepStatus.SUPERSEDED, updated_at=now)
    Step.objects.bulk_create(fresh_copy(s, run_id) for s in later)
    return [s.step_id for s in later]


def fresh_copy(step: Step, run_id: Any, **checkpoint: Any) -> Step:
    """An unsaved copy of a plan element for `run_id`: pending, or carrying `checkpoint` fields over."""
    return Step(
        run_id=run_id,
        step_id=step.step_id,
        name=step.name,
        kind=step.kind,
        position=step.position,
        args=step.args,
        depends_on=step.depends_on,
        fresh_for=step.fresh_for,
        **checkpoint,
    )


def _current_step_id(run: Run) -> str:
    return (
        Step.objects.live().filter(run_id=run.id, position=run.cursor).values_list("step_id", flat=True).first() or ""
    )


def swap_participant(run_id: uuid.UUID | str, participant: str, *, actor: str = "") -> Run:
    """Make `participant` answer this run's model turns from now on; recorded as an operator action.

    The next agent turn is asked of the new participant; earlier turns stay as journaled.
    """
    from durable_agents.agents.participants import participants

    participants.get(participant)  # unknown names are a clear error, before anything changes
    run = get_run(run_id)
    if run.is_finished:
        raise InvalidTransitionError(f"run {run.id} is {run.status}; swapping its participant changes nothing")
    with transaction.atomic():
        Run.objects.filter(pk=run.id).update(participant=participant)
        record_event(run.id, "participant_swapped", actor=actor, previous=run.participant or "default", to=participant)
    run.refresh_from_db()
    return run


def set_budget(
    run_id: uuid.UUID | str,
    *,
    tokens: int | None = None,
    cost_usd: Decimal | str | None = None,
    actor: str = "",
) -> Run:
    """Set a run's token and/or cost budget (e.g. raise it after BudgetExceededError, then resume)."""
    if tokens is None and cost_usd is None:
        raise InvalidInputError("give a token budget, a cost budget, or both")
    # Both must fit their columns (bigint; numeric(14, 6)): a DataError at the UPDATE would be a traceback.
    if tokens is not None:
        tokens = whole_number(tokens, "a token budget")
    cost = None if cost_usd is None else decimal_amount(cost_usd, "a cost budget", unit="USD", **COST_COLUMN)
    run = get_run(run_id)
    changes: dict[str, Any] = {}
    if tokens is not None:
        changes["token_budget"] = tokens
    if cost is not None:
        changes["cost_budget_usd"] = cost
    with transaction.atomic():
        Run.objects.filter(pk=run.id).update(**changes)
        record_event(
            run.id,
            "budget_set",
            actor=actor,
            previous={"tokens": run.token_budget, "cost_usd": str(run.cost_budget_usd)},
            tokens=tokens,
            cost_usd=str(cost) if cost is not None else None,
        )
    run.refresh_from_db()
    return run
