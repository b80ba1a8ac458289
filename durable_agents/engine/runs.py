"""Run-level operations: cancel, resume, rerun from a step, participant and budget changes (starts: starts.py).

Every status change goes through `transitions`; operations that take a run away from whoever holds it
bump the lease token there, so a worker still executing a step of that run commits nothing.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from django.db import transaction

from durable_agents import tracing
from durable_agents.engine import transitions
from durable_agents.engine.admission import admit_on_commit
from durable_agents.engine.events import record_event
from durable_agents.engine.records import current_step_id, get_run, let_go
from durable_agents.engine.transitions import Cancellation
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import InvalidInputError, InvalidTransitionError, StepNotFoundError
from durable_agents.models import Run, RunStatus, Step, StepStatus
from durable_agents.signals import run_finished, send_on_commit
from durable_agents.storable import decimal_amount, whole_number

COST_COLUMN = {"max_digits": 14, "decimal_places": 6}  # Run.cost_budget_usd


def cancel_run(run_id: uuid.UUID | str, *, reason: str = "", actor: str = "", compensate: bool = False) -> Run:
    """Cancel a run. A run no worker holds stops now; a running step finishes first, then the run stops.

    With `compensate`, the run first undoes its applied effects, newest first, then ends `cancelled`.
    A run already compensating goes on compensating: a saga is never cut short.
    """
    run = get_run(run_id)
    with tracing.run_span("cancel run", run.trace_context, _action_attributes(run, actor), run_id=run.id) as traced:
        traced.set({"durable_agents.cancel.compensate": compensate})
        return _cancel(run, reason=reason, actor=actor, compensate=compensate)


def _action_attributes(run: Run, actor: str) -> dict[str, Any]:
    """An operator's action on a run, as its span in the run's trace shows it (who; never the reason's text)."""
    return {tracing.RUN_ID: str(run.id), tracing.WORKFLOW: run.workflow, tracing.ACTOR: actor or None}


def _cancel(run: Run, *, reason: str, actor: str, compensate: bool) -> Run:
    if run.is_finished:
        raise InvalidTransitionError(f"run {run.id} is already {run.status}; there is nothing to cancel")
    step_id = current_step_id(run.id, run.cursor)
    with transaction.atomic():
        done = transitions.cancel_txn(run.id, reason=reason, compensate=compensate)
        if not done:
            run.refresh_from_db()
            raise InvalidTransitionError(f"run {run.id} is already {run.status}; there is nothing to cancel")
        _record_stop(
            run.id, done, step_id=step_id, actor=actor, reason=reason, compensate=compensate, holder=run.lease_owner
        )
    run.refresh_from_db()
    return run


def settle_cancellation(run_id: uuid.UUID | str) -> Cancellation:
    """Finish a requested cancellation once no worker holds the run: what it did (NONE: nothing to settle)."""
    with transaction.atomic():
        done = transitions.settle_cancellation_txn(run_id)
        if done:
            run = Run.objects.only("id", "cursor").get(pk=run_id)
            _record_stop(
                run.id, done, step_id=current_step_id(run.id, run.cursor), reason="cancel requested while a step ran"
            )
    return done


def _record_stop(
    run_id: Any,
    done: Cancellation,
    *,
    step_id: str,
    reason: str,
    actor: str = "",
    compensate: bool = False,
    holder: str = "",
) -> None:
    if done == Cancellation.REQUESTED:
        record_event(run_id, "cancel_requested", actor=actor, reason=reason, holder=holder, compensate=compensate)
    elif done == Cancellation.COMPENSATING:
        record_event(run_id, "cancel_compensating", step_id=step_id, actor=actor, reason=reason)
        wake_on_commit(run_id)
    elif done == Cancellation.SAGA_GOES_ON:
        finish_as = Run.objects.filter(pk=run_id).values_list("finish_as", flat=True).first()
        record_event(
            run_id,
            "cancel_ignored",
            step_id=step_id,
            actor=actor,
            reason=reason,
            why=f"the run is compensating: its saga goes on and ends {finish_as}",
        )
    else:
        record_event(run_id, "cancelled", step_id=step_id, actor=actor, reason=reason)
        parent_id, key, lane = (
            Run.objects.filter(pk=run_id).values_list("parent_id", "concurrency_key", "replay_lane").first()
        )
        send_on_commit(
            run_finished, run_id=run_id, status=RunStatus.CANCELLED, error=None, parent_id=parent_id, replay=bool(lane)
        )
        admit_on_commit(key)


def resume_run(run_id: uuid.UUID | str, *, from_step: str | None = None, actor: str = "") -> Run:
    """Resume a failed or cancelled run at its current step, re-wake a runnable one, or rerun from a step.

    A run that compensated (its effects undone) does not resume into that undone world: it is refused with
    a pointer to `fork`. A saga that stopped half-way (say, on an effect that needs attention) resumes its
    compensation from where it stopped.
    """
    run = get_run(run_id)
    name = "rerun run" if from_step is not None else "resume run"
    with tracing.run_span(name, run.trace_context, _action_attributes(run, actor), run_id=run.id) as traced:
        traced.set({tracing.STEP_ID: from_step, "durable_agents.run.previous_status": run.status})
        if from_step is not None:
            return _rerun_from_step(run, from_step, actor=actor)
        return _resume(run, actor=actor)


def _resume(run: Run, *, actor: str) -> Run:
    if run.status in (RunStatus.PENDING, RunStatus.RUNNING):
        with transaction.atomic():
            transitions.wake_up_txn(run.id)
            record_event(
                run.id, "woken", actor=actor, reason="resume of a runnable run", backoff_cleared=bool(run.wake_at)
            )
            wake_on_commit(run.id)
            admit_on_commit(run.concurrency_key)
        run.refresh_from_db()
        return run
    if run.status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        hint = "pass --from-step to run again from a step" if run.status == RunStatus.COMPLETED else "decide its wait"
        raise InvalidTransitionError(f"run {run.id} is {run.status}; only failed or cancelled runs resume ({hint})")
    if let_go(run):
        raise _compensated(run, "resume")
    with transaction.atomic():
        if not transitions.resume_txn(run.id, from_status=run.status, cursor=run.cursor):
            raise InvalidTransitionError(f"run {run.id} changed while resuming; look at it again and retry")
        record_event(
            run.id,
            "resumed",
            step_id=current_step_id(run.id, run.cursor),
            actor=actor,
            previous_status=run.status,
            compensating=bool(run.finish_as),
        )
        wake_on_commit(run.id)
        admit_on_commit(run.concurrency_key)
    run.refresh_from_db()
    return run


def _compensated(run: Run, what: str) -> InvalidTransitionError:
    first = Step.objects.live().filter(run_id=run.id).order_by("position").values_list("step_id", flat=True).first()
    first = first or "STEP"
    if not let_go(run):
        return InvalidTransitionError(
            f"run {run.id} is compensating (it ends {run.finish_as}): a {what} would cut its saga short; let it "
            f"finish, then start the work again as a new run with `manage.py durable_fork {run.id} --at {first}`"
        )
    return InvalidTransitionError(
        f"run {run.id} was compensated: its effects were undone, so a {what} would go on from an undone world; "
        f"start the work again as a new run with `manage.py durable_fork {run.id} --at {first}`"
    )


def _rerun_from_step(run: Run, step_id: str, *, actor: str) -> Run:
    target = Step.objects.live().filter(run_id=run.id, step_id=step_id).first()
    if target is None:
        raise StepNotFoundError(f"run {run.id} has no step {step_id!r}; see its steps with `durable_show {run.id}`")
    if run.status == RunStatus.WAITING:
        raise InvalidTransitionError(f"run {run.id} is waiting; decide or cancel its wait first")
    if run.finish_as:
        raise _compensated(run, "rerun")
    unchecked = Step.objects.live().filter(run_id=run.id, position__lt=target.position).exclude(status=StepStatus.DONE)
    if (first := unchecked.order_by("position").first()) is not None:
        raise InvalidTransitionError(
            f"step {first.step_id!r} of run {run.id} comes before {step_id!r} and has no checkpoint ({first.status}); "
            f"rerun from {first.step_id!r} or earlier"
        )
    with transaction.atomic():
        superseded = transitions.rerun_txn(run.id, target.position)
        if superseded is None:
            raise InvalidTransitionError(
                f"run {run.id} is being advanced or waiting; cancel it, decide its wait, or retry when its step ends"
            )
        record_event(
            run.id,
            "rerun_from_step",
            step_id=step_id,
            actor=actor,
            previous_status=run.status,
            superseded=superseded,
        )
        wake_on_commit(run.id)
        admit_on_commit(run.concurrency_key)
    run.refresh_from_db()
    return run


def set_participant(run_id: uuid.UUID | str, participant: str, *, actor: str = "") -> Run:
    """Make `participant` (a registered name, checked by the caller) answer this run's model turns from the
    next turn on; recorded as an operator action. Earlier turns stay as journaled."""
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
