"""advance(run_id): claim the run, execute exactly one step outside any transaction, commit it fenced.
advance_slice(run_id): the same, then the next steps in this process while the slice allows (engine/eager.py).

claim (1 statement: lease + step) → guard → execute (heartbeat renews the lease) → one fenced
transition (checkpoint, retry, failure, park, re-plan) → wake the next step on commit.

Every exception path ends in a transition that releases the lease, or in a rejected zombie: a step whose
result the database refuses, or a transition that itself fails, fails the step with that error instead
of leaving the lease held (its body would re-run on every expiry). Only a database that cannot be
reached, or refuses even the failure, leaves the lease to expire (logged), and the sweep re-wakes the run.
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from datetime import timedelta
from enum import StrEnum
from typing import Any

from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import F

from durable_agents import tracing
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.engine import replaying, transitions
from durable_agents.engine.admission import admit_on_commit
from durable_agents.engine.context import StepContext
from durable_agents.engine.control import ExtendPlan, Park, Rerun, WaitSpec
from durable_agents.engine.eager import DEFAULT_QUEUE, Batch, Slice
from durable_agents.engine.events import record_event
from durable_agents.engine.family import join_if_ready_txn
from durable_agents.engine.lease import Claim, Heartbeat, as_uuid, lease_seconds, renew_lease
from durable_agents.engine.payloads import store_result
from durable_agents.engine.planned import TOOL_STEP_PREFIX, is_planned, planned_step
from durable_agents.engine.plans import (
    MAX_REPLANS_PER_STEP,
    StaleObservation,
    adopt_version_txn,
    find_stale,
    missing_version,
    park_for_version,
    redo_target,
    redo_txn,
    replan_txn,
    replans_of,
)
from durable_agents.engine.retry import Failure, classify
from durable_agents.engine.runs import settle_cancellation
from durable_agents.engine.saga import COMPENSATION
from durable_agents.engine.waits import park_txn
from durable_agents.engine.wake import wake, wake_on_commit
from durable_agents.errors import (
    DefinitionError,
    LeaseLostError,
    ModelUnavailableError,
    PermanentError,
    ReplayDivergedError,
    UnknownToolError,
    UnknownWorkflowError,
)
from durable_agents.logs import run_logger
from durable_agents.models import Run, RunStatus, Step, StepKind, StepStatus, WaitKind
from durable_agents.signals import run_finished, send_on_commit, step_committed, step_failed, step_retried
from durable_agents.states import StepOp
from durable_agents.tools import tools
from durable_agents.workflows import RetryPolicy, StepDef, Workflow, registry

logger = logging.getLogger("durable_agents.engine")


class Outcome(StrEnum):
    """What one advance did, for logs, tests and benchmarks."""

    SKIPPED = "skipped"  # not claimable: duplicate delivery, lease held, finished, not due
    NOT_FOUND = "not_found"  # no such run in this worker's database
    COMMITTED = "committed"
    COMPLETED = "completed"
    RETRY = "retry"
    FAILED = "failed"
    CANCELLED = "cancelled"
    COMPENSATING = "compensating"
    WAITING = "waiting"
    REPLANNED = "replanned"
    LEASE_LOST = "lease_lost"


# The attempts a trace shows failed (status ERROR): the step's body raised, or its work was discarded.
FAILED_ATTEMPTS = frozenset({Outcome.RETRY, Outcome.FAILED, Outcome.LEASE_LOST})


def advance(run_id: uuid.UUID | str) -> Outcome:
    """Advance one run by exactly one step. Safe to call any number of times, concurrently."""
    run_id = as_uuid(run_id)
    return _advance_claimed(run_id, transitions.claim_run(run_id), None)


def advance_slice(
    run_id: uuid.UUID | str,
    *,
    serves: frozenset[str | None] = DEFAULT_QUEUE,
    batch: Batch | None = None,
    model_bound: bool = False,
) -> Outcome:
    """Advance one run by one step, then by the steps after it in this process while the slice allows (eager
    continuation, engine/eager.py: what it guarantees); the outcome of the last step run. Safe to call any
    number of times, concurrently. `serves`: the queues whose steps this worker runs (None: the default);
    `batch`: the batched wake-up this run is one of (its claim may have been made by the run before it);
    `model_bound`: claim the run only if the model queue's worker serves it (transitions.claim_run)."""
    run_id = as_uuid(run_id)
    eager = Slice.start(serves, batch)
    premade = batch.take(run_id) if batch is not None else None
    outcome = _advance_claimed(run_id, premade or transitions.claim_run(run_id, model_bound=model_bound), eager)
    while (kept := eager.take()) is not None:
        following = _advance_claimed(run_id, kept.claimed if kept.made else _claim_kept(run_id), eager)
        outcome = outcome if following in (Outcome.SKIPPED, Outcome.NOT_FOUND) else following
    return outcome


