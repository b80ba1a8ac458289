"""The journal of model calls: every answer is committed, fenced by the lease token, before it is acted on.

A turn of the agent loop, a compaction, a judge's verdict, a planner's plan and a participant-written brief
are each one Turn row, written in one short transaction with the usage added to the step and the run.

An answer is billed once it arrives, so the journal tries hard to keep it: a write that found the connection pool
empty waits again (POOL_WAITS pool timeouts: nothing was sent, nothing written); a write that failed on its
connection (it died: a server restart, a `pg_terminate_backend`, a network cut) is tried once more on a fresh one.
A write whose COMMIT failed may have committed: the retry looks its Turn up first instead of writing it twice.
An answer that is still not journaled — a zombie's (its lease lost, or the turn journaled by another worker), or
one the database would not take — is counted all the same (unjournaled.py: an `unjournaled_usage` event, or an
ERROR line and a figure this process keeps until the database takes it).

A step's first journaled call also freezes the step's conversation head (Step.frozen_request: model, system,
tools, first prompt, thinking, effort) in the same transaction, so every later call sends the same head. What
the API returned is stored as it returned it (Turn.content is text on Postgres, keys in the model's order), so a
rebuilt request is byte-identical to the one first sent. A refusal's stop_details go with its turn and an event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import DatabaseError, IntegrityError, InterfaceError, OperationalError, transaction
from django.db.models import F, Max

from durable_agents import tracing
from durable_agents.agents import rate_limits
from durable_agents.agents.batching import Batch, ask_batched, can_batch, set_aside_batch_turn
from durable_agents.agents.compaction import Compacted
from durable_agents.agents.genai import answer_attributes, chat_attributes, error_message
from durable_agents.agents.messages import COMPACTION, TURN, ModelRequest, ModelResponse, Participant
from durable_agents.agents.pricing import cost_usd
from durable_agents.agents.unjournaled import (
    Unjournaled,
    count_unjournaled,
    landed_turn,
    record_owed,
    usage_counters,
)
from durable_agents.clock import DbNow
from durable_agents.connections import fresh_connection, release_connection
from durable_agents.engine import batches, turnpath
from durable_agents.engine.events import record_event
from durable_agents.engine.replaying import check_budget, is_replay
from durable_agents.errors import LeaseLostError
from durable_agents.models import Run, Step, Turn

try:
    from psycopg_pool import PoolTimeout
except ImportError:  # no pool installed: no pool timeouts either
    PoolTimeout = type("PoolTimeout", (Exception,), {})

logger = logging.getLogger("durable_agents.engine")
POOL_WAITS = 5  # pool timeouts (DATABASES OPTIONS pool "timeout" each) a journaling write waits out


def ask(
    ctx: Any,
    participant: Participant,
    request: ModelRequest,
    *,
    batch: Batch | None = None,
    index: int | None = None,
    purpose: str = TURN,
    proven: bool = False,
) -> ModelResponse:
    """One model call of a step: prove the lease first (a thawed zombie stops here, before paying for an answer
    another worker may already have journaled), then ask holding no database connection while the model
    thinks, for a participant that waits on the network (`remote`). Journal the answer before acting on it.
    `proven`: the caller proved the lease right before (StepContext.ensure_lease).

    With `batch` (the step's delivery), the call for journal index `index` goes in a Message Batch and the run
    parks until its answer is in (batching.py); a participant that cannot batch answers it live.

    Traced as a `chat {model}` span (SpanKind CLIENT, the GenAI conventions' attributes: genai.py) under the step
    attempt's; an answer taken from a Message Batch gets one too, marked batched, where it is taken up.
    """
    if is_replay(getattr(ctx, "run", None)):
        check_budget(ctx)
    if batch is not None and index is not None:
        if can_batch(participant):
            answer = ask_batched(
                ctx, request, index=index, purpose=purpose, batch=batch, live=lambda: ask(ctx, participant, request)
            )
            if answer.batch:
                # Answered in a Message Batch the batcher sent: the call is drawn where its answer was taken up.
                with tracing.span(
                    f"{tracing.CHAT} {request.model}", chat_attributes(ctx, participant, request)
                ) as traced:
                    traced.set({**answer_attributes(answer), tracing.MODEL_BATCHED: True})
            return answer
        # A participant swapped in while the turn was in a batch answers it now: the batch's turn is given up
        # (its answer, billed, counted on the run).
        set_aside_batch_turn(ctx, index)
    remote = getattr(participant, "remote", False)

    def prove() -> None:
        ctx.ensure_lease()
        if remote:
            release_connection()

    if not proven:
        prove()
    elif remote:
        release_connection()
    # A wait for room in the shared rate limit can outlast the lease: proven again after it, right before the call.
    with (
        tracing.span(
            f"{tracing.CHAT} {request.model}", chat_attributes(ctx, participant, request), client=True
        ) as traced,
        rate_limits.proving_after_waits(prove),
    ):
        try:
            answer = participant.respond(request)
        except Exception as exc:
            # The domain's errors say what the API answered (the key scrubbed); another's text may quote the prompt.
            status = getattr(exc, "status", None)
            traced.fail(exc, str(status) if status else "", message=error_message(exc))
            raise
        traced.set(answer_attributes(answer))
        return answer


@dataclass
class _Writes:
    """How the journaling writes of one answer went. `committing`: the last write reached its COMMIT, so an error
    now may have come after it committed; `maybe_landed` remembers that for the retry and the count."""

    index: int | None = None
    committing: bool = False
    maybe_landed: bool = False
    reconnected: bool = False


def create_turn(
    ctx: Any, index: int, purpose: str, request: ModelRequest, response: ModelResponse, participant: str, cost: Any
) -> Turn:
    """The Turn row of one answered model call (call inside the journaling transaction)."""
    return Turn.objects.create(
        run_id=ctx.run_id, step_id=ctx.step.pk, **_turn_fields(index, purpose, request, response, participant, cost)
    )


def _turn_fields(
    index: int, purpose: str, request: ModelRequest, response: ModelResponse, participant: str, cost: Any
) -> dict[str, Any]:
    usage = response.usage
    return {
        "index": index,
        "purpose": purpose,
        "request_digest": request.digest(),
        "content": [dict(b) for b in response.content],
        "stop_reason": response.stop_reason,
        "stop_details": dict(response.stop_details) if response.stop_details else None,
        "model": response.model,
        "participant": participant,
        "request_id": response.request_id,
        "cost_usd": cost,
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_write_tokens": usage.cache_write_tokens,
        "cache_read_tokens": usage.cache_read_tokens,
    }


def journal_turn(
    ctx: Any,
    index: int,
    request: ModelRequest,
    response: ModelResponse,
    participant: str,
    *,
    compacted: Compacted | None = None,
    head: dict[str, Any] | None = None,
) -> Turn:
    """Commit the response before acting on it: turn, usage on step and run, fenced by the lease token.

    A compaction call commits the step's new context (and an event) in the same transaction, so a crash
    leaves either the old summary and its turns, or the new summary.
    """
    usage = response.usage
    cost = cost_usd(response.model, usage, batch=response.batch)
    counters = usage_counters(usage)
    step_changes: dict[str, Any] = {"context": compacted.as_json()} if compacted else {}
    writes = _Writes(index=index)

    # The common answer — live, not a refusal, not a compaction — in one statement (engine/turnpath.py).
    fast = turnpath.is_available() and not compacted and not response.batch and response.stop_reason != "refusal"

    def write() -> Turn:
        if writes.maybe_landed and (landed := landed_turn(_billed(ctx, request, response, cost, writes, ""))):
            return landed
        if not fast or ctx.lease_token is None:
            return write_in_transaction()
        fields = _turn_fields(index, TURN, request, response, participant, cost)
        # One statement in autocommit: an error on its connection may come after it committed.
        writes.committing = True
        try:
            turn = turnpath.journal_turn(ctx.run_id, ctx.lease_token, ctx.step.pk, fields, head)
        except IntegrityError:
            writes.committing = False  # refused: nothing was written
            raise
        if turn is None:
            writes.committing = False
            raise LeaseLostError()
        return turn

    @transaction.atomic
    def write_in_transaction() -> Turn:
        # Progress resets the attempt count, so a long agent is not failed for retries spread over hours.
        fenced = Run.objects.filter(pk=ctx.run_id, lease_token=ctx.lease_token).update(
            attempt=1, updated_at=DbNow(), cost_usd=F("cost_usd") + cost, **counters
        )
        if not fenced:
            raise LeaseLostError()
        Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters, **step_changes)
        turn = create_turn(ctx, index, COMPACTION if compacted else TURN, request, response, participant, cost)
        _freeze_txn(ctx, head)
        if response.batch:
            batches.journaled_txn(response.request_id)
        _record_refusal_txn(ctx, index, response)
        if compacted:
            record_event(
                ctx.run_id,
                "compacted",
                step_id=ctx.step_id,
                turn=index,
                covers_until=compacted.covers_until,
                prompt_tokens_before=compacted.prompt_tokens_before,
                summary_tokens=usage.output_tokens,
            )
        writes.committing = True
        return turn

    return _journal(ctx, request, response, cost, writes, write, f"turn {index} of step {ctx.step_id}")


def frozen_head(ctx: Any) -> dict[str, Any] | None:
    """The step's conversation head as its first model call froze it; None before that call."""
    return Step.objects.filter(pk=ctx.step.pk).values_list("frozen_request", flat=True).first()


def _freeze_txn(ctx: Any, head: dict[str, Any] | None) -> None:
    # Only the first journaled call freezes: a head already there (a racing zombie's is fenced out) stays.
    if head is not None:
        Step.objects.filter(pk=ctx.step.pk, frozen_request__isnull=True).update(frozen_request=head)


def _record_refusal_txn(ctx: Any, index: int, response: ModelResponse) -> None:
    if response.stop_reason == "refusal":
        details = dict(response.stop_details or {})
        record_event(
            ctx.run_id,
            "model_refused",
            step_id=ctx.step_id,
            turn=index,
            model=response.model,
            category=details.get("category"),
            explanation=details.get("explanation"),
        )


def record_thinking_dropped(ctx: Any, models: list[str], model: str) -> None:
    """A model swap left out thinking blocks the model now asked cannot read: on the run's record."""
    record_event(ctx.run_id, "thinking_dropped", step_id=ctx.step_id, models=models, asked=model)


def journal_call(
    ctx: Any,
    purpose: str,
    request: ModelRequest,
    response: ModelResponse,
    participant: str,
    *,
    head: dict[str, Any] | None = None,
) -> Turn:
    """Journal a model call of a judge or planner step with its usage, fenced by the lease token (and the step's
    head with its first call)."""
    cost = cost_usd(response.model, response.usage, batch=response.batch)
    counters = usage_counters(response.usage)
    writes = _Writes()

    @transaction.atomic
    def write() -> Turn:
        if writes.maybe_landed and (landed := landed_turn(_billed(ctx, request, response, cost, writes, ""))):
            return landed
        last = Turn.objects.filter(step_id=ctx.step.pk).aggregate(last=Max("index"))["last"]
        index = writes.index = 0 if last is None else last + 1
        if not Run.objects.filter(pk=ctx.run_id, lease_token=ctx.lease_token).update(
            cost_usd=F("cost_usd") + cost, updated_at=DbNow(), **counters
        ):
            raise LeaseLostError()
        Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters)
        turn = create_turn(ctx, index, purpose, request, response, participant, cost)
        _freeze_txn(ctx, head)
        if response.batch:
            batches.journaled_txn(response.request_id)
        _record_refusal_txn(ctx, index, response)
        writes.committing = True
        return turn

    return _journal(ctx, request, response, cost, writes, write, f"{purpose} call of step {ctx.step_id}")


def _journal(
    ctx: Any,
    request: ModelRequest,
    response: ModelResponse,
    cost: Decimal,
    writes: _Writes,
    write: Callable[[], Turn],
    what: str,
) -> Turn:
    """`write()` the billed answer into the journal; whatever stops it, count its usage, then raise."""
    # A batch answer that is not journaled is not lost: its batch turn keeps it for the next execution to journal,
    # or for the batcher to count once no step will (engine/batches.py). Counting it here would count it twice.
    count = (lambda billed: None) if response.batch else count_unjournaled
    try:
        turn = _written(write, writes)
    except LeaseLostError:
        count(_billed(ctx, request, response, cost, writes, "lease lost"))
        raise
    except IntegrityError as exc:
        count(_billed(ctx, request, response, cost, writes, "journaled by another worker"))
        raise LeaseLostError(f"{what} was journaled by another worker") from exc
    except Exception as exc:  # noqa: BLE001 - whatever stopped the write, the answer was billed
        count(_billed(ctx, request, response, cost, writes, _why_not_journaled(exc)))
        raise
    record_owed()
    return turn


def _why_not_journaled(exc: Exception) -> str:
    if isinstance(exc.__cause__, PoolTimeout):
        return "no free database connection"
    if isinstance(exc, DatabaseError):
        return f"the database did not take the journal ({type(exc).__name__})"
    return f"the journal failed ({type(exc).__name__})"


def _written(write: Callable[[], Turn], writes: _Writes) -> Turn:
    """`write()`, waited out while the connection pool has no free connection (up to POOL_WAITS times), and tried
    once more on a fresh connection after any other error on the connection.

    A pool timeout is raised when a connection is asked for, before anything is sent: trying again is safe. Any
    other OperationalError or InterfaceError (the connection died, a deadlock, a lock timeout) rolled the write back
    unless it hit the COMMIT (`writes.committing`); then the retry looks for the Turn it may have committed. The
    lease renewer has a connection of its own, so the lease outlives the waits.
    """
    waits = 0
    while True:
        writes.committing = False
        try:
            return write()
        except (OperationalError, InterfaceError) as exc:
            writes.maybe_landed = writes.maybe_landed or writes.committing
            if isinstance(exc.__cause__, PoolTimeout):
                waits += 1
                if waits >= POOL_WAITS:
                    raise
                logger.warning("no free database connection after %d waits; waiting again to journal an answer", waits)
                continue
            if writes.reconnected or not fresh_connection():
                raise
            writes.reconnected = True
            logger.warning(
                "journaling a billed answer failed on its database connection (%s: %s); writing it once more on a "
                "fresh connection",
                type(exc).__name__,
                exc,
            )


def _billed(
    ctx: Any, request: ModelRequest, response: ModelResponse, cost: Decimal, writes: _Writes, reason: str
) -> Unjournaled:
    return Unjournaled(
        run_id=ctx.run_id,
        step_pk=ctx.step.pk,
        step_id=ctx.step_id,
        index=writes.index,
        usage=response.usage,
        cost=cost,
        reason=reason,
        # An error raised in the last write's COMMIT (whatever it was) may have come after the commit landed.
        maybe_journaled=writes.maybe_landed or writes.committing,
        request_id=response.request_id,
        request_digest=request.digest(),
        content=[dict(b) for b in response.content],
    )
