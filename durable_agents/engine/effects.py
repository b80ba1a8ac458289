"""Effects exactly once: the outbox row is committed before an effectful tool runs, keyed deterministically.

* transactional tools (their effect lands in this database) run inside the transaction that marks the
  Effect `applied`, under a row lock, after proving (in that transaction) that the executing worker still
  holds the run: a crash leaves both or neither, a concurrent duplicate waits, a zombie applies nothing;
* external tools are called outside any transaction with the key passed on (the receiver dedupes); the
  executing worker proves its lease right before the call, so a zombie whose run was taken over (say,
  cancelled and compensated) stops there. A crash between the call and the record calls again with the
  same key. Every invocation is counted before it starts; past EFFECT_MAX_INVOCATIONS the outcome is
  unknowable: the effect `needs_attention` and an operator records what happened (`resolve_effect`);
* a key already `applied` returns its stored result without calling the tool; the same key with other
  arguments is an IdempotencyKeyReusedError (Stripe semantics); a `compensated` key is refused: its
  result no longer holds (fork the run to do the work again, under new keys).

What no check can close: a worker paused between proving its lease and sending an external call may
still send it once when it thaws. The receiver dedupes on the key, so the effect still lands once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F

from durable_agents import tracing
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.connections import release_connection
from durable_agents.engine import replaying, transitions, turnpath
from durable_agents.engine.admission import admit_on_commit, key_of
from durable_agents.engine.events import record_event
from durable_agents.engine.lease import Claim
from durable_agents.engine.reliance import rely_on
from durable_agents.engine.retry import TRANSIENT_TYPES, error_of
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import (
    EffectOutcomeUnknownError,
    IdempotencyKeyReusedError,
    InvalidInputError,
    InvalidTransitionError,
    LeaseLostError,
    PermanentError,
    ToolFailedError,
)
from durable_agents.models import Effect, EffectKind, EffectStatus, Run, RunStatus
from durable_agents.redaction import redact
from durable_agents.states import EffectOp
from durable_agents.storable import check_json
from durable_agents.tools import Tool

logger = logging.getLogger("durable_agents.effects")

MAX_ERROR_CHARS = 2000
# Receivers limit idempotency keys (Stripe: 255 characters); longer keys are shortened, deterministically.
MAX_KEY_CHARS = 255


def effect_key(key: str) -> str:
    """`key` as stored and passed on: unchanged up to MAX_KEY_CHARS, else a prefix and the key's sha256."""
    if len(key) <= MAX_KEY_CHARS:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{key[: MAX_KEY_CHARS - len(digest) - 1]}~{digest}"


def recorded_effect(key: str) -> Effect | None:
    """The effect recorded under `key` (as `effect_key` stores it), if any: what a call already did."""
    return Effect.objects.filter(idempotency_key=effect_key(key), kind=EffectKind.EFFECT).first()


def invoke_tool(
    tool: Tool[..., Any],
    args: Mapping[str, Any],
    *,
    key: str,
    run_id: Any,
    step_pk: int | None,
    ctx: Any = None,
    compensates: Effect | None = None,
    lease_token: int | None = None,
    call_id: str = "",
    claim: Claim | None = None,
) -> Any:
    """Invoke `tool` with `args` under idempotency `key` for the executing run `run_id`; read-only tools
    are simply called. With `lease_token`, the effect lands only while that token still holds `run_id`.
    `call_id`: the model's tool_use id, for the trace. `claim`: the lease the executing step holds (with it, on
    Postgres, a new external effect's outbox row is written under the lease's proof, in one statement).

    Traced as the GenAI semantic conventions' `execute_tool {tool}` span (`gen_ai.tool.name`, `gen_ai.tool.call.id`)
    with the effect's key and outcome ("applied": it ran now, "reused": its recorded result was returned); a
    compensation is `compensate {tool}` (outcome "compensated")."""
    if not tracing.enabled():
        return _invoke(tool, args, key, run_id, step_pk, ctx, compensates, lease_token, claim)
    name = f"compensate {compensates.tool}" if compensates is not None else f"{tracing.EXECUTE_TOOL} {tool.name}"
    with tracing.span(name, _call_attributes(tool, args, call_id)) as traced:
        try:
            result = _invoke(tool, args, key, run_id, step_pk, ctx, compensates, lease_token, claim)
        except Exception as exc:
            # A tool's error may quote its arguments: its text is content.
            traced.fail(exc, message=redact(str(exc)) if tracing.content_enabled() else "")
            raise
        if tracing.content_enabled():
            traced.set({tracing.GEN_AI_TOOL_CALL_RESULT: _redacted_json(result)})
        return result


