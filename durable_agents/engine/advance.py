"""advance(run_id): claim the run, execute exactly one step outside any transaction, commit it fenced.

claim (1 UPDATE) → load (1 SELECT: step + run) → execute (heartbeat renews the lease)
→ commit (1 short transaction: run cursor/lease fenced by token, step checkpoint) → wake next on commit
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from django.db import transaction
from django.db.models import F

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine import hotpath
from durable_agents.engine.context import StepContext
from durable_agents.engine.events import record_event
from durable_agents.engine.lease import Claim, Heartbeat, as_uuid, claim_run, lease_seconds, renew_lease, worker_id
from durable_agents.engine.payloads import StoredResult, store_result
from durable_agents.engine.plans import (
    MAX_REPLANS_PER_STEP,
    Rerun,
    StaleObservation,
    adopt_version_txn,
    find_stale,
    missing_version,
    park_for_version,
    redo_txn,
    replan_txn,
    replans_of,
)
from durable_agents.engine.retry import Failure, classify
from durable_agents.engine.runs import settle_cancellation
from durable_agents.engine.saga import COMPENSATION, plan_compensation_txn
from durable_agents.engine.waits import Park, WaitSpec, park_txn
from durable_agents.engine.wake import wake, wake_on_commit
from durable_agents.errors import (
    DefinitionError,
    LeaseLostError,
    PermanentError,
    UnknownToolError,
    UnknownWorkflowError,
)
from durable_agents.logs import run_logger
from durable_agents.models import Run, RunStatus, Step, StepKind, StepStatus
from durable_agents.planner import TOOL_STEP_PREFIX, ExtendPlan, as_planned_steps, planned_step
from durable_agents.signals import run_finished, send_on_commit, step_committed, step_failed, step_retried
from durable_agents.tools import tools
from durable_agents.workflows import RetryPolicy, StepDef, Workflow, registry

logger = logging.getLogger("durable_agents.engine")


class Outcome(StrEnum):
    """What one advance did, for logs, tests and benchmarks."""

    SKIPPED = "skipped"  # not claimable: duplicate delivery, lease held, finished, not due
    COMMITTED = "committed"
    COMPLETED = "completed"
    RETRY = "retry"
    FAILED = "failed"
    CANCELLED = "cancelled"
    COMPENSATING = "compensating"
    WAITING = "waiting"
    REPLANNED = "replanned"
    LEASE_LOST = "lease_lost"


def advance(run_id: uuid.UUID | str) -> Outcome:
    """Advance one run by exactly one step. Safe to call any number of times, concurrently."""
    claimed = _claim_and_load(as_uuid(run_id))
    claimed_at = time.monotonic()
    if claimed is None:
        # Most unclaimable deliveries are duplicates: a read, not a write, tells whether a cancel waits.
        if Run.objects.filter(pk=run_id, cancel_requested_at__isnull=False).exists():
            return Outcome.CANCELLED if settle_cancellation(run_id) else Outcome.SKIPPED
        return Outcome.SKIPPED
    claim, step = claimed
    if claim.previous_owner:
        record_event(claim.run_id, "lease_takeover", previous_owner=claim.previous_owner, token=claim.token)
    if step is None:
        return _finish_empty(claim)
    run = step.run
    log = run_logger("durable_agents.engine", run.id, step.step_id, claim.attempt)
    try:
        definition_set = registry.get(run.workflow, run.workflow_version)
    except UnknownWorkflowError:
        return _version_gone(claim, step, run)
    try:
        definition = _definition(definition_set, step)
    except (DefinitionError, UnknownToolError):
        # A plan element this version cannot execute (e.g. after a migration): an operator decides.
        return _park(claim, step, park_for_version(run, definition_set).spec)
    policy = definition_set.retry_policy(definition)
    compensate = definition_set.on_failure == "compensate"
    guarded = _guard(claim, step, policy, compensate)
    if guarded is not None:
        return guarded

    # A worker paused between its claim and the step (SIGSTOP, a GC storm) may have been taken over:
    # prove the lease again before running the step body, so a thawed zombie stops here.
    if time.monotonic() - claimed_at > lease_seconds() / 3 and not renew_lease(claim):
        return _rejected(claim, step)
    started_at = clock.now()
    log.debug("step start")
    with Heartbeat(claim) as beat:
        try:
            value = _execute(definition_set, definition, StepContext(run, step, claim.attempt, beat))
            stored = store_result(run.id, step.step_id, value)
        except Park as park:
            return _park(claim, step, park.spec)
        except Rerun as rerun:
            return _redo(claim, step, rerun, started_at)
        except ExtendPlan as extension:
            return _extend(claim, step, extension, started_at)
        except Exception as exc:  # noqa: BLE001 - every failure is classified and persisted below
            failure = classify(exc, policy, step.step_id)
            log.warning("step error %s: %s", failure.type, failure.message)
            if failure.transient and claim.attempt < policy.attempts_allowed:
                delay = max(policy.delay(claim.attempt), failure.retry_after or 0.0)
                return _retry(claim, step, failure, delay, started_at)
            return _fail(claim, step, failure, started_at, compensate=compensate)
    return _commit(claim, step, stored, started_at)


def _definition(definition_set: Workflow, step: Step) -> StepDef:
    """What executes this plan element: the workflow's definition, a planned tool call, or a compensation."""
    if step.kind == StepKind.COMPENSATE:
        return COMPENSATION
    if step.name.startswith(TOOL_STEP_PREFIX):
        return planned_step(tools.get(step.name.removeprefix(TOOL_STEP_PREFIX)))
    return definition_set.definition(step.name)


