"""Model turns sent through the Message Batches API: the database side (agents/batcher.py talks to the API).

A step with `delivery="batch"` journals its turn as submitted — a BatchTurn row, fenced by the run's lease — and
parks its run on a `batch` wait named by the turn's custom id: no worker slot, no connection, nothing polls it.
The batcher puts queued turns in a MessageBatch row (its outbox row: the turns are chosen and committed before
the create request goes), sends it, polls it on the database's clock, and records each result here: the turn
ends (succeeded, errored, expired, canceled), its wait closes and its run wakes, in one transaction that locks
the run's row first — the lock the parking step's fenced UPDATE takes — so either the batcher sees the open
wait, or the parking step sees the result and goes on at once (transitions.park_txn).

A cancelled run abandons its turns (transitions.cancel_open_waits_txn); an answer that still comes for an
abandoned turn is counted against its run, never used: the API billed it.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import Count, DateTimeField, Exists, ExpressionWrapper, F, Min, OuterRef, Sum, TextField, Value
from django.db.models.functions import Cast, Length

from durable_agents.clock import DbNow
from durable_agents.engine import transitions
from durable_agents.engine.events import record_event
from durable_agents.engine.wake import wake_on_commit
from durable_agents.models import BatchTurn, MessageBatch, Run, Step, Turn, Wait, WaitKind
from durable_agents.states import (
    ACTIVE_RUN_STATUSES,
    BatchTurnOp,
    BatchTurnStatus,
    MessageBatchOp,
    MessageBatchStatus,
    StepStatus,
    WaitOp,
    WaitStatus,
)

# A request's envelope in the create body beside its params: {"custom_id": "da-<32 hex>", "params": ...}.
REQUEST_OVERHEAD_BYTES = 64
IN_FLIGHT = (BatchTurnStatus.QUEUED, BatchTurnStatus.SUBMITTED)
# A step in these statuses never executes again (a rerun copies it): an answer it did not journal stays unused.
FINISHED_STEP_STATUSES = (StepStatus.DONE, StepStatus.SKIPPED, StepStatus.SUPERSEDED)
FAILED_RESULTS = (BatchTurnStatus.ERRORED, BatchTurnStatus.EXPIRED, BatchTurnStatus.CANCELED)
BATCHES_IN_FLIGHT = (MessageBatchStatus.SUBMITTING, MessageBatchStatus.IN_PROGRESS, MessageBatchStatus.CANCELING)
# A result's "type" -> the status its turn ends in.
RESULT_STATUSES = {
    "succeeded": BatchTurnStatus.SUCCEEDED,
    "errored": BatchTurnStatus.ERRORED,
    "expired": BatchTurnStatus.EXPIRED,
    "canceled": BatchTurnStatus.CANCELED,
}


def new_custom_id() -> str:
    """A request's custom id: unique across installations sharing an API key (the API wants ^[a-zA-Z0-9_-]{1,64}$)."""
    return f"da-{uuid.uuid4().hex}"


# --- The step's side --------------------------------------------------------------------------------------


def queue_turn(
    ctx: Any,
    *,
    index: int,
    purpose: str,
    params: dict[str, Any],
    digest: str,
    model: str,
    deadline: datetime | None,
) -> BatchTurn:
    """Journal a model turn as submitted (queued for the batcher), fenced by the step's lease token."""
    with transaction.atomic():
        turn = transitions.queue_batch_turn_txn(
            ctx.run_id,
            ctx.lease_token,
            step_id=ctx.step.pk,
            index=index,
            purpose=purpose,
            custom_id=new_custom_id(),
            model=model,
            request_digest=digest,
            params=params,
            deadline=deadline,
        )
        record_event(ctx.run_id, "batch_submitted", step_id=ctx.step_id, turn=index, custom_id=turn.custom_id)
    return turn


def latest_turn(step_pk: int, index: int) -> BatchTurn | None:
    """The step's last batch turn for journal index `index` (a turn sent again after a failed result is newer)."""
    return BatchTurn.objects.filter(step_id=step_pk, index=index).order_by("-id").first()