def _invoke(
    tool: Tool[..., Any],
    args: Mapping[str, Any],
    key: str,
    run_id: Any,
    step_pk: int | None,
    ctx: Any,
    compensates: Effect | None,
    lease_token: int | None,
    claim: Claim | None,
) -> Any:
    if replaying.is_replay(getattr(ctx, "run", None)):
        replaying.refuse(run_id, f"calls a tool ({tool.name})")
    checked = tool.validate(args)
    if not tool.effectful:
        return tool.invoke(checked, ctx=ctx)
    if claim is not None and _starts_at_once(tool, step_pk, compensates):
        started = _start_external(tool, checked, effect_key(key), claim, step_pk)
        if started is not None:
            return _call_external(tool, checked, started, ctx)
    effect = _record_pending(
        tool, checked, key=effect_key(key), run_id=run_id, step_pk=step_pk, compensates=compensates
    )
    tracing.current().set({tracing.EFFECT_KEY: effect.idempotency_key})
    if step_pk is not None and compensates is None and str(effect.run_id) != str(run_id):
        # Applied, or in flight, by another run under a key this run shares (a fork and its source): this run
        # relies on it too, so neither's saga undoes it while the other stands on it.
        rely_on([effect], run_id, [step_pk])
    if effect.status == EffectStatus.APPLIED:
        return _traced(effect, reused=True, result=effect.result)
    if tool.transactional:
        return _apply_in_transaction(tool, checked, effect, ctx, run_id, lease_token)
    return _apply_external(tool, checked, effect, ctx, run_id, lease_token)


def _call_attributes(tool: Tool[..., Any], args: Mapping[str, Any], call_id: str) -> dict[str, Any]:
    attributes = {
        tracing.GEN_AI_OPERATION_NAME: tracing.EXECUTE_TOOL,
        tracing.GEN_AI_TOOL_NAME: tool.name,
        tracing.GEN_AI_TOOL_CALL_ID: call_id or None,
    }
    if tracing.content_enabled():
        attributes[tracing.GEN_AI_TOOL_CALL_ARGUMENTS] = _redacted_json(args)
    return attributes


def _redacted_json(value: Any) -> str:
    return redact(json.dumps(value, default=str))


def _traced(effect: Effect, *, reused: bool, result: Any) -> Any:
    """`result`, its effect's outcome on the current span: reused (recorded before), applied or compensated now."""
    outcome = "reused" if reused else "compensated" if effect.compensates_id is not None else "applied"
    tracing.current().set({tracing.EFFECT_OUTCOME: outcome})
    return result


def _record_pending(
    tool: Tool[..., Any],
    args: dict[str, Any],
    *,
    key: str,
    run_id: Any,
    step_pk: int | None,
    compensates: Effect | None,
) -> Effect:
    args_hash = tool.args_hash(args)
    try:
        effect, _ = Effect.objects.get_or_create(
            idempotency_key=key,
            defaults={
                "run_id": run_id,
                "step_id": step_pk,
                "tool": tool.name,
                "args": args,
                "args_hash": args_hash,
                "kind": EffectKind.COMPENSATION if compensates else EffectKind.EFFECT,
                "compensates": compensates,
            },
        )
    except IntegrityError:
        # Two invocations raced on the insert; the loser reads the winner's row.
        effect = Effect.objects.get(idempotency_key=key)
    if effect.tool != tool.name or effect.args_hash != args_hash:
        raise IdempotencyKeyReusedError(
            f"idempotency key {key!r} was used for {effect.tool}({effect.args}) and is now reused for "
            f"{tool.name}({args}); nothing was applied"
        )
    if effect.status == EffectStatus.COMPENSATED:
        raise PermanentError(
            f"effect {key} ({tool.name}) was compensated: it was undone, so its result no longer holds and "
            "the same key cannot apply it again; fork the run (`durable_fork`) to do this work anew"
        )
    if effect.status == EffectStatus.FAILED:
        # A resumed run (or a fork sharing the key) tries a failed effect again, on purpose; the run that
        # applies it owns it, so that run's saga is the one to undo it.
        transitions.move_effect(
            EffectOp.RETRY,
            effect.pk,
            to=EffectStatus.PENDING,
            error=None,
            needs_attention="",
            run_id=run_id,
            step_id=step_pk if step_pk is not None else effect.step_id,
        )
        effect.refresh_from_db()
    return effect


