"""The only writer of statuses: every run, step, wait and effect changes status here, and only here.

Each function performs operations of the tables in `durable_agents.states` as compare-and-set UPDATEs
(`WHERE status IN <sources>`), fenced — by the lease token of the worker that holds the run, or by the
lease being free (no worker holds it) — and timed on the database's clock (`clock.DbNow`). 0 rows is
an answer, never ignored: LeaseLostError for a fenced write (the writer is a zombie), False otherwise.
Functions ending in `_txn` run inside the caller's transaction (they check), so an operation's other
writes (events, checkpoints, waits) commit with it or not at all.

The step loop's claim is one `UPDATE ... RETURNING` statement (`hotpath.py`; with the step's load on
Postgres), its checkpoint one statement on Postgres and an ORM transaction here on other databases; both are
built from the same rules, and so is the eager slice's checkpoint that claims the next step in the same
statement. A test fails if any other module writes a status.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any

from django.db import connection, transaction
from django.db.models import Case, Exists, F, Q, QuerySet, When
from django.db.models.functions import Coalesce

from durable_agents import clock, tracing
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.engine import hotpath
from durable_agents.engine.control import WaitSpec
from durable_agents.engine.events import record_event
from durable_agents.engine.lease import Claim, lease_seconds, worker_id
from durable_agents.engine.payloads import StoredResult
from durable_agents.engine.reliance import plan_saga
from durable_agents.engine.wake import queue_for
from durable_agents.errors import LeaseLostError
from durable_agents.models import BatchTurn, Effect, MessageBatch, Run, Step, StepKind, Wait
from durable_agents.states import (
    ACTIVE_RUN_STATUSES,
    BATCH_TURN_RULES,
    EFFECT_RULES,
    FINISHED_RUN_STATUSES,
    MESSAGE_BATCH_RULES,
    RUN_RULES,
    SAGA_ENDINGS,
    STEP_RULES,
    WAIT_RULES,
    BatchTurnOp,
    BatchTurnStatus,
    EffectOp,
    MessageBatchOp,
    RunOp,
    RunStatus,
    StepOp,
    StepStatus,
    WaitOp,
    WaitStatus,
)

COMPENSATE_STEP = "compensate"


def _in_transaction() -> None:
    assert connection.in_atomic_block, "a *_txn transition must run inside transaction.atomic()"


def _target(rules: Any, op: Any, to: str | None) -> dict[str, Any]:
    rule = rules[op]
    if not rule.allows(to):
        raise AssertionError(f"operation {op!r} may not leave status {to!r} (allowed: {sorted(rule.targets)})")
    return {"status": to} if to is not None else {}


def lease_free() -> Q:
    """No worker holds the run: its lease is released or expired, on the database's clock."""
    return Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=DbNow())


RELEASED = {"lease_owner": "", "lease_expires_at": None}


# --- Runs -------------------------------------------------------------------------------------------------


def move_run(op: RunOp, run_id: Any, *, to: str | None = None, where: Q | None = None, **changes: Any) -> bool:
    """One compare-and-set UPDATE of a run for `op`; True if it moved. `where` adds the fence."""
    status = _target(RUN_RULES, op, to)
    runs = Run.objects.filter(where or Q(), pk=run_id, status__unindexed__in=RUN_RULES[op].sources)
    return runs.update(**status, updated_at=DbNow(), **changes) == 1


def hold_txn(claim: Claim, op: RunOp = RunOp.CHECKPOINT, *, to: str | None = None, **changes: Any) -> None:
    """Inside a transaction: apply `op` to the run only while `claim` still holds it, else LeaseLostError.

    The first write of every fenced transaction: a zombie's raises before writing anything else.
    """
    _in_transaction()
    if not move_run(op, claim.run_id, to=to, where=Q(lease_token=claim.token), **changes):
        raise LeaseLostError(f"run {claim.run_id} is no longer held by token {claim.token}")


def holds_txn(run_id: Any, token: int) -> bool:
    """True while `token` still holds the running run; its row stays locked until the transaction ends, so nothing
    takes the run over before what the holder writes next commits."""
    _in_transaction()
    return (
        Run.objects.select_for_update()
        .filter(pk=run_id, lease_token=token, status__unindexed=RunStatus.RUNNING)
        .exists()
    )


def take_txn(op: RunOp, run_id: Any, *, to: str | None = None, where: Q | None = None, **changes: Any) -> bool:
    """Take a run no worker holds for an operator's `op`: bump the token (fencing any zombie), release the
    lease, clear a pending wake-up. False if a worker holds it or its status does not allow `op`."""
    _in_transaction()
    fence = lease_free() & (where or Q())
    bump = {"lease_token": F("lease_token") + 1, "wake_at": None, **RELEASED}
    return move_run(op, run_id, to=to, where=fence, **bump, **changes)