def journaled_txn(custom_id: str) -> None:
    """The answer of batch turn `custom_id` is journaled as a Turn (in the journaling transaction): used."""
    BatchTurn.objects.filter(custom_id=custom_id, used=False).update(used=True)


def mark_used(turn: BatchTurn) -> bool:
    """A failed result (or a deadline's "fail") is acted on once: the next execution sends the turn again instead of
    failing again."""
    return BatchTurn.objects.filter(pk=turn.pk, used=False).update(used=True) == 1


def abandon(turn: BatchTurn, reason: str) -> bool:
    """Give up waiting for the turn's answer (its deadline passed, or the step asks something else)."""
    with transaction.atomic():
        # The run's row first, as record_result locks it: the deadline racing the answer cannot deadlock.
        Run.objects.select_for_update().filter(pk=turn.run_id).first()
        moved = transitions.move_batch_turns(
            BatchTurnOp.ABANDON, BatchTurn.objects.filter(pk=turn.pk), to=BatchTurnStatus.ABANDONED
        )
        if moved:
            record_event(turn.run_id, "batch_abandoned", turn=turn.index, custom_id=turn.custom_id, reason=reason)
    return bool(moved)


def set_aside(turn: BatchTurn, reason: str) -> str:
    """Give up a turn its step will not use: "abandoned" if it was in flight (a late answer is counted when it
    comes); "counted" if its answer had come and was never journaled (the API billed it: counted on the run, and
    a resumed step asks again); "" if it was journaled after all, or already set aside.

    Locks the run's row first, as `record_result` and the journal's fenced write do: an answer recorded or
    journaled meanwhile is seen here, so it is counted once."""
    with transaction.atomic():
        Run.objects.select_for_update().filter(pk=turn.run_id).first()
        current = BatchTurn.objects.select_for_update().get(pk=turn.pk)
        if current.status in IN_FLIGHT:
            transitions.move_batch_turns(
                BatchTurnOp.ABANDON, BatchTurn.objects.filter(pk=turn.pk), to=BatchTurnStatus.ABANDONED
            )
            record_event(turn.run_id, "batch_abandoned", turn=turn.index, custom_id=turn.custom_id, reason=reason)
            return "abandoned"
        if current.status != BatchTurnStatus.SUCCEEDED or is_journaled(current):
            return ""
        transitions.move_batch_turns(
            BatchTurnOp.SET_ASIDE, BatchTurn.objects.filter(pk=turn.pk), to=BatchTurnStatus.ABANDONED
        )
        _count_late(current, current.cost_usd, billed_counters(current.result), reason=reason)
        return "counted"


def is_journaled(turn: BatchTurn) -> bool:
    """True once its step journaled its answer (a Turn at its index whose request id is its custom id)."""
    return Turn.objects.filter(step_id=turn.step_id, index=turn.index, request_id=turn.custom_id).exists()


def set_aside_unused_answers() -> int:
    """Succeeded answers no step will use, counted on their runs (billed); how many. Their run ended between the
    answer and the step's next execution (a cancel), or their step finished another way (redeployed live)."""
    finished = ~Exists(Run.objects.filter(pk=OuterRef("run_id"), status__in=ACTIVE_RUN_STATUSES))
    step_over = Exists(Step.objects.filter(pk=OuterRef("step_id"), status__in=FINISHED_STEP_STATUSES))
    journaled = Exists(
        Turn.objects.filter(step_id=OuterRef("step_id"), index=OuterRef("index"), request_id=OuterRef("custom_id"))
    )
    # `used`: its answer was journaled (journaled_txn), so only answers never journaled are looked at (an index).
    unused = BatchTurn.objects.filter(finished | step_over, ~journaled, status=BatchTurnStatus.SUCCEEDED, used=False)
    reason = "a batch answer its step never used (its run ended, or the step finished another way)"
    return sum(set_aside(turn, reason) == "counted" for turn in unused)