def _apply_in_transaction(
    tool: Tool[..., Any], args: dict[str, Any], effect: Effect, ctx: Any, run_id: Any, lease_token: int | None
) -> Any:
    try:
        with transaction.atomic():
            # A zombie must not apply an effect after the run was taken from it (say, cancelled with
            # compensation, which lists the applied effects): lock the executing run's row, check the token.
            if lease_token is not None and not _holds(run_id, lease_token, lock=True):
                raise LeaseLostError(f"run {run_id} was taken over; {tool.name} was not applied")
            # The row lock makes a concurrent duplicate wait here, then see `applied`.
            locked = Effect.objects.select_for_update().get(pk=effect.pk)
            if locked.status == EffectStatus.APPLIED:
                return _traced(effect, reused=True, result=locked.result)
            result = tool.invoke(args, idempotency_key=effect.idempotency_key, ctx=ctx)
            # An unstorable result rolls the tool's own writes back with it: applied without a record is no option.
            _check_result(tool, result)
            _applied_txn(effect, result, attempts=F("attempts") + 1)
            return _traced(effect, reused=False, result=result)
    except Exception as exc:
        _record_failure(effect, exc)
        raise


def _starts_at_once(tool: Tool[..., Any], step_pk: int | None, compensates: Effect | None) -> bool:
    """An external effect of a step holding its lease, on Postgres: its outbox row, the lease proof and the count of
    its invocation are one statement (engine/hotpath.py start_effect); a key already recorded goes the general way."""
    return turnpath.is_available() and not tool.transactional and compensates is None and step_pk is not None


def _start_external(tool: Tool[..., Any], args: dict[str, Any], key: str, claim: Claim, step_pk: int) -> Effect | None:
    """Write a new key's outbox row, counted as invoked once, under the lease proven and extended for the call; None
    if the key is already recorded (nothing written). A zombie (its run taken over) writes nothing and stops here."""
    held, effect = transitions.start_external_effect(
        claim, key=key, step_pk=step_pk, tool=tool.name, args=args, args_hash=tool.args_hash(args)
    )
    if not held:
        raise LeaseLostError(f"run {claim.run_id} was taken over; {tool.name} was not called")
    if effect is not None:
        tracing.current().set({tracing.EFFECT_KEY: effect.idempotency_key})
    return effect


def _apply_external(
    tool: Tool[..., Any], args: dict[str, Any], effect: Effect, ctx: Any, run_id: Any, lease_token: int | None
) -> Any:
    limit = int(settings.EFFECT_MAX_INVOCATIONS)
    token = ctx.lease_token if ctx is not None else lease_token
    if ctx is not None:
        ctx.ensure_lease()  # extend the lease for the call
    # Right before the call, one short transaction proves the lease and counts the invocation, under the
    # run's row lock: a zombie (its run taken over, maybe cancelled and compensated) stops here, and a saga
    # planned after it sees an invocation of unknown outcome to learn and undo, even if this worker pauses
    # before sending. A saga being planned holds that lock, so the two are never interleaved.
    with transaction.atomic():
        held = token is None or _holds(run_id, token, lock=True)
        started = held and bool(
            Effect.objects.filter(pk=effect.pk, status=EffectStatus.PENDING, attempts__lt=limit).update(
                attempts=F("attempts") + 1, updated_at=DbNow()
            )
        )
    if not started:
        if not held:
            raise LeaseLostError(f"run {run_id} was taken over; {tool.name} was not called")
        current = Effect.objects.get(pk=effect.pk)
        if current.status == EffectStatus.APPLIED:
            return _traced(effect, reused=True, result=current.result)
        reason = (
            f"{tool.name} was invoked {current.attempts} times under key {effect.idempotency_key!r} without a "
            "recorded outcome; check the receiving system, then record what happened with "
            f"`manage.py durable_effect {effect.idempotency_key} --applied` or `--failed` (or the admin)"
        )
        Effect.objects.filter(pk=effect.pk).update(needs_attention=reason)
        raise EffectOutcomeUnknownError(reason)
    return _call_external(tool, args, effect, ctx)


def _call_external(tool: Tool[..., Any], args: dict[str, Any], effect: Effect, ctx: Any) -> Any:
    """Call an external tool whose invocation is counted, and record its outcome."""
    # A pooled connection goes back while the receiver answers: a thousand conversations' tools waiting on
    # outside systems must not hold every connection the journals and the other steps need.
    release_connection(pooled_only=True)
    try:
        result = tool.invoke(args, idempotency_key=effect.idempotency_key, ctx=ctx)
    except Exception as exc:
        _record_failure(effect, exc, outcome_known=isinstance(exc, ToolFailedError))
        raise
    # The receiver applied it, but its answer cannot be recorded: the effect stays pending (a resume calls
    # again under the same key, which the receiver dedupes) and the step fails saying why.
    _check_result(tool, result)
    if turnpath.is_available() and effect.compensates_id is None:
        transitions.effect_applied(effect.pk, result)  # as _applied_txn: one statement, no transaction around it
    else:
        with transaction.atomic():
            _applied_txn(effect, result)
    return _traced(effect, reused=False, result=result)


def _holds(run_id: Any, token: int, *, lock: bool = False) -> bool:
    held = Run.objects.filter(pk=run_id, lease_token=token, status__unindexed=RunStatus.RUNNING)
    return (held.select_for_update() if lock else held).exists()


