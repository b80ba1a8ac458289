"""Effects exactly once: the outbox row is committed before an effectful tool runs, keyed deterministically.

* transactional tools (their effect lands in this database) run inside the transaction that marks the
  Effect `applied`, under a row lock: a crash leaves both or neither, and a concurrent duplicate waits;
* external tools are called outside any transaction with the key passed on (the receiver dedupes): a
  crash between the call and the record calls again with the same key. Every invocation is counted
  before it starts; past EFFECT_MAX_INVOCATIONS the outcome is unknowable and an operator decides;
* a key already `applied` returns its stored result without calling the tool; the same key with other
  arguments is an IdempotencyKeyReusedError (Stripe semantics).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.events import record_event
from durable_agents.engine.retry import TRANSIENT_TYPES
from durable_agents.errors import (
    EffectOutcomeUnknownError,
    IdempotencyKeyReusedError,
    LeaseLostError,
    PermanentError,
)
from durable_agents.models import Effect, EffectKind, EffectStatus, Run
from durable_agents.storable import check_json
from durable_agents.tools import Tool

logger = logging.getLogger("durable_agents.effects")

MAX_ERROR_CHARS = 2000


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
) -> Any:
    """Invoke `tool` with `args` under idempotency `key`; read-only tools are simply called.

    With `lease_token`, a transactional effect commits only while that token still holds the run.
    """
    checked = tool.validate(args)
    if not tool.effectful:
        return tool.invoke(checked, ctx=ctx)
    effect = _record_pending(tool, checked, key=key, run_id=run_id, step_pk=step_pk, compensates=compensates)
    if effect.status in (EffectStatus.APPLIED, EffectStatus.COMPENSATED):
        return effect.result
    if tool.transactional:
        return _apply_in_transaction(tool, checked, effect, ctx, lease_token)
    return _apply_external(tool, checked, effect, ctx)


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
    if effect.status == EffectStatus.FAILED:
        # A resumed run tries a permanently failed effect again, on purpose.
        Effect.objects.filter(pk=effect.pk, status=EffectStatus.FAILED).update(
            status=EffectStatus.PENDING, error=None, needs_attention=""
        )
        effect.status = EffectStatus.PENDING
    return effect


def _apply_in_transaction(
    tool: Tool[..., Any], args: dict[str, Any], effect: Effect, ctx: Any, lease_token: int | None
) -> Any:
    try:
        with transaction.atomic():
            # A zombie must not apply an effect after the run was taken from it (say, cancelled with
            # compensation, which lists the applied effects): lock the run row and check the token.
            if lease_token is not None and not (
                Run.objects.select_for_update().filter(pk=effect.run_id, lease_token=lease_token).exists()
            ):
                raise LeaseLostError(f"run {effect.run_id} was taken over; {tool.name} was not applied")
            # The row lock makes a concurrent duplicate wait here, then see `applied`.
            locked = Effect.objects.select_for_update().get(pk=effect.pk)
            if locked.status in (EffectStatus.APPLIED, EffectStatus.COMPENSATED):
                return locked.result
            result = tool.invoke(args, idempotency_key=effect.idempotency_key, ctx=ctx)
            # An unstorable result rolls the tool's own writes back with it: applied without a record is no option.
            _check_result(tool, result)
            Effect.objects.filter(pk=effect.pk).update(
                status=EffectStatus.APPLIED,
                result=result,
                error=None,
                attempts=F("attempts") + 1,
                applied_at=clock.now(),
            )
            _applied_txn(effect)
            return result
    except Exception as exc:
        _record_failure(effect, exc)
        raise


def _apply_external(tool: Tool[..., Any], args: dict[str, Any], effect: Effect, ctx: Any) -> Any:
    limit = int(settings.EFFECT_MAX_INVOCATIONS)
    started = Effect.objects.filter(pk=effect.pk, status=EffectStatus.PENDING, attempts__lt=limit).update(
        attempts=F("attempts") + 1
    )
    if not started:
        current = Effect.objects.get(pk=effect.pk)
        if current.status == EffectStatus.APPLIED:
            return current.result
        reason = (
            f"{tool.name} was invoked {current.attempts} times under key {effect.idempotency_key!r} without a "
            "recorded outcome; check the receiving system, then mark the effect applied or failed"
        )
        Effect.objects.filter(pk=effect.pk).update(needs_attention=reason)
        raise EffectOutcomeUnknownError(reason)
    try:
        result = tool.invoke(args, idempotency_key=effect.idempotency_key, ctx=ctx)
    except Exception as exc:
        _record_failure(effect, exc)
        raise
    # The receiver applied it, but its answer cannot be recorded: the effect stays pending (a resume calls
    # again under the same key, which the receiver dedupes) and the step fails saying why.
    _check_result(tool, result)
    with transaction.atomic():
        Effect.objects.filter(pk=effect.pk).update(
            status=EffectStatus.APPLIED, result=result, error=None, applied_at=clock.now()
        )
        _applied_txn(effect)
    return result


def _check_result(tool: Tool[..., Any], result: Any) -> None:
    """PermanentError naming the spot, if the Effect.result column (jsonb) cannot store what the tool returned."""
    check_json(result, f"the result of tool {tool.name!r}", PermanentError)


def _applied_txn(effect: Effect) -> None:
    if effect.compensates_id is not None:
        Effect.objects.filter(pk=effect.compensates_id).update(status=EffectStatus.COMPENSATED)
        record_event(effect.run_id, "effect_compensated", key=effect.idempotency_key, tool=effect.tool)


def _record_failure(effect: Effect, exc: BaseException) -> None:
    """Transient errors leave the effect pending (it will be invoked again); others mark it failed.

    A zombie's refusal (LeaseLostError) says nothing about the effect: it stays as it was.
    """
    if isinstance(exc, LeaseLostError):
        return
    transient = isinstance(exc, TRANSIENT_TYPES) and not isinstance(exc, PermanentError)
    error = {"type": type(exc).__name__, "message": (str(exc) or type(exc).__name__)[:MAX_ERROR_CHARS]}
    Effect.objects.filter(pk=effect.pk, status=EffectStatus.PENDING).update(
        error=error, **({} if transient else {"status": EffectStatus.FAILED})
    )