def _claim_kept(run_id: uuid.UUID) -> tuple[Claim, Step | None] | None:
    """The claim of a run this task kept instead of waking it: if the claim cannot be made, the wake-up it
    replaced is sent, so the run is never left without one."""
    try:
        return transitions.claim_run(run_id)
    except BaseException:
        wake(run_id)
        raise


def _advance_claimed(run_id: uuid.UUID, claimed: tuple[Claim, Step | None] | None, eager: Slice | None) -> Outcome:
    if claimed is None:
        # Most unclaimable deliveries are duplicates: a read, not a write, tells whether a cancel waits.
        found = list(Run.objects.filter(pk=run_id).values_list("cancel_requested_at", flat=True)[:1])
        if not found:
            logger.warning(
                "run %s is not in this worker's database %r: deleted since, or sent by a process on another "
                "database (check DATABASES and the broker of both)",
                run_id,
                connection.settings_dict.get("NAME"),
            )
            return Outcome.NOT_FOUND
        if found[0] is not None:
            return _settled(settle_cancellation(run_id))
        return Outcome.SKIPPED
    claim, step = claimed
    if claim.previous_owner:
        _record_takeover(claim, step)
    if step is None:
        return _finish_empty(claim)
    attributes = _attempt_attributes(claim, step) if tracing.enabled() else None
    name, context = f"step {step.name}", step.run.trace_context
    with tracing.run_span(name, context, attributes, run_id=claim.run_id) as traced:
        outcome = _advance_recorded(claim, step, eager)
        traced.set({tracing.OUTCOME: outcome.value})
        if outcome in FAILED_ATTEMPTS:
            traced.fail(outcome.value)
    return outcome


def _advance_recorded(claim: Claim, step: Step, eager: Slice | None) -> Outcome:
    try:
        return _advance(claim, step, eager)
    except LeaseLostError:
        # Another worker holds the run now: this worker's work is discarded, never recorded as a failure.
        return _rejected(claim, step)
    except (OperationalError, InterfaceError):
        raise  # the database cannot be reached: the lease expires and the sweep re-wakes the run
    except Exception as exc:  # noqa: BLE001 - a transition failed: fail the step rather than hold the lease
        return _fail_unrecorded(claim, step, exc)


def _attempt_attributes(claim: Claim, step: Step) -> dict[str, Any]:
    run = step.run
    return {
        tracing.RUN_ID: str(claim.run_id),
        tracing.WORKFLOW: run.workflow,
        tracing.WORKFLOW_VERSION: run.workflow_version,
        tracing.STEP_ID: step.step_id,
        tracing.STEP_NAME: step.name,
        tracing.STEP_KIND: step.kind,
        tracing.ATTEMPT: claim.attempt,
        tracing.WORKER: claim.owner,
        tracing.LEASE_TOKEN: claim.token,
    }


def _record_takeover(claim: Claim, step: Step | None) -> None:
    """The previous holder died holding the lease: its attempt (claimed when, lease out when) is history."""
    if step is not None:
        # Its process never ended that attempt's span: draw it from the database's times, as the timeline does.
        tracing.record_run_span(
            f"step {step.name}",
            step.run.trace_context,
            claim.previous_claimed_at,
            claim.previous_expires_at,
            {
                **_attempt_attributes(claim, step),
                tracing.ATTEMPT: claim.attempt - 1,
                tracing.WORKER: claim.previous_owner,
                tracing.LEASE_TOKEN: None,
                tracing.OUTCOME: "worker_lost",
            },
            error="worker_lost",
            run_id=claim.run_id,
        )
    record_event(
        claim.run_id,
        "lease_takeover",
        step_id=step.step_id if step is not None else "",
        previous_owner=claim.previous_owner,
        token=claim.token,
        attempt=claim.attempt - 1,
        previous_claimed_at=_iso(claim.previous_claimed_at),
        previous_expires_at=_iso(claim.previous_expires_at),
    )


