"""The state rules: every status of runs, steps, waits and effects, and which operation may move which to which.

Pure data, no database. `engine/transitions.py` is the only module that writes a status, and it writes
only what these tables allow: each write is a compare-and-set `UPDATE ... WHERE status IN (sources)`.

    run       pending ──claim──► running ──checkpoint──► running ──complete──► completed
                 ▲                  │ park                   │ fail / finish (a saga's end)
                 └──── wake ─── waiting                      ▼
                 └─ resume / rerun ── failed, cancelled ◄── cancel (no worker holds it)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from django.db.models import TextChoices


class RunStatus(TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StepStatus(TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"
    WAITING = "waiting"
    SUPERSEDED = "superseded"


class WaitStatus(TextChoices):
    OPEN = "open"
    APPROVED = "approved"  # also: a signal arrived, a timer fired
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


class BatchTurnStatus(TextChoices):
    """A model turn sent through the Message Batches API (agents/batching.py)."""

    QUEUED = "queued"  # journaled as submitted; waits for the batcher to put it in a batch
    SUBMITTED = "submitted"  # in a batch the batcher sent (or is sending)
    SUCCEEDED = "succeeded"  # its answer is in: the step journals it when its run wakes
    ERRORED = "errored"
    EXPIRED = "expired"
    CANCELED = "canceled"
    # Given up: its run was cancelled, its deadline passed, or its step no longer asks it (the request changed, a
    # participant that answers live took it, its answer was unusable or never used). An answer is counted, never used.
    ABANDONED = "abandoned"


class MessageBatchStatus(TextChoices):
    """A batch of turns the batcher sends as one Message Batch (agents/batcher.py)."""

    SUBMITTING = "submitting"  # its turns are chosen; the create request is about to go, or went without an answer
    IN_PROGRESS = "in_progress"  # the API took it (provider_id known)
    CANCELING = "canceling"  # every turn in it was abandoned: the API was asked to cancel it
    ENDED = "ended"  # its results are collected
    FAILED = "failed"  # the API refused it, or it was never created: its turns went back to the queue


class EffectStatus(TextChoices):
    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"
    COMPENSATED = "compensated"
    # A notification not sent on purpose: its wait closed first, or it had no recipients.
    SKIPPED = "skipped"


ACTIVE_RUN_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)
RUNNABLE_RUN_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING)
FINISHED_RUN_STATUSES = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
# Statuses a saga may end as: a run that compensated never ends `completed`.
SAGA_ENDINGS = (RunStatus.CANCELLED, RunStatus.FAILED)


@dataclass(frozen=True)
class Rule:
    """An operation's allowed source statuses and the statuses it may leave behind (empty: unchanged)."""

    sources: frozenset[str]
    targets: frozenset[str] = frozenset()

    def allows(self, target: str | None) -> bool:
        return target in self.targets if self.targets else target is None


def _statuses(value: tuple[str, ...] | str) -> frozenset[str]:
    return frozenset((value,) if isinstance(value, str) else value)


def _rule(sources: tuple[str, ...] | str, targets: tuple[str, ...] | str = ()) -> Rule:
    return Rule(_statuses(sources), _statuses(targets))


class RunOp(StrEnum):
    CLAIM = "claim"  # a worker takes the lease (fenced by a new token)
    CHECKPOINT = "checkpoint"  # a step committed, a retry was scheduled, the plan changed; lease released
    COMPLETE = "complete"  # the last step committed
    FINISH = "finish"  # the last compensation committed: the saga ends as it said (finish_as)
    PARK = "park"  # the run waits for a human, a signal or a timer
    WAKE = "wake"  # its wait closed
    FAIL = "fail"  # a step failed for good (or a wait's deadline failed it)
    COMPENSATE = "compensate"  # a saga starts: compensation steps planned, the run runnable again
    CANCEL = "cancel"  # an operator stopped it (no worker holds it)
    REQUEST_CANCEL = "request_cancel"  # a worker holds it: it stops after its step
    RESUME = "resume"  # an operator continues a failed or cancelled run where it stopped
    RERUN = "rerun"  # an operator runs it again from a step
    TAKE = "take"  # an operator's change (migration) fences any holder; status unchanged
    WAKE_UP = "wake_up"  # an operator re-wakes a runnable run now (clears a backoff)
    WITHDRAW_CANCEL = "withdraw_cancel"  # a cancel request not settled yet is taken back (its parent resumed)
    UNDO = "undo"  # its family's saga reaches a finished child: it undoes what it applied too (a saga from its end)
    LET_GO = "let_go"  # ... a finished child with nothing of its own to undo lets go of its effects; status kept