def claim_run(run_id: uuid.UUID, *, model_bound: bool = False) -> tuple[Claim, Step | None] | None:
    """Take the run's lease (new fencing token) iff it is runnable, due, not being cancelled, and its lease is
    free; with the step under its cursor. One statement on Postgres; None: a duplicate, or not claimable.
    `model_bound`: only if the run is one the model queue's worker serves (wake.queue_for), else None."""
    lease = timedelta(seconds=lease_seconds())
    if hotpath.is_available():
        # As wake.queue_for routes: a replay run to REPLAY_QUEUE (if set) whatever its step, which may be this queue.
        replay_queue = settings.REPLAY_QUEUE
        return hotpath.claim_and_load(
            run_id,
            worker_id(),
            lease,
            model_bound=model_bound,
            replay_queue=bool(replay_queue),
            replay_here=bool(replay_queue) and replay_queue == settings.MODEL_QUEUE,
        )
    if model_bound and queue_for(run_id) != settings.MODEL_QUEUE:
        return None
    claim = hotpath.claim(run_id, worker_id(), lease)
    if claim is None:
        return None
    step = (
        Step.objects.select_related("run").live().filter(run_id=run_id, position=claim.cursor).order_by().first()
        if claim.cursor < claim.step_count
        else None
    )
    return claim, step


class Committed(StrEnum):
    """What a checkpoint did."""

    LOST = "lost"  # the token no longer holds the run (or the step is no longer live): nothing was written
    CHECKPOINTED = "checkpointed"  # the step's checkpoint, the cursor moved on, the lease released
    FINISHED = "finished"  # ... and it was the last step: the run completed (or ended as its saga said)


def checkpoint(claim: Claim, step: Step, stored: StoredResult, *, final: bool) -> Committed:
    """Commit a step: its checkpoint, the cursor, the lease released (and the run finished if `final`), in one
    transaction fenced by the token. A last step committed while a cancel is requested does not complete
    the run: it is checkpointed, and the cancellation is settled next (with its compensation, if asked)."""
    ending = _ending(claim) if final else None
    if hotpath.is_available():
        return Committed(hotpath.commit_checkpoint(claim, step, stored, ending=ending))
    changes: dict[str, Any] = {"cursor": claim.cursor + 1, "attempt": 0, **RELEASED}
    # Fenced on the plan's shape the claim saw too: "last step" means last of the plan as it still is.
    shape = Q(cursor=claim.cursor, step_count=claim.step_count)
    try:
        with transaction.atomic():
            finished = ending is not None and move_run(
                _ending_op(ending),
                claim.run_id,
                to=ending,
                where=shape & Q(lease_token=claim.token, cancel_requested_at__isnull=True),
                # A run that compensated ends cancelled or failed: it has no output.
                output=None if claim.finish_as else stored.public_value,
                finished_at=DbNow(),
                **changes,
            )
            if not finished and not move_run(
                RunOp.CHECKPOINT, claim.run_id, where=shape & Q(lease_token=claim.token), **changes
            ):
                raise LeaseLostError(f"run {claim.run_id} is no longer held by token {claim.token} at its cursor")
            commit_step_txn(
                step.pk,
                result=stored.inline,
                result_ref=stored.ref,
                result_hash=stored.sha256,
                error=None,
                attempts=claim.attempt,
                started_at=claim.claimed_at,
                # An observation is as old as the moment the step started looking.
                observed_at=claim.claimed_at if step.fresh_for else None,
            )
    except LeaseLostError:
        return Committed.LOST
    return Committed.FINISHED if finished else Committed.CHECKPOINTED


def checkpoint_and_claim_next(
    claim: Claim, step: Step, stored: StoredResult, next_id: uuid.UUID, *, model_bound: bool, plain: bool
) -> tuple[Committed, tuple[Claim, Step | None] | None]:
    """Commit a run's last step as `checkpoint(final=True)` does and, in the same statement, claim run `next_id`
    (the next of the caller's batch) as `claim_run` would right after — only if the commit was written, the run
    is claimable, its row unlocked and its step one the caller runs (`model_bound`, `plain`). LOST writes nothing
    and claims nothing. Postgres only (`claims_on_commit`)."""
    lease = timedelta(seconds=lease_seconds())
    committed, claimed = hotpath.commit_and_claim_next(
        claim, step, stored, _ending(claim), next_id, worker_id(), lease, model_bound=model_bound, plain=plain
    )
    return Committed(committed), claimed


def claims_on_commit() -> bool:
    """True where `checkpoint_and_claim` commits a step and claims the next in one statement (Postgres)."""
    return hotpath.is_available()


@dataclass(frozen=True)
class Onward:
    """What `checkpoint_and_claim` did: the commit; the next step's claim (and load) if it was made; the next
    step's kind (None: no step under the cursor), which names its queue when the claim was not made."""

    committed: Committed
    claimed: tuple[Claim, Step | None] | None = None
    kind: str | None = None