def _iso(moment: Any) -> str | None:
    return moment.isoformat() if moment is not None else None


def _fail_unrecorded(claim: Claim, step: Step, exc: Exception) -> Outcome:
    """The step's outcome could not be recorded (the database refused a value, or a bug): fail the step with
    that error, so the lease is released and the body does not re-run on every expiry."""
    error = PermanentError(f"the step's outcome could not be recorded: {type(exc).__name__}: {exc}")
    error.__cause__ = exc  # the bug's traceback is kept with the failure (retry.has_traceback)
    failure = classify(error, RetryPolicy(), step.step_id)
    logger.error(
        "run %s step %s: the step's outcome could not be recorded\n%s", claim.run_id, step.step_id, failure.traceback
    )
    try:
        return _fail(claim, step, failure, compensate=False)
    except LeaseLostError:
        return _rejected(claim, step)


def _advance(claim: Claim, step: Step, eager: Slice | None) -> Outcome:
    run = step.run
    log = run_logger("durable_agents.engine", run.id, step.step_id, claim.attempt)
    try:
        definition_set: Workflow | None = registry.get(run.workflow, run.workflow_version)
    except UnknownWorkflowError:
        definition_set = None
    if definition_set is None and replaying.is_replay(run):
        return _replay_ends(claim, step, f"workflow {run.workflow} version {run.workflow_version} is not deployed")
    if step.kind == StepKind.COMPENSATE:
        # A saga needs no workflow definition: it undoes effects through their tools, whatever was deployed.
        definition = COMPENSATION
        policy = definition_set.retry_policy(definition) if definition_set else RetryPolicy()
        compensate = False
    else:
        if definition_set is None:
            return _version_gone(claim, step, run)
        try:
            definition = _definition(definition_set, step)
        except (DefinitionError, UnknownToolError) as exc:
            if replaying.is_replay(run):
                return _replay_ends(claim, step, f"this version cannot execute step {step.name!r} ({exc})")
            # A plan element this version cannot execute (e.g. after a migration): an operator decides.
            return _park(claim, step, park_for_version(run, definition_set).spec)
        policy = definition_set.retry_policy(definition)
        compensate = definition_set.on_failure == "compensate"
    guarded = _guard(claim, step, policy, compensate)
    if guarded is not None:
        return guarded

    # A worker paused between its claim and the step (SIGSTOP, a GC storm, a slow receiver of the commit that made
    # the claim) may have been taken over: prove the lease again before running the step body, so a thawed zombie
    # stops here. Timed from the claim itself: one made by the previous commit is older than this call.
    if time.monotonic() - claim.taken > lease_seconds() / 3 and not renew_lease(claim):
        return _rejected(claim, step)
    log.debug("step start")
    with Heartbeat(claim) as beat:
        ctx = StepContext(run, step, claim.attempt, beat)
        try:
            value = _execute(definition, ctx)
            stored = store_result(run.id, step.step_id, value)
        except Park as park:
            # A replay run waits for no person; only for its model calls' Message Batch (replays.py).
            if replaying.is_replay(run) and park.spec.kind != WaitKind.BATCH:
                return _replayed_wait(claim, step, ctx, eager)
            return _park(claim, step, park.spec)
        except Rerun as rerun:
            return _redo(claim, step, rerun)
        except ExtendPlan as extension:
            return _extend(claim, step, extension)
        except LeaseLostError:
            raise
        except ModelUnavailableError as exc:
            if exc.capacity_wait:
                return _wait_for_capacity(claim, step, exc.retry_after)
            return _failed(claim, step, exc, policy, compensate, log)
        except Exception as exc:  # noqa: BLE001 - every failure is classified and persisted below
            return _failed(claim, step, exc, policy, compensate, log)
    return _commit(claim, step, stored, eager)


def _replay(step: Step) -> bool:
    """True for a step of a replay run, which sends no lifecycle signal (signals.py)."""
    return replaying.is_replay(step.run)


