"""Durable waits: a step parks its run on an approval, a signal or a timer; a decision or the sweep wakes it.

Parking commits the Wait and releases the lease in one fenced transaction; the run is then `waiting`
and holds no worker, transaction or socket — nothing polls it. A decision (admin, command, signed link)
closes an approval, `send_signal` a signal wait, the sweep a timer or a deadline; the run moves back to
`pending` and a worker is woken; the step then re-executes and reads its closed wait. Only approvals
are decided by people: a signal comes only through `send_signal`, a timer only from the clock.
Notifications go through the outbox (engine/outbox.py).
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, Q, Value

from durable_agents import clock, tracing
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.display import when_text
from durable_agents.engine import replaying, transitions
from durable_agents.engine.admission import admit_on_commit
from durable_agents.engine.approvals import latest_wait
from durable_agents.engine.control import WaitSpec
from durable_agents.engine.events import record_event
from durable_agents.engine.lease import Claim
from durable_agents.engine.outbox import notify_txn
from durable_agents.engine.payloads import check_input
from durable_agents.engine.records import get_run, get_wait, locked
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import InvalidTransitionError, UnknownWorkflowError, WaitClosedError
from durable_agents.models import (
    DeadlinePolicy,
    Run,
    Step,
    Wait,
    WaitKind,
    WaitStatus,
)
from durable_agents.signals import run_finished, send_on_commit, wait_closed, wait_opened
from durable_agents.states import RunStatus, WaitOp
from durable_agents.workflows import registry

logger = logging.getLogger("durable_agents.waits")

take_buffered_signal = transitions.bind_buffered_signal

__all__ = ["decide_wait", "latest_wait", "park_txn", "send_signal", "sweep_waits", "take_buffered_signal"]


def park_txn(claim: Claim, step: Step, spec: WaitSpec) -> Wait:
    """Release the run into `waiting` and open its wait (fenced by `claim`); notify approvers after commit."""
    if replaying.is_replay(step.run) and spec.kind != WaitKind.BATCH:
        replaying.refuse(claim.run_id, f"opens a {spec.kind} wait")
    # Nobody is told of a model turn's wait for its batch: it is the engine's, not a person's.
    notify_to = () if spec.kind == WaitKind.BATCH else spec.notify_to or settings.APPROVERS
    wait, opened = transitions.park_txn(claim, step, spec, notify_to=notify_to)
    if not opened:
        if wait.status != WaitStatus.OPEN:
            # A signal came while the step was parking: go on at once instead of waiting for it again.
            wake_on_commit(claim.run_id)
        return wait
    send_on_commit(wait_opened, run_id=claim.run_id, wait_id=wait.pk, kind=spec.kind, name=spec.name)
    tracing.current().event("wait opened", {tracing.WAIT_ID: wait.pk, tracing.WAIT_KIND: spec.kind})
    record_event(
        claim.run_id,
        "waiting",
        step_id=step.step_id,
        wait=wait.pk,
        wait_kind=spec.kind,
        name=spec.name,
        deadline=spec.deadline.isoformat() if spec.deadline else None,
    )
    if spec.kind == WaitKind.APPROVAL:
        notify_txn(wait, "requested")
    return wait


def decide_wait(
    wait_id: int | str, *, approved: bool, by: str, comment: str = "", via: str = "", run_id: Any = None
) -> Wait:
    """Approve or reject exactly the approval wait `wait_id` and wake its run. Of two racing deciders one
    wins; the other gets WaitClosedError saying who decided and when. `run_id` checks the wait is that run's.
    """
    wait = get_wait(wait_id)
    if run_id is not None and str(wait.run_id) != str(run_id):
        raise InvalidTransitionError(f"wait {wait.pk} belongs to run {wait.run_id}, not to run {run_id}")
    if wait.kind != WaitKind.APPROVAL:
        raise InvalidTransitionError(
            f"wait {wait.pk} is a {wait.kind} wait: only approvals are decided by people"
            + (f"; deliver the signal with `durable_signal {wait.run_id} {wait.name}`" if wait.kind == "signal" else "")
        )
    status = WaitStatus.APPROVED if approved else WaitStatus.REJECTED
    decision = {"comment": comment, "via": via}
    # A decision after the deadline (on the database's clock) is too late, however late the sweep runs.
    in_time = Q(deadline__isnull=True) | Q(deadline__gt=DbNow())
    late = False
    with transaction.atomic():
        # The run's row first, as cancel, park and the sweep lock it: one lock order, no deadlock.
        Run.objects.select_for_update().filter(pk=wait.run_id).first()
        if _close_txn(wait, WaitOp.DECIDE, status, by=by, decision=decision, where=in_time):
            record_event(
                wait.run_id,
                "wait_decided",
                step_id=_step_id(wait),
                actor=by,
                wait=wait.pk,
                decision=status,
                comment=comment,
                via=via,
            )
        elif Wait.objects.open(keyed=True).filter(pk=wait.pk).exclude(in_time).exists():
            late = True
        else:
            raise _closed(wait)
    if late:
        # Its deadline policy applies now, as the sweep would have; then the decider is told what it did.
        _apply_deadline(wait.pk, clock.now())
        wait.refresh_from_db()
        what = f"it is now {wait.status}" if not wait.is_open else "it was escalated: decide again"
        raise WaitClosedError(
            f"wait {wait.pk}'s deadline passed before this decision; its policy ({wait.on_deadline}) applied, "
            f"{what}; nothing was decided"
        )
    wait.refresh_from_db()
    return wait


def _close_txn(
    wait: Wait, op: WaitOp, status: str, *, by: str, decision: dict[str, Any] | None = None, where: Q | None = None
) -> bool:
    """Close an open wait and wake its run, in the caller's transaction; False if the wait was not open."""
    closing = {"decided_by": by, "decided_at": DbNow(), "decision": decision}
    if not transitions.move_wait(op, wait.pk, to=status, where=where, **closing):
        return False
    send_on_commit(wait_closed, run_id=wait.run_id, wait_id=wait.pk, status=status, decided_by=by)
    if transitions.wake_txn(wait.run_id):
        wake_on_commit(wait.run_id)
    return True


