"""The journal of model calls: every answer is committed, fenced by the lease token, before it is acted on.

A turn of the agent loop, a compaction, a judge's verdict, a planner's plan and a participant-written brief
are each one Turn row, written in one short transaction with the usage added to the step and the run. A
zombie's answer (its lease lost, or the turn journaled by another worker) is not journaled, but it was
billed: its usage is still counted, and an event says so.

A step's first journaled call also freezes the step's conversation head (Step.frozen_request: model, system,
tools, first prompt, thinking, effort) in the same transaction, so every later call sends the same head. What
the API returned is stored as it returned it (Turn.content is text on Postgres, keys in the model's order), so a
rebuilt request is byte-identical to the one first sent. A refusal's stop_details go with its turn and an event.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from decimal import Decimal
from typing import Any, TypeVar

from django.db import IntegrityError, InterfaceError, OperationalError, transaction
from django.db.models import F, Max

from durable_agents.agents import rate_limits
from durable_agents.agents.compaction import Compacted
from durable_agents.agents.messages import COMPACTION, TURN, ModelRequest, ModelResponse, Participant, Usage
from durable_agents.agents.pricing import cost_usd
from durable_agents.clock import DbNow
from durable_agents.connections import release_connection
from durable_agents.engine.events import record_event
from durable_agents.errors import LeaseLostError
from durable_agents.models import Run, Step, Turn

try:
    from psycopg_pool import PoolTimeout
except ImportError:  # no pool installed: no pool timeouts either
    PoolTimeout = type("PoolTimeout", (Exception,), {})

T = TypeVar("T")
logger = logging.getLogger("durable_agents.engine")
POOL_WAITS = 5  # pool timeouts (DATABASES OPTIONS pool "timeout" each) a journaling write waits out


def ask(ctx: Any, participant: Participant, request: ModelRequest) -> ModelResponse:
    """One model call of a step: prove the lease first (a thawed zombie stops here, before paying for an answer
    another worker may already have journaled), then ask holding no database connection while the model
    thinks, for a participant that waits on the network (`remote`). Journal the answer before acting on it.
    """
    remote = getattr(participant, "remote", False)

    def prove() -> None:
        ctx.ensure_lease()
        if remote:
            release_connection()

    prove()
    # A wait for room in the shared rate limit can outlast the lease: proven again after it, right before the call.
    with rate_limits.proving_after_waits(prove):
        return participant.respond(request)


def waiting_for_a_connection(write: Callable[[], T]) -> T:
    """`write()`, waiting again (up to POOL_WAITS times) while the connection pool has no free connection.

    A pool timeout is raised when a connection is asked for, before anything is sent: nothing was written, so
    trying again is safe — and needed, since the answer being journaled was billed and giving up would ask the
    model for it again. The lease renewer has a connection of its own, so the lease outlives the wait.
    """
    for waited in range(1, POOL_WAITS + 1):
        try:
            return write()
        except OperationalError as exc:
            if not isinstance(exc.__cause__, PoolTimeout) or waited == POOL_WAITS:
                raise
            logger.warning("no free database connection after %d waits; waiting again to journal an answer", waited)
    raise AssertionError("unreachable")


def usage_counters(usage: Usage) -> dict[str, Any]:
    """F-expression updates that add one call's usage to a Run's or Step's counters."""
    return {
        "input_tokens": F("input_tokens") + usage.input_tokens,
        "output_tokens": F("output_tokens") + usage.output_tokens,
        "cache_write_tokens": F("cache_write_tokens") + usage.cache_write_tokens,
        "cache_read_tokens": F("cache_read_tokens") + usage.cache_read_tokens,
    }