def _guard(claim: Claim, step: Step, policy: RetryPolicy, compensate: bool) -> Outcome | None:
    """Checks before a step runs: a worker-killing crash loop, and observations gone stale."""
    if claim.attempt > max(policy.attempts_allowed, int(settings.MAX_CLAIMS_PER_STEP)):
        failure = Failure(
            False,
            "StepCrashLoop",
            f"step was claimed {claim.attempt - 1} times without finishing; its worker keeps dying (OOM? SIGKILL?)",
            step.step_id,
        )
        return _fail(claim, step, failure, clock.now(), compensate=compensate)
    if step.depends_on:
        stale = find_stale(claim.run_id, step.depends_on, clock.now())
        if stale is not None:
            return _replan(claim, step, stale, compensate)
    return None


def _claim_and_load(run_id: uuid.UUID) -> tuple[Claim, Step | None] | None:
    if hotpath.is_available():
        return hotpath.claim_and_load(run_id, worker_id(), clock.now(), timedelta(seconds=lease_seconds()))
    claim = claim_run(run_id)
    if claim is None:
        return None
    step = (
        Step.objects.select_related("run").live().filter(run_id=run_id, position=claim.cursor).order_by().first()
        if claim.cursor < claim.step_count
        else None
    )
    return claim, step


def _execute(definition_set: Workflow, definition: StepDef, ctx: StepContext) -> Any:
    if definition.fn is None:
        raise PermanentError(f"step {definition.name!r} of {definition_set.label} has nothing to execute")
    return definition.fn(ctx)


def _fenced(claim: Claim) -> Any:
    """The run row, only while this claim's token still holds it: 0 rows means a zombie."""
    return Run.objects.filter(pk=claim.run_id, lease_token=claim.token, status=RunStatus.RUNNING)


def _hold_txn(claim: Claim, **changes: Any) -> None:
    """Inside a transaction: apply `changes` to the run only while this claim holds it, else LeaseLostError."""
    if _fenced(claim).update(**changes) != 1:
        raise LeaseLostError()


@contextmanager
def _holding(claim: Claim, **changes: Any) -> Iterator[None]:
    """One short transaction that first proves this worker still holds the run (applying `changes`);
    a zombie's raises LeaseLostError before writing anything else, and everything rolls back."""
    with transaction.atomic():
        _hold_txn(claim, **changes)
        yield


def _released(now: datetime) -> dict[str, Any]:
    return {"lease_owner": "", "lease_expires_at": None, "updated_at": now}


def _commit(claim: Claim, step: Step, stored: StoredResult, started_at: datetime) -> Outcome:
    now = clock.now()
    last = claim.cursor + 1 >= claim.step_count
    if hotpath.is_available():
        if not hotpath.commit_checkpoint(claim, step, stored, started_at, now, final=last):
            return _rejected(claim, step)
        _committed(claim, step, last)
        if last:
            return Outcome.COMPLETED
        wake(claim.run_id)
        return Outcome.COMMITTED
    changes = {"cursor": claim.cursor + 1, "attempt": 0, **_released(now)}
    if last:
        output = None if claim.finish_as else stored.public_value
        changes.update(status=claim.finish_as or RunStatus.COMPLETED, output=output, finished_at=now)
    try:
        with _holding(claim, **changes):
            Step.objects.filter(pk=step.pk).update(
                status=StepStatus.DONE,
                result=stored.inline,
                result_ref=stored.ref,
                result_hash=stored.sha256,
                error=None,
                attempts=claim.attempt,
                started_at=started_at,
                finished_at=now,
                updated_at=now,
                # An observation is as old as the moment the step started looking.
                observed_at=started_at if step.fresh_for else None,
            )
            if not last:
                wake_on_commit(claim.run_id)
            _committed(claim, step, last)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.COMPLETED if last else Outcome.COMMITTED