def checkpoint_and_claim(claim: Claim, step: Step, stored: StoredResult, *, model_bound: bool, plain: bool) -> Onward:
    """Commit a step that is not the run's last as `checkpoint` does and, in the same statement, claim the run
    for its next step as `claim_run` would right after — if the next step is one the caller runs (model-bound:
    `model_bound`, any other: `plain`). A claim refused (a cancel requested meanwhile, a step for another queue)
    leaves the run exactly as `checkpoint` does; LOST writes nothing. Postgres only (`claims_on_commit`)."""
    lease = timedelta(seconds=lease_seconds())
    committed, claimed, kind = hotpath.commit_and_claim(
        claim, step, stored, worker_id(), lease, model_bound=model_bound, plain=plain
    )
    return Onward(Committed(committed), claimed, kind)


def _ending(claim: Claim) -> str:
    return claim.finish_as or RunStatus.COMPLETED


def finish_empty(claim: Claim) -> Committed:
    """A plan with nothing left: the run completes (or ends as its saga said), fenced by the token, by the plan's
    end and by a pending cancel request (then the lease is released and the cancellation is settled next)."""
    ending = _ending(claim)
    fence = Q(lease_token=claim.token, cursor__gte=F("step_count"))
    with transaction.atomic():
        if move_run(
            _ending_op(ending),
            claim.run_id,
            to=ending,
            where=fence & Q(cancel_requested_at__isnull=True),
            attempt=0,
            finished_at=DbNow(),
            **RELEASED,
        ):
            return Committed.FINISHED
        if move_run(RunOp.CHECKPOINT, claim.run_id, where=fence, attempt=0, **RELEASED):
            return Committed.CHECKPOINTED
    return Committed.LOST


def _ending_op(ending: str) -> RunOp:
    return RunOp.COMPLETE if ending == RunStatus.COMPLETED else RunOp.FINISH


def park_txn(claim: Claim, step: Step, spec: WaitSpec, *, notify_to: Iterable[str]) -> tuple[Wait, bool]:
    """Release the run into `waiting` and open its wait; (wait, opened). A signal that arrived while the
    step was parking wakes the run at once instead (opened False)."""
    hold_txn(claim, RunOp.PARK, to=RunStatus.WAITING, attempt=0, **RELEASED)
    existing = Wait.objects.open().filter(run_id=claim.run_id).first()
    if existing is not None:
        return existing, False
    if spec.kind == "signal":
        arrived = bind_buffered_signal(step, spec.name)
        if arrived is not None:
            wake_txn(claim.run_id)
            return arrived, False
    if spec.kind == "batch" and batch_turn_ended(spec.name):
        # Its answer came in while the step was parking (the batcher locks the run's row, as this UPDATE did):
        # go on at once; nobody else would wake the run.
        wake_txn(claim.run_id)
        return Wait(run_id=claim.run_id, step=step, kind=spec.kind, name=spec.name, status=WaitStatus.APPROVED), False
    wait = Wait.objects.create(
        run_id=claim.run_id,
        step=step,
        kind=spec.kind,
        name=spec.name,
        effect_key=spec.effect_key,
        args_hash=spec.args_hash,
        question=spec.question,
        brief=spec.brief,
        deadline=spec.deadline,
        on_deadline=spec.on_deadline,
        escalate_to=spec.escalate_to,
        warn_before=spec.warn_before,
        remind_every=spec.remind_every,
        next_reminder_at=clock.now() + spec.remind_every if spec.remind_every else None,
        notify_to=list(notify_to),
        link_nonce=secrets.token_hex(8),
    )
    move_steps_txn(StepOp.PARK, Step.objects.filter(pk=step.pk), to=StepStatus.WAITING)
    return wait, True


def wake_txn(run_id: Any) -> bool:
    """A waiting run's wait closed: it becomes runnable (the caller wakes a worker on commit)."""
    _in_transaction()
    return move_run(RunOp.WAKE, run_id, to=RunStatus.PENDING, attempt=0)


def fail_txn(run_id: Any, step_pk: int | None, error: dict[str, Any], *, claim: Claim | None, compensate: bool) -> bool:
    """Fail a step and its run — fenced by `claim`, or (no claim) a waiting run whose deadline failed it.

    With `compensate` (and effects to undo) the run compensates first and ends failed; returns True then.
    LeaseLostError if the claim no longer holds the run; False if a waiting run is no longer waiting.
    """
    _in_transaction()
    fence = Q(lease_token=claim.token) if claim else Q(status__unindexed=RunStatus.WAITING)
    # The fence first, under the run's row lock: nothing of a failure is written for a run no longer held.
    run = Run.objects.select_for_update().filter(fence, pk=run_id).values("cancel_compensate", "finish_as").first()
    if run is None:
        if claim is not None:
            raise LeaseLostError(f"run {run_id} is no longer held by token {claim.token}")
        return False
    if step_pk is not None:
        move_steps_txn(
            StepOp.FAIL, Step.objects.filter(pk=step_pk), to=StepStatus.FAILED, error=error, finished_at=DbNow()
        )
    # Failing settles any cancel request: the run stops either way (with the saga asked for, below).
    fields = {
        "error": error,
        "lease_token": F("lease_token") + 1,
        "attempt": 0,
        "cancel_requested_at": None,
        "cancel_compensate": False,
        **RELEASED,
    }
    # An operator asked to cancel with compensation while the step ran: that saga, now that it failed.
    asked = run["cancel_compensate"] and not run["finish_as"]
    ending = RunStatus.CANCELLED if asked else RunStatus.FAILED
    if compensate or asked:
        fields["family_undo"] = True  # its children's effects are undone too (family.py), whatever it had itself
    saga = compensate_txn(run_id, finish_as=ending, where=fence, **fields) if compensate or asked else Saga()
    if saga.planned:
        return True
    if saga.kept:
        fields["finish_as"] = saga.ends_as(ending)  # it let go of its effects: its saga is over
    moved = move_run(RunOp.FAIL, run_id, to=RunStatus.FAILED, where=fence, finished_at=DbNow(), **fields)
    assert moved, "the run row is locked by this transaction"
    return False


