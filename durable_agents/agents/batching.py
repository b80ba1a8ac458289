"""Half-price turns: a model step's calls sent through the Message Batches API, its run parked until the answer.

`agent(..., delivery="batch")` (and `judge`, `planner`; or `workflow(..., delivery="batch")` for every model step
that does not say otherwise) sends each model call of the step in a Message Batch, billed at half the price of
the same call live (https://platform.claude.com/docs/en/build-with-claude/batch-processing):

1. the call is journaled as submitted — a BatchTurn row with the request, fenced by the run's lease — and the run
   parks on a `batch` wait: no worker slot, no connection, nothing polls it;
2. the batcher (agents/batcher.py, sent by the sweep) puts queued turns in one batch, sends it, polls it with
   backoff, and records each result: the wait closes and the run wakes;
3. the step, re-executed, replays its journal, comes to the same call, and finds the answer: it is journaled as
   a Turn of that index like any live answer (cost at batch prices), and the loop goes on. A step with five turns
   parks five times.

What a result that is not an answer does, like the same outcome live:

    errored      the API's error, as a live call would raise it: overloaded, api_error, rate limits retry the step
                 (the retry sends the turn again); an invalid request fails the step with the API's words
    expired,     by `Batch.on_expired`: "retry" (default) sends the turn in a new batch, "live" asks now, "fail"
    canceled     fails the step (a resume sends it again)
    deadline     `Batch.deadline` passed with no answer: by `Batch.on_deadline`, "live" (default) gives up on the
                 batch and asks now, "fail" fails the step (a resume sends it again); the batch's late answer is
                 counted, never used. An answer recorded as the deadline passed is used, not asked for again
    malformed    a succeeded message without content or usage: retried like an api_error, never journaled empty

A turn asked live after all (a deadline's or an expiry's "live") is checked against the run's budget at live prices
first: the budget let it go at batch prices, half as much.

An answer the API billed is counted on its run even when it is never used: an abandoned turn's late answer, one
that came just before its run was cancelled (the batcher counts it), or one a swapped-in participant that cannot
batch (a scripted one) made useless; a resumed step then asks again.

Only Claude through the API (the "anthropic" participant) is batched; a scripted or function participant answers
the same turn live. A replay run's turns go live unless its replay asks `delivery="batch"` (then every model call of
the replay run is batched, whatever its workflow says).

Example::

    agent("review", instructions=..., delivery="batch")                      # half price, answered within 24 h
    judge("check", rubric=..., delivery=Batch(deadline="2h", on_deadline="live"))
    workflow("nightly_triage", steps=[...], delivery="batch")                # every model step of the workflow
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from durable_agents import clock
from durable_agents.agents import claude
from durable_agents.agents.budget import Budget, estimate_prompt
from durable_agents.agents.claude import PERMANENT_HINTS, PROMPT_TOO_LONG_TEXT, TRANSIENT_ERROR_TYPES
from durable_agents.agents.messages import COMPACTION, TURN, ModelRequest, ModelResponse
from durable_agents.engine import batches, replaying
from durable_agents.engine.control import Park, WaitSpec
from durable_agents.engine.events import record_event
from durable_agents.errors import (
    ContextWindowExceededError,
    ModelRequestError,
    ModelUnavailableError,
    PermanentError,
    UnknownWorkflowError,
)
from durable_agents.models import BatchTurn, WaitKind
from durable_agents.states import BatchTurnStatus
from durable_agents.workflows import Batch, registry

# An errored result's error type -> the HTTP status the same error has live (https://platform.claude.com/docs/en/api/errors).
ERROR_STATUSES = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
}


def step_batch(ctx: Any, step_value: Batch | str | None) -> Batch | None:
    """The Batch the step's model calls go by, or None (live): the step's `delivery`, else its workflow's; in a
    replay run, the replay's (`api.replay(..., delivery="batch")`), whatever the workflow says."""
    if replaying.is_replay(getattr(ctx, "run", None)):
        return Batch() if replaying.case_of(ctx).delivery == "batch" else None
    chosen = step_value
    if chosen is None:
        try:
            chosen = registry.get(ctx.run.workflow, ctx.run.workflow_version).delivery
        except UnknownWorkflowError:
            chosen = None
    return chosen if isinstance(chosen, Batch) else None