def _replayed_wait(claim: Claim, step: Step, ctx: StepContext, eager: Slice | None) -> Outcome:
    """A replay run's step asked for a person (a judge's `ask_human`): a replay opens no wait that could reach one.
    The step's recorded result answers, as the person did then; without one the replay ends there (diverged)."""
    try:
        stored = store_result(claim.run_id, step.step_id, replaying.recorded_step_result(ctx))
    except ReplayDivergedError as exc:
        return _replay_ends(claim, step, str(exc), recorded=True)
    return _commit(claim, step, stored, eager)


def _replay_ends(claim: Claim, step: Step, why: str, *, recorded: bool = False) -> Outcome:
    """The replay of this run cannot go on: it fails, diverged (a replay never parks for an operator)."""
    if not recorded:
        record_event(claim.run_id, replaying.DIVERGED, step_id=step.step_id, step=step.name, answered="stopped")
    message = why if recorded else f"{why}; the replay of this run ends here"
    failure = Failure(False, "ReplayDivergedError", message, step.step_id)
    return _fail(claim, step, failure, compensate=False)


def _failed(claim: Claim, step: Step, exc: Exception, policy: RetryPolicy, compensate: bool, log: Any) -> Outcome:
    """The step raised: classify and persist the failure — a retry after a backoff, or the step's failure."""
    failure = classify(exc, policy, step.step_id)
    # The stored traceback, not exc_info: the log gets the same redacted, bounded text as the run.
    if failure.traceback:
        log.warning("step error %s: %s\n%s", failure.type, failure.message, failure.traceback)
    else:
        log.warning("step error %s: %s", failure.type, failure.message)
    if failure.transient and claim.attempt < policy.attempts_allowed:
        return _retry(claim, step, failure, _delay(policy, claim.attempt, failure))
    return _fail(claim, step, failure, compensate=compensate)


def _wait_for_capacity(claim: Claim, step: Step, seconds: float | None) -> Outcome:
    """A shared limit (the model's rate limit) has no room for `seconds`: the run waits without a worker. Nothing
    failed, so the attempt is given back (a long queue never exhausts the step's retries or trips the crash-loop
    guard) and no jitter is added: the limiter's time is exact, and its queue orders the callers."""
    cap = float(settings.RETRY_AFTER_MAX_SECONDS)
    delay = cap if seconds is None or not math.isfinite(seconds) else min(max(seconds, 0.0), cap)
    wake_at = DbNow(timedelta(seconds=delay))
    with transaction.atomic():
        transitions.hold_txn(claim, wake_at=wake_at, attempt=claim.attempt - 1, **transitions.RELEASED)
        record_event(claim.run_id, "capacity_wait", step_id=step.step_id, seconds=round(delay, 3))
        wake_on_commit(claim.run_id, countdown=delay)  # a long one sends nothing: the sweep wakes the run (wake.py)
        stopping = _cancel_pending(claim.run_id)
    return _settled(settle_cancellation(claim.run_id), otherwise=Outcome.RETRY) if stopping else Outcome.RETRY


def _cancel_pending(run_id: uuid.UUID) -> bool:
    """After a step released the run to wait (a retry's backoff, the limiter's capacity): a cancel requested while
    it ran is settled now, not when the wait is over — the step it waited for has ended."""
    return Run.objects.filter(pk=run_id).exclude(cancel_requested_at=None).exists()


def _delay(policy: RetryPolicy, attempt: int, failure: Failure) -> float:
    """The backoff before the next attempt: the policy's (jittered), or longer if the service asked
    (`retry-after`): never sooner than asked, spread over a random share of it (RETRY_AFTER_JITTER) so the
    runs one 429 answered do not return together, and capped so one answer cannot park a run for hours
    (RETRY_AFTER_MAX_SECONDS; resume clears it)."""
    asked = failure.retry_after
    if asked is None or math.isnan(asked) or asked <= 0:
        return policy.delay(attempt)
    cap = float(settings.RETRY_AFTER_MAX_SECONDS)
    jitter = float(settings.RETRY_AFTER_JITTER)
    if not math.isfinite(jitter) or jitter < 0:
        jitter = 0.0
    wait = asked + asked * random.uniform(0.0, jitter) if math.isfinite(asked) else cap
    if not math.isfinite(wait):  # inf * 0, or an overflow
        wait = cap
    return max(policy.delay(attempt), min(wait, cap))