@dataclass(frozen=True)
class Saga:
    """What starting a saga did: compensation steps planned, and effects kept for runs still standing on them."""

    planned: int = 0
    kept: int = 0

    def ends_as(self, ending: str) -> str:
        """`finish_as` for a run that ends without compensation steps: a run that kept effects for others let
        go of them, so it no longer stands on them (the last run to let go undoes them)."""
        return ending if self.kept else ""


def compensate_txn(run_id: Any, *, finish_as: str, where: Q, op: RunOp = RunOp.COMPENSATE, **fields: Any) -> Saga:
    """Start a saga: skip the run's remaining steps and append one compensation step per effect to undo,
    newest first — applied effects, and external effects whose outcome is unknown (invoked, no outcome
    recorded: the compensation step learns it first). With nothing to undo no step is planned; effects kept
    for runs still standing on them are recorded (`compensation_kept`) and the caller ends the run letting go
    of them (`Saga.ends_as`).
    """
    _in_transaction()
    assert finish_as in SAGA_ENDINGS, f"a saga ends {SAGA_ENDINGS}, not {finish_as!r}"
    run = Run.objects.select_for_update().filter(where, pk=run_id).only("id", "cursor", "step_count").first()
    if run is None:
        return Saga()
    plan = plan_saga(run_id)
    if plan.kept:
        # Never silently: the effects another run still stands on stay, and the history says why.
        record_event(run_id, "compensation_kept", effects=plan.kept)
    keys = plan.undo
    if not keys:
        return Saga(kept=len(plan.kept))
    move_steps_txn(
        StepOp.SKIP,
        Step.objects.live().filter(run_id=run_id, position__gte=run.cursor, status=StepStatus.PENDING),
        to=StepStatus.SKIPPED,
    )
    Step.objects.bulk_create(
        Step(
            run_id=run_id,
            step_id=f"compensate-{i}",
            name=COMPENSATE_STEP,
            kind=StepKind.COMPENSATE,
            position=run.step_count + i - 1,
            args={"effect": key},
        )
        for i, key in enumerate(keys, start=1)
    )
    moved = move_run(
        op,
        run_id,
        to=RunStatus.PENDING,
        where=where,
        cursor=run.step_count,
        step_count=F("step_count") + len(keys),
        finish_as=finish_as,
        # A saga settles any cancel request: the claim refuses runs with one pending, and none may cut it short.
        # Its children's effects are undone too (family.py).
        **{"attempt": 0, "cancel_requested_at": None, "cancel_compensate": False, "family_undo": True, **fields},
    )
    assert moved, "the run row is locked by this transaction"
    record_event(run_id, "compensation_planned", finish_as=finish_as, effects=keys)
    return Saga(planned=len(keys), kept=len(plan.kept))


def reopen_saga_txn(run_id: Any, key: str) -> bool:
    """An effect learned applied after its run's saga passed it (an operator recorded its outcome late): plan
    its compensation after the others and, if the saga had ended, let the run go on compensating. Only for a
    run no worker holds; its token is bumped, so a paused worker's late commit cannot end the saga early."""
    _in_transaction()
    run = Run.objects.select_for_update().filter(lease_free(), pk=run_id).exclude(finish_as="").first()
    if run is None:
        return False
    sagas = Step.objects.live().filter(run_id=run_id, kind=StepKind.COMPENSATE)
    if sagas.filter(args__effect=key).exclude(status=StepStatus.DONE).exists():
        return False  # its compensation step is still to run: it undoes the effect now that it is applied
    more: dict[str, Any] = {"step_count": F("step_count") + 1}
    cursor = run.cursor
    if not sagas.exists():
        # It let go of its effects without compensation steps (all kept for others): its forward plan is over.
        move_steps_txn(
            StepOp.SKIP,
            Step.objects.live().filter(run_id=run_id, position__gte=run.cursor, status=StepStatus.PENDING),
            to=StepStatus.SKIPPED,
        )
        more["cursor"] = cursor = run.step_count
    Step.objects.create(
        run_id=run_id,
        step_id=f"compensate-{sagas.count() + 1}",
        name=COMPENSATE_STEP,
        kind=StepKind.COMPENSATE,
        position=run.step_count,
        args={"effect": key},
    )
    if run.status in RUN_RULES[RunOp.RESUME].sources:
        resumed = resume_txn(run_id, from_status=run.status, cursor=cursor, **more)
    else:
        resumed = take_txn(RunOp.TAKE, run_id, **more)
    assert resumed, "the run row is locked by this transaction and no worker holds it"
    record_event(run_id, "compensation_reopened", effects=[key])
    return True