def create_turn(
    ctx: Any, index: int, purpose: str, request: ModelRequest, response: ModelResponse, participant: str, cost: Any
) -> Turn:
    """The Turn row of one answered model call (call inside the journaling transaction)."""
    usage = response.usage
    return Turn.objects.create(
        run_id=ctx.run_id,
        step_id=ctx.step.pk,
        index=index,
        purpose=purpose,
        request_digest=request.digest(),
        content=[dict(b) for b in response.content],
        stop_reason=response.stop_reason,
        stop_details=dict(response.stop_details) if response.stop_details else None,
        model=response.model,
        participant=participant,
        request_id=response.request_id,
        cost_usd=cost,
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        cache_read_tokens=usage.cache_read_tokens,
    )


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
    cost = cost_usd(response.model, usage)
    counters = usage_counters(usage)
    step_changes: dict[str, Any] = {"context": compacted.as_json()} if compacted else {}

    @transaction.atomic
    def write() -> Turn:
        # Progress resets the attempt count, so a long agent is not failed for retries spread over hours.
        fenced = Run.objects.filter(pk=ctx.run_id, lease_token=ctx.lease_token).update(
            attempt=1, updated_at=DbNow(), cost_usd=F("cost_usd") + cost, **counters
        )
        if not fenced:
            raise LeaseLostError()
        Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters, **step_changes)
        turn = create_turn(ctx, index, COMPACTION if compacted else TURN, request, response, participant, cost)
        _freeze_txn(ctx, head)
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
        return turn

    try:
        return waiting_for_a_connection(write)
    except LeaseLostError:
        count_unjournaled(ctx, index, usage, cost, "lease lost")
        raise
    except IntegrityError as exc:
        count_unjournaled(ctx, index, usage, cost, "journaled by another worker")
        raise LeaseLostError(f"turn {index} of step {ctx.step_id} was journaled by another worker") from exc
    except (OperationalError, InterfaceError) as exc:
        _count_after_database_error(ctx, index, usage, cost, exc)
        raise


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


def count_unjournaled(ctx: Any, index: int, usage: Usage, cost: Decimal, why: str) -> None:
    """A zombie's answer is not journaled, but it was billed: the run's spend (and budget) must still see it."""
    counters = usage_counters(usage)
    with transaction.atomic():
        Run.objects.filter(pk=ctx.run_id).update(cost_usd=F("cost_usd") + cost, **counters)
        Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters)
        record_event(
            ctx.run_id,
            "unjournaled_usage",
            step_id=ctx.step_id,
            turn=index,
            reason=why,
            tokens=usage.total_tokens,
            cost_usd=str(cost),
        )


def _count_after_database_error(ctx: Any, index: int, usage: Usage, cost: Decimal, exc: Exception) -> None:
    """A billed answer the database would not take: counted, if nothing of it was written (the pool never gave
    a connection) and the database takes this now. Any other error may have come after the commit landed
    (then the retried step replays the turn, counted once), so it is not counted twice here."""
    if isinstance(exc.__cause__, PoolTimeout):
        with contextlib.suppress(OperationalError, InterfaceError):
            count_unjournaled(ctx, index, usage, cost, "no free database connection")


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
    cost = cost_usd(response.model, response.usage)
    counters = usage_counters(response.usage)
    index = 0

    @transaction.atomic
    def write() -> Turn:
        nonlocal index
        last = Turn.objects.filter(step_id=ctx.step.pk).aggregate(last=Max("index"))["last"]
        index = 0 if last is None else last + 1
        if not Run.objects.filter(pk=ctx.run_id, lease_token=ctx.lease_token).update(
            cost_usd=F("cost_usd") + cost, updated_at=DbNow(), **counters
        ):
            raise LeaseLostError()
        Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters)
        turn = create_turn(ctx, index, purpose, request, response, participant, cost)
        _freeze_txn(ctx, head)
        _record_refusal_txn(ctx, index, response)
        return turn

    try:
        return waiting_for_a_connection(write)
    except LeaseLostError:
        count_unjournaled(ctx, index, response.usage, cost, "lease lost")
        raise
    except IntegrityError as exc:
        count_unjournaled(ctx, index, response.usage, cost, "journaled by another worker")
        raise LeaseLostError(f"{purpose} call of step {ctx.step_id} was journaled by another worker") from exc
    except (OperationalError, InterfaceError) as exc:
        _count_after_database_error(ctx, index, response.usage, cost, exc)
        raise