RUN_RULES: dict[RunOp, Rule] = {
    RunOp.CLAIM: _rule((RunStatus.PENDING, RunStatus.RUNNING), RunStatus.RUNNING),
    RunOp.CHECKPOINT: _rule(RunStatus.RUNNING),
    RunOp.COMPLETE: _rule(RunStatus.RUNNING, RunStatus.COMPLETED),
    RunOp.FINISH: _rule(RunStatus.RUNNING, SAGA_ENDINGS),
    RunOp.PARK: _rule(RunStatus.RUNNING, RunStatus.WAITING),
    RunOp.WAKE: _rule(RunStatus.WAITING, RunStatus.PENDING),
    RunOp.FAIL: _rule((RunStatus.RUNNING, RunStatus.WAITING), RunStatus.FAILED),
    RunOp.COMPENSATE: _rule(ACTIVE_RUN_STATUSES, RunStatus.PENDING),
    RunOp.CANCEL: _rule(ACTIVE_RUN_STATUSES, RunStatus.CANCELLED),
    RunOp.REQUEST_CANCEL: _rule(ACTIVE_RUN_STATUSES),
    RunOp.RESUME: _rule((RunStatus.FAILED, RunStatus.CANCELLED), RunStatus.PENDING),
    RunOp.RERUN: _rule((*RUNNABLE_RUN_STATUSES, *FINISHED_RUN_STATUSES), RunStatus.PENDING),
    RunOp.TAKE: _rule(ACTIVE_RUN_STATUSES),
    RunOp.WAKE_UP: _rule(RUNNABLE_RUN_STATUSES),
    RunOp.WITHDRAW_CANCEL: _rule(ACTIVE_RUN_STATUSES),
    RunOp.UNDO: _rule(FINISHED_RUN_STATUSES, RunStatus.PENDING),
    RunOp.LET_GO: _rule(FINISHED_RUN_STATUSES),
}


class StepOp(StrEnum):
    COMMIT = "commit"  # its checkpoint
    FAIL = "fail"
    PARK = "park"
    SKIP = "skip"  # a saga skips what is left of the plan
    SUPERSEDE = "supersede"  # a re-plan, redo, rerun or migration replaces it (kept as history)
    RESET = "reset"  # an operator retries a failed step


LIVE_STEP = (StepStatus.PENDING, StepStatus.RUNNING, StepStatus.WAITING)

STEP_RULES: dict[StepOp, Rule] = {
    StepOp.COMMIT: _rule(LIVE_STEP, StepStatus.DONE),
    StepOp.FAIL: _rule(LIVE_STEP, StepStatus.FAILED),
    StepOp.PARK: _rule(LIVE_STEP, StepStatus.WAITING),
    StepOp.SKIP: _rule(StepStatus.PENDING, StepStatus.SKIPPED),
    StepOp.SUPERSEDE: _rule(
        (*LIVE_STEP, StepStatus.DONE, StepStatus.FAILED, StepStatus.SKIPPED), StepStatus.SUPERSEDED
    ),
    StepOp.RESET: _rule(StepStatus.FAILED, StepStatus.PENDING),
}


class WaitOp(StrEnum):
    DECIDE = "decide"  # a human approved or rejected
    SIGNAL = "signal"  # the awaited signal arrived
    FIRE = "fire"  # a timer's time came
    EXPIRE = "expire"  # a deadline passed: reject, or expire (the "fail" policy)
    CANCEL = "cancel"  # its run was cancelled, resumed elsewhere or re-planned
    MIGRATE = "migrate"  # an operator moved a run parked on version drift
    JOIN = "join"  # the child runs a fan-out waits for are done (as its join asks)
    ANSWER = "answer"  # the Message Batch result of the turn it waits for came in


WAIT_RULES: dict[WaitOp, Rule] = {
    WaitOp.DECIDE: _rule(WaitStatus.OPEN, (WaitStatus.APPROVED, WaitStatus.REJECTED)),
    WaitOp.SIGNAL: _rule(WaitStatus.OPEN, WaitStatus.APPROVED),
    WaitOp.FIRE: _rule(WaitStatus.OPEN, WaitStatus.APPROVED),
    WaitOp.EXPIRE: _rule(WaitStatus.OPEN, (WaitStatus.REJECTED, WaitStatus.EXPIRED)),
    WaitOp.CANCEL: _rule(WaitStatus.OPEN, WaitStatus.CANCELLED),
    WaitOp.MIGRATE: _rule(WaitStatus.OPEN, WaitStatus.APPROVED),
    WaitOp.JOIN: _rule(WaitStatus.OPEN, WaitStatus.APPROVED),
    WaitOp.ANSWER: _rule(WaitStatus.OPEN, WaitStatus.APPROVED),
}