def billed_counters(result: dict[str, Any] | None) -> dict[str, int]:
    """The token counters (Run and Step columns) of a succeeded result's `usage`."""
    message = (result or {}).get("message")
    usage = message.get("usage") if isinstance(message, dict) else None
    usage = usage if isinstance(usage, dict) else {}

    def tokens(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    return {
        "input_tokens": tokens("input_tokens"),
        "output_tokens": tokens("output_tokens"),
        "cache_write_tokens": tokens("cache_creation_input_tokens"),
        "cache_read_tokens": tokens("cache_read_input_tokens"),
    }


# --- The batcher's side -----------------------------------------------------------------------------------


def due_turns(window: timedelta, max_requests: int, max_bytes: int) -> list[BatchTurn]:
    """The queued turns that go out now, oldest first: once `max_requests` are queued, or the oldest has waited
    `window` (on the database's clock); at most `max_requests` of them and `max_bytes` of requests."""
    queued = BatchTurn.objects.filter(status=BatchTurnStatus.QUEUED)
    due_before = ExpressionWrapper(DbNow() - Value(window), output_field=DateTimeField())
    oldest = queued.aggregate(n=Count("id"), oldest=Min("created_at"))
    if not oldest["n"]:
        return []
    if oldest["n"] < max_requests and not queued.filter(created_at__lte=due_before).exists():
        return []
    chosen, size = [], 0
    # Sized in the database: the requests themselves are read once, when the batch goes. The stored JSON escapes
    # every non-ASCII character, so its length bounds the UTF-8 bytes the create request carries.
    sized = queued.annotate(size=Length(Cast("params", TextField()))).order_by("created_at", "id")
    for turn in sized.only("pk", "created_at", "custom_id")[:max_requests]:
        length = (turn.size or 0) + len(turn.custom_id) + REQUEST_OVERHEAD_BYTES
        if chosen and size + length > max_bytes:
            break
        chosen.append(turn)
        size += length
    return chosen


def open_batch(turns: list[BatchTurn]) -> MessageBatch | None:
    """The batch (status submitting) that will carry `turns`, committed before anything is sent; None if none of
    them is still queued (a cancel abandoned them meanwhile)."""
    with transaction.atomic():
        batch = transitions.new_message_batch_txn([t.pk for t in turns])
        if batch is not None:
            size = BatchTurn.objects.filter(batch=batch).aggregate(size=Sum(Length(Cast("params", TextField()))))
            batch.request_bytes = size["size"] or 0
            MessageBatch.objects.filter(pk=batch.pk).update(request_bytes=batch.request_bytes)
        return batch


def requests_of(batch: MessageBatch) -> list[dict[str, Any]]:
    """The create request's `requests`: every turn the batch carries that is still wanted."""
    turns = BatchTurn.objects.filter(batch=batch, status=BatchTurnStatus.SUBMITTED).order_by("id")
    return [{"custom_id": t.custom_id, "params": t.params} for t in turns.only("custom_id", "params")]


def recount(batch: MessageBatch, count: int) -> None:
    """The batch's create carries `count` requests (its turns abandoned meanwhile stay out): recorded before it goes,
    since a create whose answer is lost is looked for among the API's batches by that size."""
    MessageBatch.objects.filter(pk=batch.pk).update(request_count=count)
    batch.request_count = count


def submitted(batch: MessageBatch, provider_id: str, counts: dict[str, int], poll_in: timedelta) -> bool:
    """The API took the batch: its id, and when to poll it first."""
    return transitions.move_message_batch(
        MessageBatchOp.SUBMITTED,
        batch.pk,
        to=MessageBatchStatus.IN_PROGRESS,
        provider_id=provider_id,
        counts=counts,
        submitted_at=DbNow(),
        next_poll_at=ExpressionWrapper(DbNow() + Value(poll_in), output_field=DateTimeField()),
    )


def not_created(batch: MessageBatch, error: str) -> int:
    """The batch was refused, or was never created: its turns go back to the queue; how many."""
    with transaction.atomic():
        transitions.move_message_batch(MessageBatchOp.FAIL, batch.pk, to=MessageBatchStatus.FAILED, error=error[:2000])
        return transitions.move_batch_turns(
            BatchTurnOp.REQUEUE,
            BatchTurn.objects.filter(batch=batch),
            to=BatchTurnStatus.QUEUED,
            batch=None,
            submitted_at=None,
        )


def refused(batch: MessageBatch, error: dict[str, Any]) -> int:
    """The API refused the batch for what it holds (a 4xx): sending it again would be refused again, so each of its
    turns ends errored with the API's words, and its step fails saying them. The batch is marked failed last: killed
    halfway, it is still `submitting`, and the lost-create recovery gives the turns not yet ended back to the queue."""
    turns = list(BatchTurn.objects.filter(batch=batch, status=BatchTurnStatus.SUBMITTED).values_list("custom_id"))
    for (custom_id,) in turns:
        record_result(batch, custom_id, {"type": "errored", "error": {"type": "error", "error": error}})
    transitions.move_message_batch(MessageBatchOp.FAIL, batch.pk, to=MessageBatchStatus.FAILED, error=str(error)[:2000])
    return len(turns)


def submitting_since(older_than: timedelta) -> list[MessageBatch]:
    """Batches whose create request went without an answer `older_than` ago (the batcher died, or it timed out)."""
    before = ExpressionWrapper(DbNow() - Value(older_than), output_field=DateTimeField())
    return list(MessageBatch.objects.filter(status=MessageBatchStatus.SUBMITTING, created_at__lte=before))


def has_unanswered_create() -> bool:
    """True while a batch's create request went without an answer that is not resolved yet (adopted or requeued)."""
    return MessageBatch.objects.filter(status=MessageBatchStatus.SUBMITTING).exists()


def known_provider_ids(ids: list[str]) -> set[str]:
    return set(MessageBatch.objects.filter(provider_id__in=ids).values_list("provider_id", flat=True))


def due_polls(limit: int) -> list[MessageBatch]:
    """Batches in flight at the API whose next poll is due."""
    return list(
        MessageBatch.objects.filter(
            status__in=(MessageBatchStatus.IN_PROGRESS, MessageBatchStatus.CANCELING), next_poll_at__lte=DbNow()
        ).order_by("next_poll_at")[:limit]
    )


def polled(batch: MessageBatch, counts: dict[str, int], poll_in: timedelta) -> None:
    MessageBatch.objects.filter(pk=batch.pk).update(
        counts=counts,
        polls=F("polls") + 1,
        polled_at=DbNow(),
        next_poll_at=ExpressionWrapper(DbNow() + Value(poll_in), output_field=DateTimeField()),
    )


def record_result(
    batch: MessageBatch,
    custom_id: str,
    result: dict[str, Any],
    *,
    cost: Decimal = Decimal(0),
    counters: dict[str, Any] | None = None,
) -> str:
    """Record one request's result; what it did: "answered" (its run woken), "late" (an abandoned turn's answer,
    counted against the run), "known" (recorded before: results are read again after a crash), "unknown"."""
    status = RESULT_STATUSES.get(str(result.get("type")), BatchTurnStatus.ERRORED)
    with transaction.atomic():
        run_id = BatchTurn.objects.filter(custom_id=custom_id, batch=batch).values_list("run_id", flat=True).first()
        if run_id is None:
            return "unknown"
        # The run's row first: the lock order of every operation on a run, and the lock a parking step takes.
        Run.objects.select_for_update().filter(pk=run_id).first()
        turn = BatchTurn.objects.select_for_update().get(custom_id=custom_id)
        if turn.status == BatchTurnStatus.SUBMITTED:
            transitions.move_batch_turns(
                BatchTurnOp.END, BatchTurn.objects.filter(pk=turn.pk), to=status, result=result, cost_usd=cost
            )
            wait = Wait.objects.open().filter(run_id=run_id, kind=WaitKind.BATCH, name=custom_id)
            for wait_pk in wait.values_list("pk", flat=True):
                if transitions.move_wait(
                    WaitOp.ANSWER, wait_pk, to=WaitStatus.APPROVED, decided_by="batch", decided_at=DbNow()
                ) and transitions.wake_txn(run_id):
                    wake_on_commit(run_id)
            return "answered"
        if turn.status == BatchTurnStatus.ABANDONED and turn.result is None:
            transitions.move_batch_turns(
                BatchTurnOp.SETTLE, BatchTurn.objects.filter(pk=turn.pk), result=result, cost_usd=cost
            )
            if cost or any((counters or {}).values()):
                _count_late(turn, cost, counters or {})
            return "late"
        return "known"


def _count_late(
    turn: BatchTurn,
    cost: Decimal,
    counters: dict[str, Any],
    *,
    reason: str = "a batch answer to a turn its run had abandoned",
) -> None:
    """An abandoned turn's answer was billed: its tokens and cost go on its run and step, with an event."""
    increments = {name: F(name) + value for name, value in counters.items()}
    Run.objects.filter(pk=turn.run_id).update(cost_usd=F("cost_usd") + cost, **increments)
    Step.objects.filter(pk=turn.step_id).update(cost_usd=F("cost_usd") + cost, **increments)
    record_event(
        turn.run_id,
        "unjournaled_usage",
        turn=turn.index,
        custom_id=turn.custom_id,
        cost_usd=str(cost),
        reason=reason,
        **{name: int(value) for name, value in counters.items()},
    )


def end_batch(batch: MessageBatch, counts: dict[str, int]) -> int:
    """Its results are all recorded: the batch ended. A turn its results did not name (none should be left) goes back
    to the queue rather than wait for ever; how many did."""
    with transaction.atomic():
        transitions.move_message_batch(
            MessageBatchOp.END,
            batch.pk,
            to=MessageBatchStatus.ENDED,
            counts=counts,
            ended_at=DbNow(),
            polled_at=DbNow(),
        )
        return transitions.move_batch_turns(
            BatchTurnOp.REQUEUE,
            BatchTurn.objects.filter(batch=batch),
            to=BatchTurnStatus.QUEUED,
            batch=None,
            submitted_at=None,
        )


def not_ours(batch: MessageBatch) -> int:
    """A batch adopted after a lost create answer held none of our custom ids: it was someone else's. The turns
    that are still waiting go back to the queue."""
    return not_created(batch, "adopted batch held none of its turns: not ours; its turns were sent again")


def abandon_turns_of_finished_runs() -> int:
    """Turns in flight whose run finished by another road (a deadline's "fail" policy, a failure elsewhere)."""
    finished = ~Exists(Run.objects.filter(pk=OuterRef("run_id"), status__in=ACTIVE_RUN_STATUSES))
    with transaction.atomic():
        return transitions.move_batch_turns(
            BatchTurnOp.ABANDON, BatchTurn.objects.filter(finished, status__in=IN_FLIGHT), to=BatchTurnStatus.ABANDONED
        )


def to_cancel() -> list[MessageBatch]:
    """Batches in progress at the API of which no turn is wanted any more: every one was abandoned."""
    wanted = Exists(BatchTurn.objects.filter(batch=OuterRef("pk"), status=BatchTurnStatus.SUBMITTED))
    return list(MessageBatch.objects.filter(~wanted, status=MessageBatchStatus.IN_PROGRESS).exclude(provider_id=""))


def cancelling(batch: MessageBatch) -> bool:
    return transitions.move_message_batch(MessageBatchOp.CANCEL, batch.pk, to=MessageBatchStatus.CANCELING)


def has_work() -> bool:
    """True while any turn is queued or any batch is in flight: the sweep then sends the batcher."""
    return (
        BatchTurn.objects.filter(status=BatchTurnStatus.QUEUED).exists()
        or MessageBatch.objects.filter(status__in=BATCHES_IN_FLIGHT).exists()
    )


def in_flight_summary() -> dict[str, Any]:
    """Batches in flight and the oldest, for `durable_status` and the console."""
    batches = MessageBatch.objects.filter(status__in=BATCHES_IN_FLIGHT)
    turns = BatchTurn.objects.filter(status__in=IN_FLIGHT)
    agg = batches.aggregate(n=Count("id"), oldest=Min("created_at"))
    queued = BatchTurn.objects.filter(status=BatchTurnStatus.QUEUED).aggregate(n=Count("id"), oldest=Min("created_at"))
    return {
        "batches": agg["n"],
        "oldest_batch_at": agg["oldest"],
        "turns": turns.count(),
        "queued": queued["n"],
        "oldest_queued_at": queued["oldest"],
    }