def _closed(wait: Wait) -> WaitClosedError:
    wait.refresh_from_db()
    who = f" by {wait.decided_by}" if wait.decided_by else ""
    when = f" at {when_text(wait.decided_at)}" if wait.decided_at else ""
    return WaitClosedError(f"wait {wait.pk} is already {wait.status}{who}{when}; nothing changed")


def send_signal(
    run_id: uuid.UUID | str, name: str, payload: Any = None, *, by: str = "", wait_id: int | None = None
) -> Wait:
    """Deliver signal `name` to a run: it wakes a run waiting for it, or is kept until the run asks.

    With `wait_id` it goes to that open wait only, else nothing is kept: WaitClosedError (a form posted twice
    delivers once; the second would otherwise be kept for the run's next wait on the same name).
    """
    check_input(payload, "payload")  # a signal's payload is input to the run: storable JSON within the size limit
    run = get_run(run_id)
    if run.is_finished:
        raise InvalidTransitionError(f"run {run.id} is {run.status}; it takes no more signals")
    by = by or "signal"
    with transaction.atomic():
        # The run's row lock orders this against a step parking on the same signal (its fenced UPDATE):
        # either we see its open wait, or it sees our buffered signal. Nothing arrives in between.
        Run.objects.select_for_update().filter(pk=run.id).first()
        waiting = Wait.objects.open().filter(run_id=run.id, kind=WaitKind.SIGNAL, name=name).first()
        now = clock.now()
        if waiting is not None and waiting.deadline is not None and waiting.deadline <= now:
            # The timeout came first, however late the sweep runs: it applies; the signal is kept, late.
            _apply_deadline(waiting.pk, now)
            waiting = None
        if wait_id is not None and (waiting is None or waiting.pk != wait_id):
            raise WaitClosedError(
                f"wait {wait_id} of run {run.id} no longer waits for signal {name!r}; nothing was sent"
            )
        if waiting is not None:
            decision = {"payload": payload, "via": "signal"}
            if _close_txn(waiting, WaitOp.SIGNAL, WaitStatus.APPROVED, by=by, decision=decision):
                record_event(run.id, "signal_received", step_id=_step_id(waiting), actor=by, name=name, wait=waiting.pk)
                waiting.refresh_from_db()
                return waiting
        buffered = transitions.buffer_signal_txn(run.id, name, payload, by)
        record_event(run.id, "signal_received", actor=by, name=name, wait=buffered.pk)
        return buffered


def _step_id(wait: Wait) -> str:
    return Step.objects.filter(pk=wait.step_id).values_list("step_id", flat=True).first() or ""


# --- The sweep's share: timers, deadlines, warnings, reminders --------------------------------------------


def sweep_waits(now: datetime | None = None, *, batch: int | None = None) -> dict[str, int]:
    """Fire due timers, apply deadline policies, queue warnings and reminders. Safe to run concurrently."""
    now = now or clock.now()
    limit = batch or int(settings.SWEEP_BATCH)
    counts = {"fired": 0, "expired": 0, "warned": 0, "reminded": 0}
    for wait_id in _due_ids(Q(deadline__lte=now), limit):
        counts["fired" if _apply_deadline(wait_id, now) == "fired" else "expired"] += 1
    warn_due = ExpressionWrapper(Value(now) + F("warn_before"), output_field=DateTimeField())
    for wait_id in _due_ids(Q(warn_before__isnull=False, warned_at__isnull=True, deadline__lte=warn_due), limit):
        counts["warned"] += _warn(wait_id, now)
    for wait_id in _due_ids(Q(next_reminder_at__lte=now), limit):
        counts["reminded"] += _remind(wait_id, now)
    return counts


def _due_ids(condition: Q, limit: int) -> list[int]:
    return list(Wait.objects.open().filter(condition).order_by("id").values_list("id", flat=True)[:limit])


