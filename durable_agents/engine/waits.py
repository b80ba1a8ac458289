"""Durable waits: a step parks its run on an approval, a signal or a timer; a decision or the sweep wakes it.

Parking commits the Wait and releases the lease in one fenced transaction; the run is then `waiting`
and holds no worker, transaction or socket — nothing polls it. A decision (admin, command, signed link),
a signal, or the sweep (timers, deadlines) moves the run back to `pending` and wakes a worker; the step
then re-executes and reads its closed wait. Notifications go through the outbox (engine/outbox.py).
"""

from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, Q, Value

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.events import record_event
from durable_agents.engine.outbox import notify_txn
from durable_agents.engine.payloads import check_input
from durable_agents.engine.saga import plan_compensation_txn
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import InvalidTransitionError, UnknownWorkflowError, WaitClosedError, WaitNotFoundError
from durable_agents.models import (
    DeadlinePolicy,
    Effect,
    EffectStatus,
    Run,
    RunStatus,
    Step,
    StepStatus,
    Wait,
    WaitKind,
    WaitStatus,
)
from durable_agents.signals import run_finished, send_on_commit, wait_closed, wait_opened

logger = logging.getLogger("durable_agents.waits")


@dataclass(frozen=True)
class WaitSpec:
    """What a parking step waits for, and how the wait behaves while open."""

    kind: str
    name: str = ""
    effect_key: str = ""
    question: str = ""
    brief: str = ""
    deadline: datetime | None = None
    on_deadline: str = DeadlinePolicy.REJECT
    escalate_to: str = ""
    warn_before: timedelta | None = None
    remind_every: timedelta | None = None
    notify_to: tuple[str, ...] = field(default_factory=tuple)


class Park(BaseException):  # noqa: N818 - control flow, like GeneratorExit, not an error
    """Raised by step code to park the run on a wait.

    A BaseException on purpose: step and tool code that catches `Exception` must not swallow it.
    """

    def __init__(self, spec: WaitSpec) -> None:
        super().__init__(spec.kind, spec.name)
        self.spec = spec