class BatchTurnOp(StrEnum):
    BATCH = "batch"  # the batcher put queued turns in a batch
    REQUEUE = "requeue"  # their batch was refused or never created: back to the queue
    END = "end"  # the batch's result for the turn came in
    ABANDON = "abandon"  # its run was cancelled, or the step gave up waiting (deadline)
    SETTLE = "settle"  # a late answer to an abandoned turn came in (counted, never used)
    SET_ASIDE = "set_aside"  # a succeeded answer its step will never use (its run ended, or it asks another way)


BATCH_TURN_RULES: dict[BatchTurnOp, Rule] = {
    BatchTurnOp.BATCH: _rule(BatchTurnStatus.QUEUED, BatchTurnStatus.SUBMITTED),
    BatchTurnOp.REQUEUE: _rule(BatchTurnStatus.SUBMITTED, BatchTurnStatus.QUEUED),
    BatchTurnOp.END: _rule(
        BatchTurnStatus.SUBMITTED,
        (BatchTurnStatus.SUCCEEDED, BatchTurnStatus.ERRORED, BatchTurnStatus.EXPIRED, BatchTurnStatus.CANCELED),
    ),
    BatchTurnOp.ABANDON: _rule((BatchTurnStatus.QUEUED, BatchTurnStatus.SUBMITTED), BatchTurnStatus.ABANDONED),
    BatchTurnOp.SETTLE: _rule(BatchTurnStatus.ABANDONED),
    BatchTurnOp.SET_ASIDE: _rule(BatchTurnStatus.SUCCEEDED, BatchTurnStatus.ABANDONED),
}


class MessageBatchOp(StrEnum):
    SUBMITTED = "submitted"  # the API answered the create: its id is known
    CANCEL = "cancel"  # every turn in it is abandoned
    END = "end"  # its results are collected
    FAIL = "fail"  # refused, never created, or not ours after all


MESSAGE_BATCH_RULES: dict[MessageBatchOp, Rule] = {
    MessageBatchOp.SUBMITTED: _rule(MessageBatchStatus.SUBMITTING, MessageBatchStatus.IN_PROGRESS),
    MessageBatchOp.CANCEL: _rule(MessageBatchStatus.IN_PROGRESS, MessageBatchStatus.CANCELING),
    MessageBatchOp.END: _rule((MessageBatchStatus.IN_PROGRESS, MessageBatchStatus.CANCELING), MessageBatchStatus.ENDED),
    MessageBatchOp.FAIL: _rule(
        (MessageBatchStatus.SUBMITTING, MessageBatchStatus.IN_PROGRESS, MessageBatchStatus.CANCELING),
        MessageBatchStatus.FAILED,
    ),
}


class EffectOp(StrEnum):
    RETRY = "retry"  # a resumed run tries a failed effect again
    APPLY = "apply"  # the tool's effect landed (or a notification was delivered)
    FAIL = "fail"  # the tool refused, permanently (or a notification gave up)
    COMPENSATE = "compensate"  # its compensating effect applied
    RESOLVE = "resolve"  # an operator recorded an unknown outcome: applied, or not
    SKIP = "skip"  # a notification not sent on purpose


EFFECT_RULES: dict[EffectOp, Rule] = {
    EffectOp.RETRY: _rule(EffectStatus.FAILED, EffectStatus.PENDING),
    EffectOp.APPLY: _rule(EffectStatus.PENDING, EffectStatus.APPLIED),
    EffectOp.FAIL: _rule(EffectStatus.PENDING, EffectStatus.FAILED),
    EffectOp.COMPENSATE: _rule(EffectStatus.APPLIED, EffectStatus.COMPENSATED),
    EffectOp.RESOLVE: _rule((EffectStatus.PENDING, EffectStatus.FAILED), (EffectStatus.APPLIED, EffectStatus.FAILED)),
    EffectOp.SKIP: _rule(EffectStatus.PENDING, EffectStatus.SKIPPED),
}

# What a row is created as (inserts are transitions too: from nothing).
INITIAL = {
    "run": RunStatus.PENDING,
    "step": StepStatus.PENDING,
    "wait": (WaitStatus.OPEN, WaitStatus.APPROVED),  # approved: a signal that arrived before it was awaited
    "effect": EffectStatus.PENDING,
}