def _locked_open(wait_id: int) -> Wait | None:
    """The open wait, locked after its run's row (the lock order of every operation on a run and its waits);
    None if it closed, or if another transaction holds either row (a later sweep pass gets to it)."""
    run_id = Wait.objects.open(keyed=True).filter(pk=wait_id).values_list("run_id", flat=True).first()
    if run_id is None or locked(Run.objects.filter(pk=run_id)).first() is None:
        return None
    return locked(Wait.objects.open(keyed=True).filter(pk=wait_id)).first()


def _apply_deadline(wait_id: int, now: datetime) -> str:
    with transaction.atomic():
        wait = _locked_open(wait_id)
        if wait is None or wait.deadline is None or wait.deadline > now:
            return "skipped"
        if wait.kind == WaitKind.TIMER:
            _close_txn(wait, WaitOp.FIRE, WaitStatus.APPROVED, by="timer")
            record_event(wait.run_id, "timer_fired", step_id=_step_id(wait), wait=wait.pk)
            return "fired"
        if wait.kind == WaitKind.BATCH:
            # The turn's deadline: the step, woken, gives up on the batch and follows its policy (live, or fail).
            _close_txn(wait, WaitOp.EXPIRE, WaitStatus.REJECTED, by="deadline", decision={"via": "deadline"})
            record_event(wait.run_id, "batch_deadline", step_id=_step_id(wait), wait=wait.pk, custom_id=wait.name)
            return "expired"
        policy = wait.on_deadline
        if policy == DeadlinePolicy.ESCALATE and wait.escalated_at is None:
            extension = max(wait.deadline - wait.created_at, timedelta(minutes=1))
            Wait.objects.filter(pk=wait.pk).update(escalated_at=now, deadline=now + extension)
            record_event(
                wait.run_id,
                "wait_escalated",
                step_id=_step_id(wait),
                wait=wait.pk,
                to=wait.escalate_to,
                new_deadline=(now + extension).isoformat(),
            )
            wait.refresh_from_db()
            notify_txn(wait, "escalation")
            return "escalated"
        if policy == DeadlinePolicy.FAIL:
            _expire_and_fail_txn(wait)
        else:
            decision = {"comment": "the deadline passed", "via": "deadline"}
            _close_txn(wait, WaitOp.EXPIRE, WaitStatus.REJECTED, by="deadline", decision=decision)
            record_event(wait.run_id, "wait_expired", step_id=_step_id(wait), wait=wait.pk, policy=policy)
        notify_txn(wait, "expired")
        return "expired"


def _expire_and_fail_txn(wait: Wait) -> None:
    """The "fail" deadline policy: the wait expires and its step and run fail, as a failing step would
    (a workflow that compensates on failure undoes its effects first)."""
    step_id = _step_id(wait)
    error = {"type": "WaitExpiredError", "message": f"{wait.kind} wait {wait.pk} passed its deadline", "step": step_id}
    transitions.move_wait(WaitOp.EXPIRE, wait.pk, to=WaitStatus.EXPIRED, decided_by="deadline", decided_at=DbNow())
    record_event(wait.run_id, "wait_expired", step_id=step_id, wait=wait.pk, policy=DeadlinePolicy.FAIL)
    run = (
        Run.objects.filter(pk=wait.run_id).only("workflow", "workflow_version", "parent_id", "concurrency_key").first()
    )
    if run is None:
        return
    if transitions.fail_txn(run.id, wait.step_id, error, claim=None, compensate=_compensates_on_failure(run)):
        wake_on_commit(run.id)
    elif Run.objects.filter(pk=run.id, status__unindexed=RunStatus.FAILED).exists():
        send_on_commit(run_finished, run_id=run.id, status=RunStatus.FAILED, error=error, parent_id=run.parent_id)
        admit_on_commit(run.concurrency_key)


def _compensates_on_failure(run: Run) -> bool:
    """The failure policy of the run's version; if that is gone, of the newest version; if the workflow is
    gone entirely, compensate: effects left in place with nobody knowing the policy would be silent."""
    for version in (run.workflow_version, None):
        try:
            return registry.get(run.workflow, version).on_failure == "compensate"
        except UnknownWorkflowError:
            continue
    return True


def _warn(wait_id: int, now: datetime) -> int:
    with transaction.atomic():
        wait = _locked_open(wait_id)
        if wait is None or wait.warned_at or wait.deadline is None or wait.deadline - wait.warn_before > now:
            return 0
        Wait.objects.filter(pk=wait.pk).update(warned_at=now)
        record_event(wait.run_id, "wait_warning", step_id=_step_id(wait), wait=wait.pk)
        notify_txn(wait, "warning")
    return 1


def _remind(wait_id: int, now: datetime) -> int:
    with transaction.atomic():
        wait = _locked_open(wait_id)
        if wait is None or wait.next_reminder_at is None or wait.next_reminder_at > now or not wait.remind_every:
            return 0
        number = wait.reminders_sent + 1
        following = wait.next_reminder_at + wait.remind_every
        Wait.objects.filter(pk=wait.pk).update(
            reminders_sent=number, next_reminder_at=max(following, now + wait.remind_every)
        )
        record_event(wait.run_id, "wait_reminder", step_id=_step_id(wait), wait=wait.pk, number=number)
        notify_txn(wait, "reminder", number)
    return 1