def _committed(claim: Claim, step: Step, last: bool) -> None:
    send_on_commit(step_committed, run_id=claim.run_id, step_id=step.step_id, attempt=claim.attempt)
    if last:
        send_on_commit(run_finished, run_id=claim.run_id, status=claim.finish_as or RunStatus.COMPLETED, error=None)


def _retry(claim: Claim, step: Step, failure: Failure, delay: float, started_at: datetime) -> Outcome:
    now = clock.now()
    wake_at = now + timedelta(seconds=delay)
    try:
        with _holding(claim, wake_at=wake_at, **_released(now)):
            Step.objects.filter(pk=step.pk).update(
                error=failure.as_error(),
                attempts=claim.attempt,
                next_attempt_at=wake_at,
                started_at=started_at,
                updated_at=now,
            )
            record_event(
                claim.run_id,
                "step_retry",
                step_id=step.step_id,
                attempt=claim.attempt,
                delay_seconds=round(delay, 3),
                error=failure.as_error(),
            )
            send_on_commit(
                step_retried,
                run_id=claim.run_id,
                step_id=step.step_id,
                attempt=claim.attempt,
                error=failure.as_error(),
                delay_seconds=delay,
            )
            # Short backoffs ride a countdown; long ones are left to the sweep (no long broker ETAs).
            if delay <= float(settings.MAX_COUNTDOWN_SECONDS):
                wake_on_commit(claim.run_id, countdown=delay)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.RETRY


def _fail(claim: Claim, step: Step, failure: Failure, started_at: datetime, *, compensate: bool = False) -> Outcome:
    """Fail the step; the run fails too, or first compensates its applied effects if the workflow says so."""
    now = clock.now()
    error = failure.as_error()
    try:
        with _holding(claim, **_released(now)):
            Step.objects.filter(pk=step.pk).update(
                status=StepStatus.FAILED,
                error=error,
                attempts=claim.attempt,
                started_at=started_at,
                finished_at=now,
                updated_at=now,
            )
            record_event(claim.run_id, "failed", step_id=step.step_id, attempt=claim.attempt, error=error)
            send_on_commit(step_failed, run_id=claim.run_id, step_id=step.step_id, attempt=claim.attempt, error=error)
            fields = {"error": error, "lease_token": F("lease_token") + 1}
            # A spent budget stops the run resumable: undoing its effects would make "raise and resume" moot.
            undo = compensate and not claim.finish_as and failure.type != "BudgetExceededError"
            if undo and plan_compensation_txn(claim.run_id, finish_as=RunStatus.FAILED, now=now, fields=fields):
                wake_on_commit(claim.run_id)
                return Outcome.COMPENSATING
            Run.objects.filter(pk=claim.run_id).update(status=RunStatus.FAILED, finished_at=now, **fields)
            send_on_commit(run_finished, run_id=claim.run_id, status=RunStatus.FAILED, error=error)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.FAILED


def _park(claim: Claim, step: Step, spec: WaitSpec) -> Outcome:
    """Release the run into `waiting` and open its wait, in one fenced transaction; nothing wakes it but
    a decision, a signal or the sweep."""
    now = clock.now()
    try:
        with _holding(claim, status=RunStatus.WAITING, attempt=0, **_released(now)):
            park_txn(claim.run_id, step, spec, now)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.WAITING


def _replan(claim: Claim, step: Step, stale: StaleObservation, compensate: bool) -> Outcome:
    """Never act on a stale world: go back to the observation, re-observe, and re-plan from there."""
    if replans_of(claim.run_id, step.step_id) >= MAX_REPLANS_PER_STEP:
        failure = Failure(
            False,
            "StaleObservationError",
            f"observation {stale.step_id!r} went stale {MAX_REPLANS_PER_STEP} times before this step "
            f"could run; its {stale.budget_seconds:.0f}s budget is shorter than the work after it",
            step.step_id,
        )
        return _fail(claim, step, failure, clock.now(), compensate=compensate)
    now = clock.now()
    try:
        with _holding(claim, **_released(now)):
            replan_txn(claim.run_id, stale, because_of=step.step_id, now=now)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.REPLANNED