def _check_result(tool: Tool[..., Any], result: Any) -> None:
    """PermanentError naming the spot, if the Effect.result column (jsonb) cannot store what the tool returned."""
    check_json(result, f"the result of tool {tool.name!r}", PermanentError)


def _applied_txn(effect: Effect, result: Any, **changes: Any) -> None:
    applied = transitions.move_effect(
        EffectOp.APPLY,
        effect.pk,
        to=EffectStatus.APPLIED,
        result=result,
        error=None,
        needs_attention="",
        applied_at=DbNow(),
        **changes,
    )
    if applied and effect.compensates_id is not None:
        _compensated_txn(effect)


def _compensated_txn(compensation: Effect) -> None:
    """The compensation landed: its original effect is undone."""
    transitions.move_effect(EffectOp.COMPENSATE, compensation.compensates_id, to=EffectStatus.COMPENSATED)
    record_event(compensation.run_id, "effect_compensated", key=compensation.idempotency_key, tool=compensation.tool)


def _record_failure(effect: Effect, exc: BaseException, *, outcome_known: bool = True) -> None:
    """A failed invocation. Known not applied (a rolled-back transactional tool, a ToolFailedError): the effect
    is failed, unless the error is transient. Outcome unknown (an external call that raised): it stays
    pending with its error, so a retry calls again under the same key and a saga learns the outcome.

    A zombie's refusal (LeaseLostError) says nothing about the effect: it stays as it was.
    """
    if isinstance(exc, LeaseLostError):
        return
    transient = isinstance(exc, TRANSIENT_TYPES) and not isinstance(exc, PermanentError)
    error = error_of(exc, MAX_ERROR_CHARS)
    if transient or not outcome_known:
        Effect.objects.filter(pk=effect.pk, status=EffectStatus.PENDING).update(error=error, updated_at=DbNow())
    else:
        transitions.move_effect(EffectOp.FAIL, effect.pk, to=EffectStatus.FAILED, error=error)


def resolve_effect(key: str, *, applied: bool, result: Any = None, actor: str, reason: str = "") -> Effect:
    """An operator records the outcome of an effect nobody could know (an external call in flight at a
    crash, invoked too often without an answer): it was `applied` (with the receiver's `result`), or not.

    Not applied: the effect is failed with its invocations reset, so a resumed run calls it again under
    the same key. Applied, for a run whose saga already passed it: its compensation is planned (the saga
    goes on, or starts again). Refused while a worker holds the run (the call may be in flight: wait for
    its step to end). Recorded in the run's history with `actor`.
    """
    effect = Effect.objects.filter(idempotency_key=key).first()
    if effect is None:
        raise InvalidInputError(f"no effect has key {key!r}; see a run's effects with `durable_show RUN_ID`")
    if effect.kind == EffectKind.NOTIFICATION:
        raise InvalidTransitionError(f"effect {key} is a notification; its delivery is retried by the engine")
    if effect.status not in (EffectStatus.PENDING, EffectStatus.FAILED):
        raise InvalidTransitionError(f"effect {key} is already {effect.status}; there is nothing to record")
    outcome = EffectStatus.APPLIED if applied else EffectStatus.FAILED
    changes: dict[str, Any] = {"needs_attention": ""}
    if applied:
        changes.update(result=result, error=None, applied_at=DbNow())
    else:
        why = reason or f"recorded as not applied by {actor}"
        changes.update(attempts=0, error={"type": "NotApplied", "message": why[:MAX_ERROR_CHARS]})
    with transaction.atomic():
        # The run's row lock orders this against a claim: no worker starts the call while it is recorded.
        if not Run.objects.select_for_update().filter(transitions.lease_free(), pk=effect.run_id).exists():
            raise InvalidTransitionError(
                f"run {effect.run_id} is being advanced: its call under key {key} may be in flight; record the "
                "outcome once its step ends (durable_show shows the lease), or cancel the run"
            )
        if not transitions.move_effect(EffectOp.RESOLVE, effect.pk, to=outcome, **changes):
            raise InvalidTransitionError(f"effect {key} changed meanwhile; look at it again")
        if applied and effect.compensates_id is not None:
            _compensated_txn(effect)
        record_event(
            effect.run_id, "effect_resolved", actor=actor, key=key, tool=effect.tool, outcome=outcome, reason=reason
        )
        if applied and effect.compensates_id is None and transitions.reopen_saga_txn(effect.run_id, key):
            # A saga that passed it while its outcome was unknown undoes it now; a run taken back from its end
            # queues for its concurrency key again and is handed a free slot at once.
            wake_on_commit(effect.run_id)
            admit_on_commit(key_of(effect.run_id))
    effect.refresh_from_db()
    return effect