# --- Operators: cancel, resume, rerun, take --------------------------------------------------------------


class Cancellation(StrEnum):
    """What a cancel did."""

    NONE = ""  # nothing: the run is finished
    CANCELLED = "cancelled"  # stopped now
    COMPENSATING = "compensating"  # a saga started now
    SAGA_GOES_ON = "saga_goes_on"  # the run was compensating already: nothing changed
    REQUESTED = "requested"  # a worker holds the run: it stops after its step


def cancel_txn(run_id: Any, *, reason: str, compensate: bool) -> Cancellation:
    """Cancel a run: stop it now if no worker holds it, or ask its holder to stop after the step.

    A run that is compensating is never cut short: its saga goes on and ends as it said (a second cancel,
    a double submit, a bulk cancel or a colleague's changes nothing). With `compensate`, a saga starts now.
    """
    _in_transaction()
    row = Run.objects.select_for_update().filter(pk=run_id).values("status", "finish_as", "cancel_compensate").first()
    if row is None or row["status"] not in RUN_RULES[RunOp.CANCEL].sources:
        return Cancellation.NONE
    if row["finish_as"]:
        return Cancellation.SAGA_GOES_ON
    # A compensation asked for once stays asked for: a later plain cancel never drops it.
    compensate = compensate or row["cancel_compensate"]
    stop = {"cancel_reason": reason, "cancel_requested_at": None, "cancel_compensate": False}
    saga = _start_saga_txn(run_id, RunStatus.CANCELLED, stop) if compensate else Saga()
    if saga.planned:
        return Cancellation.COMPENSATING
    ending = _saga_ending(compensate)
    if take_txn(
        RunOp.CANCEL, run_id, to=RunStatus.CANCELLED, where=Q(finish_as=""), finished_at=DbNow(), **stop, **ending
    ):
        cancel_open_waits_txn(run_id)
        return Cancellation.CANCELLED
    # A worker holds it: the step finishes and commits, then the cancellation is settled (`compensate`
    # already includes a compensation asked for earlier).
    move_run(
        RunOp.REQUEST_CANCEL,
        run_id,
        where=Q(finish_as=""),
        cancel_requested_at=Coalesce(F("cancel_requested_at"), DbNow()),
        cancel_reason=reason,
        cancel_compensate=compensate,
    )
    return Cancellation.REQUESTED


def settle_cancellation_txn(run_id: Any) -> Cancellation:
    """Finish a requested cancellation once no worker holds the run."""
    _in_transaction()
    row = (
        Run.objects.select_for_update()
        .filter(lease_free(), pk=run_id, status__unindexed__in=RUN_RULES[RunOp.CANCEL].sources)
        .exclude(cancel_requested_at=None)
        .values("cancel_compensate", "cancel_reason")
        .first()
    )
    if row is None:
        return Cancellation.NONE
    stop = {"cancel_requested_at": None, "cancel_compensate": False}
    if move_run(RunOp.TAKE, run_id, where=~Q(finish_as=""), **stop):
        return Cancellation.SAGA_GOES_ON  # a saga is never cut short: the request is dropped, the saga goes on
    saga = _start_saga_txn(run_id, RunStatus.CANCELLED, stop) if row["cancel_compensate"] else Saga()
    if saga.planned:
        return Cancellation.COMPENSATING
    ending = _saga_ending(row["cancel_compensate"])
    if not take_txn(
        RunOp.CANCEL, run_id, to=RunStatus.CANCELLED, where=Q(finish_as=""), finished_at=DbNow(), **stop, **ending
    ):
        return Cancellation.NONE
    cancel_open_waits_txn(run_id)
    return Cancellation.CANCELLED


def _saga_ending(compensate: bool) -> dict[str, Any]:
    """How a run cancelled with nothing (left) to undo ends. A cancel that asked for compensation ends as a saga all
    the same: whoever finds its children later (the finished-run cascade, the sweep) has them undo what they did
    too, and the run never resumes into the world its children undid."""
    if not compensate:
        return {"finish_as": ""}
    return {"finish_as": RunStatus.CANCELLED, "family_undo": True}


def withdraw_cancel_txn(run_id: Any, *, reason: str) -> bool:
    """Take back a cancel request not settled yet (its reason as given), leaving the worker that runs the step its
    lease: the run goes on. Never a saga's: once one started it is not cut short."""
    _in_transaction()
    where = Q(cancel_requested_at__isnull=False, cancel_reason=reason, finish_as="")
    return move_run(
        RunOp.WITHDRAW_CANCEL, run_id, where=where, cancel_requested_at=None, cancel_reason="", cancel_compensate=False
    )