def _definition(definition_set: Workflow, step: Step) -> StepDef:
    """What executes this plan element: the workflow's definition, or a planned tool call."""
    if is_planned(step.name):
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
        return _fail(claim, step, failure, compensate=compensate)
    if step.depends_on:
        stale = find_stale(claim.run_id, step.depends_on, claim.claimed_at)
        if stale is not None:
            return _replan(claim, step, stale, compensate)
    return None


def _execute(definition: StepDef, ctx: StepContext) -> Any:
    if replaying.is_replay(ctx.run) and definition.kind not in replaying.MODEL_KINDS:
        return replaying.recorded_step_result(ctx)
    if definition.fn is None:
        raise PermanentError(f"step {definition.name!r} of {ctx.run.workflow} has nothing to execute")
    return definition.fn(ctx)


def _commit(claim: Claim, step: Step, stored: Any, eager: Slice | None) -> Outcome:
    last = claim.cursor + 1 >= claim.step_count
    if eager is not None and not last and eager.is_open() and transitions.claims_on_commit():
        return _commit_and_claim(claim, step, stored, eager)
    following = eager.batch.next_to_claim() if eager is not None and eager.batch is not None and last else None
    if following is not None and following != claim.run_id and transitions.claims_on_commit():
        committed = _commit_and_claim_next(claim, step, stored, eager, following)
    else:
        # On Postgres one autocommit statement: no BEGIN/COMMIT round trips on the hot path.
        committed = transitions.checkpoint(claim, step, stored, final=last)
    if committed is transitions.Committed.LOST:
        raise LeaseLostError()
    # Outside a transaction these are sent now, after the commit.
    send_on_commit(
        step_committed, run_id=claim.run_id, step_id=step.step_id, attempt=claim.attempt, replay=_replay(step)
    )
    if committed is transitions.Committed.FINISHED:
        ending = claim.finish_as or RunStatus.COMPLETED
        # The parent is loaded with the claim: telling it costs no read.
        send_on_commit(
            run_finished,
            run_id=claim.run_id,
            status=ending,
            error=None,
            parent_id=step.run.parent_id,
            replay=_replay(step),
        )
        admit_on_commit(step.run.concurrency_key)
        return Outcome.COMPLETED
    if last:
        # The last step committed while a cancel was requested: settle it now (its saga, if asked).
        return _settled(settle_cancellation(claim.run_id), otherwise=Outcome.COMMITTED)
    if eager is None:
        wake(claim.run_id)
    else:
        eager.hand_on(claim.run_id)
    return Outcome.COMMITTED


def _commit_and_claim_next(
    claim: Claim, step: Step, stored: Any, eager: Slice, following: uuid.UUID
) -> transitions.Committed:
    """A run's last step in a batch: one statement commits it and claims the batch's next run for this task (made
    only if the commit was written; refused, the next run claims for itself)."""
    assert eager.batch is not None
    model_bound, plain = eager.runs()
    committed, claimed = transitions.checkpoint_and_claim_next(
        claim, step, stored, following, model_bound=model_bound, plain=plain
    )
    if claimed is not None:
        eager.batch.claimed(following, claimed)
    return committed


def _commit_and_claim(claim: Claim, step: Step, stored: Any, eager: Slice) -> Outcome:
    """A step the slice may go on from: one statement commits it and claims the next step for this task; a claim
    refused (a cancel requested meanwhile) is followed as a refused claim of its own would be (engine/eager.py)."""
    model_bound, plain = eager.runs()
    try:
        onward = transitions.checkpoint_and_claim(claim, step, stored, model_bound=model_bound, plain=plain)
    except (OperationalError, InterfaceError):
        # The answer is lost with the connection: the step may be committed with no wake-up sent for the next.
        wake(claim.run_id)
        raise
    if onward.committed is transitions.Committed.LOST:
        raise LeaseLostError()
    send_on_commit(
        step_committed, run_id=claim.run_id, step_id=step.step_id, attempt=claim.attempt, replay=_replay(step)
    )
    eager.carry_on(claim.run_id, onward.claimed, onward.kind)
    return Outcome.COMMITTED