def _redo(claim: Claim, step: Step, rerun: Rerun, started_at: datetime) -> Outcome:
    """Checkpoint the step that asked for a redo (its verdict stays as history), then go back."""
    now = clock.now()
    try:
        with _holding(claim, **_released(now)):
            Step.objects.filter(pk=step.pk).update(
                status=StepStatus.DONE,
                result=rerun.result,
                attempts=claim.attempt,
                started_at=started_at,
                finished_at=now,
                updated_at=now,
            )
            redo_txn(claim.run_id, rerun, from_step=step.step_id, now=now)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.REPLANNED


def _version_gone(claim: Claim, step: Step, run: Run) -> Outcome:
    """The run's version is no longer registered: follow the newest version's declared policy."""
    try:
        newest, policy = missing_version(run, step)
        if policy == "park":
            raise park_for_version(run, newest)
    except Park as park:
        return _park(claim, step, park.spec)
    now = clock.now()
    try:
        with _holding(claim, **_released(now)):
            adopt_version_txn(claim.run_id, newest, replan=policy == "replan", actor="engine", now=now)
            wake_on_commit(claim.run_id)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.REPLANNED


def _extend(claim: Claim, step: Step, extension: ExtendPlan, started_at: datetime) -> Outcome:
    """Checkpoint a planner and put its validated plan right after it (replacing an earlier plan of it)."""
    now = clock.now()
    calls = extension.calls
    try:
        with transaction.atomic():
            following = list(
                Step.objects.live()
                .filter(run_id=claim.run_id, position__gt=step.position)
                .exclude(status=StepStatus.PENDING, step_id__startswith=f"{step.step_id}.")
                .order_by("position")
            )
            end = step.position + 1 + len(calls) + len(following)
            _hold_txn(claim, cursor=step.position + 1, step_count=end, attempt=0, **_released(now))
            Step.objects.live().filter(
                run_id=claim.run_id, status=StepStatus.PENDING, step_id__startswith=f"{step.step_id}."
            ).update(status=StepStatus.SUPERSEDED, updated_at=now)
            Step.objects.filter(pk=step.pk).update(
                status=StepStatus.DONE,
                result=extension.result,
                attempts=claim.attempt,
                started_at=started_at,
                finished_at=now,
                updated_at=now,
            )
            # Two passes: positions are unique among live steps, so move the tail out of the way first.
            Step.objects.filter(pk__in=[s.pk for s in following]).update(position=F("position") + 1_000_000)
            for offset, later in enumerate(following):
                Step.objects.filter(pk=later.pk).update(position=step.position + 1 + len(calls) + offset)
            observations = list(
                Step.objects.live()
                .filter(run_id=claim.run_id, position__lt=step.position, status=StepStatus.DONE)
                .exclude(fresh_for=None)
                .values_list("step_id", flat=True)
            )
            Step.objects.bulk_create(
                Step(
                    run_id=claim.run_id,
                    step_id=planned.step_id,
                    name=planned.name,
                    kind=StepKind.TOOL,
                    position=step.position + 1 + i,
                    args=dict(planned.args),
                    depends_on=observations,
                    fresh_for=call.fresh_for,
                )
                for i, (planned, call) in enumerate(zip(as_planned_steps(calls), calls, strict=True))
            )
            record_event(claim.run_id, "planned", step_id=step.step_id, steps=[c.step_id for c in calls])
            wake_on_commit(claim.run_id)
    except LeaseLostError:
        return _rejected(claim, step)
    return Outcome.COMMITTED


def _finish_empty(claim: Claim) -> Outcome:
    now = clock.now()
    status = claim.finish_as or RunStatus.COMPLETED
    if _fenced(claim).update(status=status, finished_at=now, attempt=0, **_released(now)) != 1:
        return Outcome.LEASE_LOST
    return Outcome.COMPLETED


def _rejected(claim: Claim, step: Step) -> Outcome:
    current = Run.objects.filter(pk=claim.run_id).values_list("lease_token", "lease_owner").first()
    record_event(
        claim.run_id,
        "zombie_commit_rejected",
        step_id=step.step_id,
        token=claim.token,
        owner=claim.owner,
        current_token=current[0] if current else None,
        current_owner=current[1] if current else None,
    )
    run_logger("durable_agents.engine", claim.run_id, step.step_id, claim.attempt).warning(
        "commit rejected: lease lost (token %s)", claim.token
    )
    return Outcome.LEASE_LOST


__all__ = ["Outcome", "advance"]