def family_undone_txn(run_id: Any) -> bool:
    """A run whose saga was owed to its family is done with it: it has ended, and none of its children is live or
    ended standing on what it applied. True if the mark was cleared; else the run is marked checked (updated_at)."""
    _in_transaction()
    owed = Run.objects.filter(pk=run_id, family_undo=True, status__unindexed__in=FINISHED_RUN_STATUSES)
    children = Run.objects.filter(parent_id=run_id)
    if children.filter(Q(status__in=ACTIVE_RUN_STATUSES) | Q(finish_as="")).exists():
        owed.update(updated_at=DbNow())
        return False
    return owed.update(family_undo=False, updated_at=DbNow()) == 1


def undo_finished_txn(run_id: Any) -> Saga:
    """A finished run whose family's saga reached it (its parent's compensation was asked for) undoes what it applied
    too: a saga from its end, ending `cancelled`, queued for its concurrency key again. With nothing of its own to
    undo it lets go of its effects (`finish_as`), its status as it was: neither resumed nor reached again."""
    _in_transaction()
    where = Q(status__unindexed__in=FINISHED_RUN_STATUSES, finish_as="")
    reopened = {"finished_at": None, "admitted_at": None, "lease_token": F("lease_token") + 1, "wake_at": None}
    saga = compensate_txn(run_id, finish_as=RunStatus.CANCELLED, where=where, op=RunOp.UNDO, **reopened, **RELEASED)
    if not saga.planned:
        move_run(RunOp.LET_GO, run_id, where=where, finish_as=RunStatus.CANCELLED, family_undo=True)
    return saga


def _start_saga_txn(run_id: Any, finish_as: str, fields: dict[str, Any]) -> Saga:
    """Take a run no worker holds and turn it into a compensating run (if there is anything to undo)."""
    fence = lease_free() & Q(finish_as="")
    saga = compensate_txn(
        run_id, finish_as=finish_as, where=fence, lease_token=F("lease_token") + 1, wake_at=None, **RELEASED, **fields
    )
    if saga.planned:
        cancel_open_waits_txn(run_id)
    return saga


RESTARTED = {
    "error": None,
    "finished_at": None,
    "cancel_requested_at": None,
    "cancel_compensate": False,
    "family_undo": False,
    "cancel_reason": "",
    "attempt": 0,
}


def resume_txn(run_id: Any, *, from_status: str, cursor: int, **changes: Any) -> bool:
    """A failed or cancelled run continues at its cursor: the failed step there runs again from attempt 1,
    and rejected or expired decisions of that step stop governing it (the step may ask again)."""
    # A finished run held no slot of its concurrency key: back to pending, it queues for one again (admission.py).
    # A saga resumed is still owed to its family; a run resumed forward no longer is.
    owed = Case(When(finish_as="", then=False), default=F("family_undo"))
    restarted = {**RESTARTED, "admitted_at": None, "family_undo": owed, **changes}
    if not take_txn(RunOp.RESUME, run_id, to=RunStatus.PENDING, where=Q(status__unindexed=from_status), **restarted):
        return False
    step = Step.objects.live().filter(run_id=run_id, position=cursor).first()
    if step is not None:
        move_steps_txn(
            StepOp.RESET,
            Step.objects.filter(pk=step.pk),
            to=StepStatus.PENDING,
            error=None,
            attempts=0,
            next_attempt_at=None,
        )
        retire_decisions_txn(step.pk)
    return True


def rerun_txn(run_id: Any, position: int) -> list[str] | None:
    """Run again from the live step at `position`: later checkpoints superseded (kept), fresh copies planned.
    None if a worker holds the run or it waits (decide or cancel its wait first)."""
    # Fenced on finish_as too: a saga planned since the caller looked is never re-run over.
    where = Q(finish_as="")
    # A finished run queues for its concurrency key again; a runnable one keeps the slot it holds (admission.py).
    admitted = Case(When(status__in=FINISHED_RUN_STATUSES, then=None), default=F("admitted_at"))
    restarted = {**RESTARTED, "admitted_at": admitted}
    if not take_txn(RunOp.RERUN, run_id, to=RunStatus.PENDING, where=where, cursor=position, output=None, **restarted):
        return None
    cancel_open_waits_txn(run_id)
    return supersede_from_txn(run_id, position)


def wake_up_txn(run_id: Any) -> bool:
    """An operator wakes a runnable run now: any retry backoff (wake_at) is cleared."""
    _in_transaction()
    return move_run(RunOp.WAKE_UP, run_id, wake_at=None)


# --- Steps ------------------------------------------------------------------------------------------------


def move_steps_txn(op: StepOp, steps: QuerySet[Step], *, to: str | None = None, **changes: Any) -> int:
    """Move the steps of `steps` allowed by `op`; how many moved."""
    _in_transaction()
    status = _target(STEP_RULES, op, to)
    return steps.filter(status__in=STEP_RULES[op].sources).update(**status, updated_at=DbNow(), **changes)