def _finish_empty(claim: Claim) -> Outcome:
    """Nothing left in the plan: the run ends — unless a cancel is pending, which is settled instead."""
    committed = transitions.finish_empty(claim)
    if committed is transitions.Committed.FINISHED:
        ending = claim.finish_as or RunStatus.COMPLETED
        parent_id, key, lane = (
            Run.objects.filter(pk=claim.run_id).values_list("parent_id", "concurrency_key", "replay_lane").first()
        )
        send_on_commit(
            run_finished, run_id=claim.run_id, status=ending, error=None, parent_id=parent_id, replay=bool(lane)
        )
        admit_on_commit(key)
        return Outcome.COMPLETED
    if committed is transitions.Committed.CHECKPOINTED:
        return _settled(settle_cancellation(claim.run_id), otherwise=Outcome.COMMITTED)
    return Outcome.LEASE_LOST


def _settled(done: transitions.Cancellation, otherwise: Outcome = Outcome.SKIPPED) -> Outcome:
    if done is transitions.Cancellation.COMPENSATING:
        return Outcome.COMPENSATING
    return Outcome.CANCELLED if done is transitions.Cancellation.CANCELLED else otherwise


def _retry(claim: Claim, step: Step, failure: Failure, delay: float) -> Outcome:
    error = failure.as_error()
    wake_at = DbNow(timedelta(seconds=delay))
    with transaction.atomic():
        transitions.hold_txn(claim, wake_at=wake_at, **transitions.RELEASED)
        Step.objects.filter(pk=step.pk).update(
            error=error,
            attempts=claim.attempt,
            next_attempt_at=wake_at,
            started_at=claim.claimed_at,
            updated_at=DbNow(),
        )
        record_event(
            claim.run_id,
            "step_retry",
            step_id=step.step_id,
            attempt=claim.attempt,
            started_at=_iso(claim.claimed_at),
            delay_seconds=round(delay, 3),
            error=error,
        )
        send_on_commit(
            step_retried,
            run_id=claim.run_id,
            step_id=step.step_id,
            attempt=claim.attempt,
            error=error,
            delay_seconds=delay,
            replay=_replay(step),
        )
        # A short backoff rides a countdown; a long one sends nothing, the sweep wakes the run at wake_at (wake.py).
        wake_on_commit(claim.run_id, countdown=delay)
        stopping = _cancel_pending(claim.run_id)
    return _settled(settle_cancellation(claim.run_id), otherwise=Outcome.RETRY) if stopping else Outcome.RETRY


def _fail(claim: Claim, step: Step, failure: Failure, *, compensate: bool) -> Outcome:
    """Fail the step; the run fails too, or first compensates its applied effects if the workflow says so.

    A compensation step that fails stops the saga visibly: the run fails saying what is left to undo.
    """
    error = failure.as_error()
    if claim.finish_as:
        left = _left_to_undo(claim.run_id, step)
        error = {
            **error,
            "message": f"{error['message']} — compensation stopped; left to undo: "
            f"{', '.join(left) or 'nothing'} (resume the run once this is fixed)",
            "left_to_undo": left,
        }
    # A spent budget stops the run resumable: undoing its effects would make "raise and resume" moot.
    undo = compensate and not claim.finish_as and failure.type != "BudgetExceededError"
    with transaction.atomic():
        compensating = transitions.fail_txn(claim.run_id, step.pk, error, claim=claim, compensate=undo)
        Step.objects.filter(pk=step.pk).update(attempts=claim.attempt, started_at=claim.claimed_at)
        record_event(
            claim.run_id,
            "failed",
            step_id=step.step_id,
            attempt=claim.attempt,
            started_at=_iso(claim.claimed_at),
            error=error,
        )
        send_on_commit(
            step_failed,
            run_id=claim.run_id,
            step_id=step.step_id,
            attempt=claim.attempt,
            error=error,
            replay=_replay(step),
        )
        if compensating:
            wake_on_commit(claim.run_id)
        else:
            send_on_commit(
                run_finished,
                run_id=claim.run_id,
                status=RunStatus.FAILED,
                error=error,
                parent_id=step.run.parent_id,
                replay=_replay(step),
            )
            admit_on_commit(step.run.concurrency_key)
    return Outcome.COMPENSATING if compensating else Outcome.FAILED


def _left_to_undo(run_id: Any, failed: Step) -> list[str]:
    """The effects a stopped saga did not undo: its compensation steps from the failed one on."""
    steps = Step.objects.live().filter(run_id=run_id, kind=StepKind.COMPENSATE, position__gte=failed.position)
    return [s.args.get("effect", "") for s in steps.exclude(status=StepStatus.DONE).order_by("position")]