def park_txn(run_id: uuid.UUID, step: Step, spec: WaitSpec, now: datetime) -> Wait:
    """Open the wait for a run whose lease this transaction just released; notify approvers after commit."""
    existing = Wait.objects.open().filter(run_id=run_id).first()
    if existing is not None:
        return existing
    if spec.kind == WaitKind.SIGNAL:
        arrived = take_buffered_signal(step, spec.name)
        if arrived is not None:
            # It came while the step was parking: go on at once instead of waiting for it again.
            _wake_txn(run_id, now)
            return arrived
    try:
        with transaction.atomic():
            wait = Wait.objects.create(
                run_id=run_id,
                step=step,
                kind=spec.kind,
                name=spec.name,
                effect_key=spec.effect_key,
                question=spec.question,
                brief=spec.brief,
                deadline=spec.deadline,
                on_deadline=spec.on_deadline,
                escalate_to=spec.escalate_to,
                warn_before=spec.warn_before,
                remind_every=spec.remind_every,
                next_reminder_at=now + spec.remind_every if spec.remind_every else None,
                notify_to=list(spec.notify_to) or list(settings.APPROVERS),
                link_nonce=secrets.token_hex(8),
            )
    except IntegrityError:
        return Wait.objects.open().get(run_id=run_id)
    Step.objects.filter(pk=step.pk).update(status=StepStatus.WAITING, updated_at=now)
    send_on_commit(wait_opened, run_id=run_id, wait_id=wait.pk, kind=spec.kind, name=spec.name)
    record_event(
        run_id,
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


def require_approval(ctx: Any, tool: Any, args: Any, key: str, *, always: bool = False) -> None:
    """Gate an effectful tool call marked `needs_approval`: park for a human first, proceed once approved.

    A rejection raises ApprovalRejectedError: an agent sees it as an is_error tool result (its reject
    path); a plain step fails with it.
    """
    from durable_agents.brief import short, template_brief
    from durable_agents.errors import ApprovalRejectedError

    checked = tool.validate(args)
    if not always and not tool.is_approval_required(checked):
        return
    if Effect.objects.filter(idempotency_key=key, status=EffectStatus.APPLIED).exists():
        return
    wait = latest_wait(ctx.step, kind=WaitKind.APPROVAL, effect_key=key)
    if wait is None or wait.status == WaitStatus.CANCELLED:
        question = f"Allow {tool.name}({short(checked, 200)})?"
        raise Park(
            WaitSpec(
                kind=WaitKind.APPROVAL,
                name=tool.name,
                effect_key=key,
                question=question,
                brief=template_brief(
                    ctx.run,
                    question=question,
                    context=f"Requested by step {ctx.step_id}: {tool.description}",
                    on_approve=f"{tool.name} runs once with these arguments",
                    on_reject=f"{tool.name} does not run",
                ),
                deadline=clock.now() + timedelta(seconds=settings.APPROVAL_DEADLINE_SECONDS)
                if settings.APPROVAL_DEADLINE_SECONDS
                else None,
            )
        )
    if wait.status != WaitStatus.APPROVED:
        comment = (wait.decision or {}).get("comment", "")
        raise ApprovalRejectedError(f"{tool.name} was rejected by {wait.decided_by or 'the deadline'}: {comment}")


def latest_wait(step: Step, *, kind: str, name: str = "", effect_key: str = "") -> Wait | None:
    """The newest wait this step (or this tool call) opened."""
    waits = Wait.objects.filter(run_id=step.run_id, kind=kind)
    waits = waits.filter(effect_key=effect_key) if effect_key else waits.filter(step_id=step.pk, name=name)
    return waits.order_by("-id").first()


def get_wait(wait_id: int | str) -> Wait:
    try:
        return Wait.objects.select_related("run").get(pk=int(wait_id))
    except (Wait.DoesNotExist, ValueError, TypeError):
        raise WaitNotFoundError(
            f"no wait has id {wait_id!r}; list open waits with `durable_runs --status waiting`"
        ) from None


def decide_wait(
    wait_id: int | str, *, approved: bool, by: str, comment: str = "", via: str = "", payload: Any = None
) -> Wait:
    """Close an open wait with a decision and wake its run. Of two racing deciders exactly one wins."""
    wait = get_wait(wait_id)
    now = clock.now()
    status = WaitStatus.APPROVED if approved else WaitStatus.REJECTED
    decision = {"comment": comment, "via": via, **({"payload": payload} if payload is not None else {})}
    with transaction.atomic():
        if not Wait.objects.filter(pk=wait.pk, status=WaitStatus.OPEN).update(
            status=status, decided_by=by, decided_at=now, decision=decision
        ):
            wait.refresh_from_db()
            who = f" by {wait.decided_by}" if wait.decided_by else ""
            when = f" at {wait.decided_at:%Y-%m-%d %H:%M:%S} UTC" if wait.decided_at else ""
            raise WaitClosedError(f"wait {wait.pk} is already {wait.status}{who}{when}; nothing changed")
        send_on_commit(wait_closed, run_id=wait.run_id, wait_id=wait.pk, status=status, decided_by=by)
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
        _wake_txn(wait.run_id, now)
    wait.refresh_from_db()
    return wait


def send_signal(run_id: uuid.UUID | str, name: str, payload: Any = None, *, by: str = "") -> Wait:
    """Deliver signal `name` to a run: it wakes a run waiting for it, or is kept until the run asks."""
    from durable_agents.engine.runs import get_run

    check_input(payload)  # a signal's payload is input to the run: JSON and within the size limit
    run = get_run(run_id)
    if run.is_finished:
        raise InvalidTransitionError(f"run {run.id} is {run.status}; it takes no more signals")
    with transaction.atomic():
        # The run's row lock orders this against a step parking on the same signal (its fenced UPDATE):
        # either we see its open wait, or it sees our buffered signal. Nothing arrives in between.
        Run.objects.select_for_update().filter(pk=run.id).first()
        waiting = Wait.objects.open().filter(run_id=run.id, kind=WaitKind.SIGNAL, name=name).first()
        if waiting is not None:
            return decide_wait(waiting.pk, approved=True, by=by or "signal", via="signal", payload=payload)
        return _buffer_signal_txn(run, name, payload, by)


def _buffer_signal_txn(run: Run, name: str, payload: Any, by: str) -> Wait:
    buffered = Wait.objects.create(
        run_id=run.id,
        kind=WaitKind.SIGNAL,
        name=name,
        status=WaitStatus.APPROVED,
        decided_by=by or "signal",
        decided_at=clock.now(),
        decision={"payload": payload, "via": "signal"},
    )
    record_event(run.id, "signal_received", actor=by, name=name, wait=buffered.pk)
    return buffered


def take_buffered_signal(step: Step, name: str) -> Wait | None:
    """A signal that arrived before the step asked for it, now bound to the step (once)."""
    for wait in Wait.objects.filter(
        run_id=step.run_id, kind=WaitKind.SIGNAL, name=name, step__isnull=True, status=WaitStatus.APPROVED
    ).order_by("id"):
        if Wait.objects.filter(pk=wait.pk, step__isnull=True).update(step=step):
            wait.step = step
            return wait
    return None


def cancel_open_waits_txn(run_id: Any) -> None:
    Wait.objects.filter(run_id=run_id, status=WaitStatus.OPEN).update(status=WaitStatus.CANCELLED)


def _wake_txn(run_id: Any, now: datetime) -> None:
    if Run.objects.filter(pk=run_id, status=RunStatus.WAITING).update(
        status=RunStatus.PENDING, updated_at=now, attempt=0
    ):
        wake_on_commit(run_id)


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
    from durable_agents.engine.sweep import locked

    return locked(Wait.objects.open().filter(pk=wait_id)).first()


def _apply_deadline(wait_id: int, now: datetime) -> str:
    with transaction.atomic():
        wait = _locked_open(wait_id)
        if wait is None or wait.deadline is None or wait.deadline > now:
            return "skipped"
        if wait.kind == WaitKind.TIMER:
            Wait.objects.filter(pk=wait.pk).update(status=WaitStatus.APPROVED, decided_by="timer", decided_at=now)
            record_event(wait.run_id, "timer_fired", step_id=_step_id(wait), wait=wait.pk)
            _wake_txn(wait.run_id, now)
            return "fired"
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
            _expire_and_fail_txn(wait, now)
        else:
            Wait.objects.filter(pk=wait.pk).update(
                status=WaitStatus.REJECTED,
                decided_by="deadline",
                decided_at=now,
                decision={"comment": "the deadline passed", "via": "deadline"},
            )
            record_event(wait.run_id, "wait_expired", step_id=_step_id(wait), wait=wait.pk, policy=policy)
            _wake_txn(wait.run_id, now)
        notify_txn(wait, "expired")
        return "expired"


def _expire_and_fail_txn(wait: Wait, now: datetime) -> None:
    error = {
        "type": "WaitExpiredError",
        "message": f"{wait.kind} wait {wait.pk} passed its deadline",
        "step": _step_id(wait),
    }
    Wait.objects.filter(pk=wait.pk).update(status=WaitStatus.EXPIRED, decided_by="deadline", decided_at=now)
    record_event(wait.run_id, "wait_expired", step_id=error["step"], wait=wait.pk, policy=DeadlinePolicy.FAIL)
    run = Run.objects.filter(pk=wait.run_id, status=RunStatus.WAITING).only("workflow", "workflow_version").first()
    if run is None:
        return
    Step.objects.filter(pk=wait.step_id).update(status=StepStatus.FAILED, error=error, finished_at=now)
    fields = {"error": error}
    # The same failure path as a failing step: a workflow that compensates undoes its effects first.
    if _compensates_on_failure(run) and plan_compensation_txn(
        run.id, finish_as=RunStatus.FAILED, now=now, fields={**fields, "status": RunStatus.PENDING}
    ):
        wake_on_commit(run.id)
        return
    Run.objects.filter(pk=run.id).update(status=RunStatus.FAILED, finished_at=now, updated_at=now, **fields)
    send_on_commit(run_finished, run_id=run.id, status=RunStatus.FAILED, error=error)


def _compensates_on_failure(run: Run) -> bool:
    from durable_agents.workflows import registry

    try:
        return registry.get(run.workflow, run.workflow_version).on_failure == "compensate"
    except UnknownWorkflowError:
        return False


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


__all__ = ["Park", "WaitSpec", "decide_wait", "park_txn", "send_signal", "sweep_waits"]