def commit_step_txn(step_pk: int, **changes: Any) -> None:
    """A step's checkpoint (inside the transaction that fenced the run). A step that is no longer live
    (superseded, failed by a deadline) takes none: LeaseLostError, and the whole transaction rolls back."""
    steps = Step.objects.filter(pk=step_pk)
    if not move_steps_txn(StepOp.COMMIT, steps, to=StepStatus.DONE, finished_at=DbNow(), **changes):
        raise LeaseLostError(f"step {step_pk} is no longer live: its checkpoint was not written")


def supersede_from_txn(run_id: Any, position: int) -> list[str]:
    """Mark the live steps from `position` on superseded (kept as history) and plan fresh copies of them.

    Effects keep their keys (run scope, step id, call), so a re-executed step reuses what it applied.
    """
    later = list(Step.objects.live().filter(run_id=run_id, position__gte=position).order_by("position"))
    move_steps_txn(StepOp.SUPERSEDE, Step.objects.filter(pk__in=[s.pk for s in later]), to=StepStatus.SUPERSEDED)
    Step.objects.bulk_create(fresh_copy(s, run_id) for s in later)
    return [s.step_id for s in later]


def fresh_copy(step: Step, run_id: Any, **checkpoint: Any) -> Step:
    """An unsaved copy of a plan element for `run_id`: pending, or carrying `checkpoint` fields over (forks)."""
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


CHECKPOINT_FIELDS = (
    "status",
    "result",
    "result_ref",
    "result_hash",
    "observed_at",
    "started_at",
    "finished_at",
    "attempts",
)


def copy_plan_txn(steps: list[Step], fork_id: Any, before: int) -> None:
    """A fork's plan: the source's checkpoints before position `before` as they are, the rest pending."""
    _in_transaction()
    Step.objects.bulk_create(
        fresh_copy(s, fork_id, **({f: getattr(s, f) for f in CHECKPOINT_FIELDS} if s.position < before else {}))
        for s in steps
    )


# --- Waits ------------------------------------------------------------------------------------------------


def move_wait(op: WaitOp, wait_id: int, *, to: str, where: Q | None = None, **changes: Any) -> bool:
    """Close an open wait for `op` (decide, signal, fire, expire, migrate); False if it was not open."""
    status = _target(WAIT_RULES, op, to)
    moved = Wait.objects.filter(where or Q(), pk=wait_id, status__unindexed__in=WAIT_RULES[op].sources)
    if moved.update(**status, updated_at=DbNow(), **changes) != 1:
        return False
    if tracing.enabled():
        # Drawn once the decision committed, exactly once: only the one move that closed the wait gets here.
        transaction.on_commit(lambda: trace_closed_wait(wait_id), robust=True)
    return True


def trace_closed_wait(wait_id: int) -> None:
    """The span `wait {kind}` of a closed wait, in its run's trace, from its opening to its decision (the database's
    times; a cancelled wait, to its cancellation): who decided, what (its status, never a comment or a payload), and
    through what (api, admin, link, cli, signal, deadline, timer)."""
    found = (
        Wait.objects.filter(pk=wait_id)
        .values_list(
            "kind",
            "status",
            "decided_by",
            "decision",
            "created_at",
            "decided_at",
            "run__trace_context",
            "updated_at",
            "run_id",
        )
        .first()
    )
    if found is None:
        return
    kind, status, by, decision, opened, decided, trace_context, updated, run_id = found
    via = (decision or {}).get("via") if isinstance(decision, dict) else None
    tracing.record_run_span(
        f"wait {kind}",
        trace_context,
        opened,
        decided or updated,
        {
            tracing.WAIT_ID: wait_id,
            tracing.WAIT_KIND: kind,
            tracing.WAIT_DECISION: status,
            tracing.WAIT_DECIDED_BY: by or None,
            tracing.WAIT_VIA: via or by or None,
        },
        run_id=run_id,
    )


def cancel_open_waits_txn(run_id: Any) -> None:
    """Its open wait is cancelled, and a model turn it sent in a batch abandoned (a late answer is counted, never
    used; the batcher cancels a batch once every turn in it is abandoned)."""
    _in_transaction()
    cancelling = Wait.objects.filter(run_id=run_id, status__in=WAIT_RULES[WaitOp.CANCEL].sources)
    if tracing.enabled():
        for wait_id in cancelling.values_list("pk", flat=True):
            transaction.on_commit(lambda wait_id=wait_id: trace_closed_wait(wait_id), robust=True)
    cancelling.update(status=WaitStatus.CANCELLED, updated_at=DbNow())
    move_batch_turns(BatchTurnOp.ABANDON, BatchTurn.objects.filter(run_id=run_id), to=BatchTurnStatus.ABANDONED)


def retire_decisions_txn(step_pk: int) -> None:
    """Rejected or expired decisions of a step stop governing it (kept as history): it may ask again."""
    Wait.objects.filter(step_id=step_pk, status__in=(WaitStatus.REJECTED, WaitStatus.EXPIRED)).update(retired=True)