def _park(claim: Claim, step: Step, spec: WaitSpec) -> Outcome:
    """Release the run into `waiting` and open its wait, in one fenced transaction; nothing wakes it but
    a decision, a signal, its children or the sweep."""
    with transaction.atomic():
        wait = park_txn(claim, step, spec)
        if spec.kind == WaitKind.CHILDREN and wait.is_open:
            # A child that finished after the step counted, before this wait existed, had no wait to close.
            join_if_ready_txn(wait)
    if spec.kind == WaitKind.CHILDREN and _cancel_pending(claim.run_id):
        # Cancelled while it started its children: stop now (and its children with it), not at the next sweep.
        return _settled(settle_cancellation(claim.run_id), otherwise=Outcome.WAITING)
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
        return _fail(claim, step, failure, compensate=compensate)
    with transaction.atomic():
        transitions.hold_txn(claim, cursor=stale.position, attempt=0, **transitions.RELEASED)
        replan_txn(claim.run_id, stale, because_of=step.step_id)
    return Outcome.REPLANNED


def _redo(claim: Claim, step: Step, rerun: Rerun) -> Outcome:
    """Checkpoint the step that asked for a redo (its verdict stays as history), then go back."""
    target = redo_target(claim.run_id, rerun)
    with transaction.atomic():
        transitions.hold_txn(claim, cursor=target.position, attempt=0, **transitions.RELEASED)
        transitions.commit_step_txn(step.pk, result=rerun.result, attempts=claim.attempt, started_at=claim.claimed_at)
        redo_txn(claim.run_id, rerun, target, from_step=step.step_id)
    return Outcome.REPLANNED


def _version_gone(claim: Claim, step: Step, run: Run) -> Outcome:
    """The run's version is no longer registered: follow the newest version's declared policy."""
    try:
        newest, policy = missing_version(run, step)
        if policy == "park":
            raise park_for_version(run, newest)
    except Park as park:
        return _park(claim, step, park.spec)
    with transaction.atomic():
        transitions.hold_txn(claim, **transitions.RELEASED)
        adopt_version_txn(claim.run_id, newest, replan=policy == "replan", actor="engine")
        wake_on_commit(claim.run_id)
    return Outcome.REPLANNED


def _extend(claim: Claim, step: Step, extension: ExtendPlan) -> Outcome:
    """Checkpoint a planner and put its validated plan right after it (replacing an earlier plan of it)."""
    rows = extension.rows
    own = Step.objects.live().filter(
        run_id=claim.run_id, status=StepStatus.PENDING, step_id__startswith=f"{step.step_id}."
    )
    with transaction.atomic():
        following = list(
            Step.objects.live()
            .filter(run_id=claim.run_id, position__gt=step.position)
            .exclude(pk__in=own.values("pk"))
            .order_by("position")
        )
        end = step.position + 1 + len(rows) + len(following)
        transitions.hold_txn(claim, cursor=step.position + 1, step_count=end, attempt=0, **transitions.RELEASED)
        transitions.move_steps_txn(StepOp.SUPERSEDE, own, to=StepStatus.SUPERSEDED)
        transitions.commit_step_txn(
            step.pk, result=extension.result, attempts=claim.attempt, started_at=claim.claimed_at
        )
        # Two passes: positions are unique among live steps, so move the tail out of the way first.
        Step.objects.filter(pk__in=[s.pk for s in following]).update(position=F("position") + 1_000_000)
        for offset, later in enumerate(following):
            Step.objects.filter(pk=later.pk).update(position=step.position + 1 + len(rows) + offset)
        observations = list(
            Step.objects.live()
            .filter(run_id=claim.run_id, position__lt=step.position, status=StepStatus.DONE)
            .exclude(fresh_for=None)
            .values_list("step_id", flat=True)
        )
        Step.objects.bulk_create(
            Step(
                run_id=claim.run_id,
                step_id=row.step_id,
                name=row.name,
                kind=StepKind.TOOL,
                position=step.position + 1 + i,
                args=dict(row.args),
                depends_on=observations,
                fresh_for=row.fresh_for,
            )
            for i, row in enumerate(rows)
        )
        record_event(claim.run_id, "planned", step_id=step.step_id, steps=[r.step_id for r in rows])
        wake_on_commit(claim.run_id)
    return Outcome.COMMITTED


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


__all__ = ["Outcome", "advance", "advance_slice"]