def can_batch(participant: Any) -> bool:
    return bool(getattr(participant, "batchable", False))


def ask_batched(
    ctx: Any,
    request: ModelRequest,
    *,
    index: int,
    purpose: str,
    batch: Batch,
    live: Callable[[], ModelResponse],
) -> ModelResponse:
    """The answer to journal index `index` of the step: its batch's answer when it came; else the run parks until
    it comes (raises Park), or the policies above apply."""
    digest = request.digest()
    turn = batches.latest_turn(ctx.step.pk, index)
    if turn is not None and turn.purpose == COMPACTION and purpose == TURN:
        # The step was compacting before this turn (its request overflowed the context window) when it parked: the
        # re-executed loop does not know it until told, and compacts again, finding the compaction's own turn.
        raise ContextWindowExceededError(f"turn {index} overflowed the context window: compacting first")
    if turn is not None and turn.request_digest != digest:
        # Not this request (the model or participant changed since): its answer would answer something else, and
        # an answer already in was billed all the same (counted on the run).
        batches.set_aside(turn, "the step asks another request at this turn")
        turn = None
    if turn is None:
        _submit(ctx, request, index, purpose, batch, digest)
    if turn.used and (turn.status in batches.FAILED_RESULTS or is_malformed(turn)):
        if turn.status in (BatchTurnStatus.EXPIRED, BatchTurnStatus.CANCELED) and batch.on_expired == "live":
            return _ask_live(ctx, request, index, live)  # the policy chose a live answer: a retry stays live
        _submit(ctx, request, index, purpose, batch, digest)
    status = turn.status
    if status == BatchTurnStatus.SUCCEEDED:
        if not is_malformed(turn):
            return response_of(turn)
        batches.set_aside(turn, "its answer has no content or usage")  # billed all the same: counted on the run
        raise ModelUnavailableError(
            f"turn {index}'s answer in a Message Batch has no content or usage (the step retries, sending it again)"
        )
    if status in batches.IN_FLIGHT:
        if turn.deadline is not None and turn.deadline <= clock.now():
            if not batches.abandon(turn, "its deadline passed"):
                # Its result was recorded since it was read: act on that instead of paying for a live call too.
                return ask_batched(ctx, request, index=index, purpose=purpose, batch=batch, live=live)
            return _past_deadline(ctx, turn, batch, request, live)
        raise Park(_wait_spec(turn))
    if status == BatchTurnStatus.ABANDONED:
        past_deadline = turn.deadline is not None and turn.ended_at is not None and turn.deadline <= turn.ended_at
        # A step failed by on_deadline="fail" (the turn then marked used) is resumed to send the turn again.
        if past_deadline and not (batch.on_deadline == "fail" and turn.used):
            return _past_deadline(ctx, turn, batch, request, live)
        _submit(ctx, request, index, purpose, batch, digest)  # abandoned by a cancel the run was resumed from
    batches.mark_used(turn)
    if status == BatchTurnStatus.ERRORED:
        raise error_of(turn)
    why = f"the Message Batch {'expired' if status == BatchTurnStatus.EXPIRED else 'was canceled'} before turn {index}"
    if batch.on_expired == "live":
        record_event(ctx.run_id, "batch_fallback", step_id=ctx.step_id, turn=index, reason=why)
        return _ask_live(ctx, request, index, live)
    if batch.on_expired == "fail":
        raise PermanentError(f"{why} was answered (on_expired='fail'); resume the run to send it again")
    _submit(ctx, request, index, purpose, batch, digest)