def buffer_signal_txn(run_id: Any, name: str, payload: Any, by: str) -> Wait:
    """A signal that arrived before its run waits for it: kept as an approved, unbound wait."""
    _in_transaction()
    return Wait.objects.create(
        run_id=run_id,
        kind="signal",
        name=name,
        status=WaitStatus.APPROVED,
        decided_by=by,
        decided_at=clock.now(),
        decision={"payload": payload, "via": "signal"},
    )


def bind_buffered_signal(step: Step, name: str, *, token: int | None = None) -> Wait | None:
    """A signal that arrived before the step asked for it, now bound to the step (once). With `token`, only
    while that token holds the run: a zombie must not take a signal from the step that now runs."""
    held = Exists(Run.objects.filter(pk=step.run_id, lease_token=token)) if token is not None else Q()
    for wait in Wait.objects.filter(
        run_id=step.run_id, kind="signal", name=name, step__isnull=True, status=WaitStatus.APPROVED
    ).order_by("id"):
        if Wait.objects.filter(held, pk=wait.pk, step__isnull=True).update(step=step):
            wait.step = step
            return wait
    return None


# --- Effects ----------------------------------------------------------------------------------------------


def move_effect(op: EffectOp, effect_pk: int, *, to: str, where: Q | None = None, **changes: Any) -> bool:
    """One compare-and-set UPDATE of an effect for `op`; True if it moved."""
    status = _target(EFFECT_RULES, op, to)
    effects = Effect.objects.filter(where or Q(), pk=effect_pk, status__unindexed__in=EFFECT_RULES[op].sources)
    return effects.update(**status, updated_at=DbNow(), **changes) == 1


def start_external_effect(
    claim: Claim, *, key: str, step_pk: int, tool: str, args: Any, args_hash: str
) -> tuple[bool, Effect | None]:
    """Postgres: prove and extend `claim`'s lease and write a new effect's outbox row (pending, counted as invoked
    once), in one statement. (held, effect): held False: the lease was lost, nothing written; effect None: the key
    is already recorded, nothing written."""
    lease = timedelta(seconds=lease_seconds())
    return hotpath.start_effect(claim, lease, key=key, step_pk=step_pk, tool=tool, args=args, args_hash=args_hash)


def effect_applied(effect_pk: int, result: Any) -> bool:
    """Postgres: move_effect(APPLY) of an effect with no compensation to record, in one statement; True if it moved."""
    return hotpath.applied(effect_pk, result)


# --- Batch turns and message batches (agents/batching.py, agents/batcher.py) -------------------------------


def queue_batch_turn_txn(run_id: Any, token: int | None, **fields: Any) -> BatchTurn:
    """Journal a model turn as submitted (queued for the batcher), fenced by the lease token of the step's worker."""
    _in_transaction()
    fenced = Run.objects.filter(pk=run_id)
    if token is not None:
        fenced = fenced.filter(lease_token=token)
    if not fenced.update(updated_at=DbNow()):
        raise LeaseLostError(f"run {run_id} was taken over; its turn was not sent in a batch")
    return BatchTurn.objects.create(run_id=run_id, **fields)


def move_batch_turns(op: BatchTurnOp, turns: QuerySet[BatchTurn], *, to: str | None = None, **changes: Any) -> int:
    """Move the batch turns `op` applies to (those in its source statuses); how many moved."""
    status = _target(BATCH_TURN_RULES, op, to)
    if op in (BatchTurnOp.END, BatchTurnOp.ABANDON):
        changes.setdefault("ended_at", DbNow())
    return turns.filter(status__in=BATCH_TURN_RULES[op].sources).update(**status, **changes)


def move_message_batch(op: MessageBatchOp, batch_pk: int, *, to: str, where: Q | None = None, **changes: Any) -> bool:
    """Move one message batch for `op`; False if it was not in a source status of `op`."""
    status = _target(MESSAGE_BATCH_RULES, op, to)
    moved = MessageBatch.objects.filter(
        where or Q(), pk=batch_pk, status__unindexed__in=MESSAGE_BATCH_RULES[op].sources
    )
    return moved.update(**status, **changes) == 1


def new_message_batch_txn(turn_pks: list[int], **fields: Any) -> MessageBatch | None:
    """A message batch (status submitting) holding the queued turns among `turn_pks`; None if none was queued."""
    _in_transaction()
    batch = MessageBatch.objects.create(**fields)
    moved = move_batch_turns(
        BatchTurnOp.BATCH,
        BatchTurn.objects.filter(pk__in=turn_pks),
        to=BatchTurnStatus.SUBMITTED,
        batch=batch,
        submitted_at=DbNow(),
    )
    if not moved:
        batch.delete()
        return None
    MessageBatch.objects.filter(pk=batch.pk).update(request_count=moved)
    batch.request_count = moved
    return batch


def batch_turn_ended(custom_id: str) -> bool:
    """True once the batch turn's result is in (or it was abandoned): nothing more will come to wake its run."""
    ended = set(BATCH_TURN_RULES[BatchTurnOp.END].targets) | {BatchTurnStatus.ABANDONED}
    return BatchTurn.objects.filter(custom_id=custom_id, status__in=ended).exists()