def set_aside_batch_turn(ctx: Any, index: int) -> None:
    """Journal index `index` is answered another way (a participant that cannot batch): its batch turn, if any, is
    given up."""
    turn = batches.latest_turn(ctx.step.pk, index)
    if turn is not None:
        batches.set_aside(turn, "a participant that answers live took the turn")


def _past_deadline(
    ctx: Any, turn: BatchTurn, batch: Batch, request: ModelRequest, live: Callable[[], ModelResponse]
) -> ModelResponse:
    why = f"no answer from the Message Batches API to turn {turn.index} within its deadline ({batch.deadline})"
    if batch.on_deadline == "fail":
        batches.mark_used(turn)
        raise PermanentError(f"{why} (on_deadline='fail'); resume the run to send it again")
    record_event(ctx.run_id, "batch_fallback", step_id=ctx.step_id, turn=turn.index, reason=why)
    return _ask_live(ctx, request, turn.index, live)


def _ask_live(ctx: Any, request: ModelRequest, index: int, live: Callable[[], ModelResponse]) -> ModelResponse:
    """The turn asked live after all. Its budget was checked at batch prices, half the live ones: checked again."""
    run = getattr(ctx, "run", None)
    if run is not None:
        Budget.of(run).check(
            model=request.model,
            prompt_tokens=estimate_prompt(request.as_kwargs(), request.messages, None),
            max_tokens=request.max_tokens,
            purpose=f"turn {index}, asked live after its batch",
        )
    return live()


def _submit(ctx: Any, request: ModelRequest, index: int, purpose: str, batch: Batch, digest: str) -> NoReturn:
    ctx.ensure_lease()
    deadline = clock.now() + batch.deadline if batch.deadline else None
    turn = batches.queue_turn(
        ctx,
        index=index,
        purpose=purpose,
        params=request.as_kwargs(),
        digest=digest,
        model=request.model,
        deadline=deadline,
    )
    raise Park(_wait_spec(turn))


def _wait_spec(turn: BatchTurn) -> WaitSpec:
    return WaitSpec(kind=WaitKind.BATCH, name=turn.custom_id, deadline=turn.deadline)


def is_malformed(turn: BatchTurn) -> bool:
    """A succeeded result whose message lacks the content or usage a live answer always has."""
    if turn.status != BatchTurnStatus.SUCCEEDED:
        return False
    message = (turn.result or {}).get("message")
    return not (
        isinstance(message, dict)
        and isinstance(message.get("content"), list)
        and isinstance(message.get("usage"), dict)
    )


def response_of(turn: BatchTurn) -> ModelResponse:
    """A succeeded result's message as an answer to journal (priced at batch prices), read as a live answer is."""
    return claude.response_of((turn.result or {}).get("message") or {}, turn.custom_id, model=turn.model, batch=True)


def error_of(turn: BatchTurn) -> Exception:
    """An errored result as the live call would have raised it (claude.map_errors' rules)."""
    outer = (turn.result or {}).get("error")
    outer = outer if isinstance(outer, dict) else {}
    error = outer.get("error") if isinstance(outer.get("error"), dict) else outer
    kind = str(error.get("type") or "api_error")
    message = str(error.get("message") or kind)
    where = f"turn {turn.index} in a Message Batch: {kind}: {message}"
    if kind in TRANSIENT_ERROR_TYPES or kind not in ERROR_STATUSES:
        return ModelUnavailableError(f"{where} (the step retries, sending the turn again)")
    status = ERROR_STATUSES[kind]
    if status == 400 and PROMPT_TOO_LONG_TEXT in message.lower():
        return ContextWindowExceededError(f"{where} (the agent compacts the conversation and asks again, once)")
    hint = PERMANENT_HINTS.get(status, "the model API refused the request")
    return ModelRequestError(f"{where} ({hint}; resume the run to send it again)", status=status)
