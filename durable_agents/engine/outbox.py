"""Notifications through the outbox: each is an Effect row, sent by its own task, claimed before it is sent.

A notification row (kind "notification") moves like this::

    notify_txn ──commit──► enqueue(effect id) ──► deliver(effect id):
      1. skip     its wait closed ("expired" notices excepted) or it has nobody to go to → `skipped`, why
      2. claim    one conditional UPDATE (pending and due) counts the attempt and holds the row for the
                  send timeout plus the backoff: a duplicate task or an overlapping sweep finds it not due
      3. send     outside any transaction, bounded by NOTIFY_SEND_TIMEOUT_SECONDS
      4. record   `applied`; or the error, and the next attempt after the backoff; after
                  NOTIFY_MAX_ATTEMPTS, `failed` with `needs_attention`, a `notification_failed` event and
                  a warning
    the sweep only finds due rows (SKIP LOCKED, a bounded batch) and enqueues them; it never sends.

A request whose decision link this site cannot make (durable_agents.urls not included, a published SECRET_KEY) is
written `failed` with `needs_attention` at once and never enqueued: it fails alone, never the run, whose wait stays
open for the admin and `durable_decide`.

One retry owner: this module. Celery never retries the task; a lost or crashed task is found again by the
sweep once its row is due. Due times and backoff are on the database's clock (STATEMENT_TIMESTAMP),
never a worker's. Status changes go through engine/transitions. The engine never imports Celery:
enqueueing goes through NOTIFICATION_ENQUEUER.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import asdict
from datetime import timedelta
from functools import cache, partial
from typing import Any

from django.db import transaction
from django.db.models import Exists, F, Q, QuerySet
from django.db.models.functions import Coalesce
from django.utils.module_loading import import_string

from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.engine import transitions
from durable_agents.engine.events import record_event
from durable_agents.engine.notices import notification_for
from durable_agents.engine.retry import error_of
from durable_agents.engine.wake import OUTAGES, one_line
from durable_agents.errors import DecisionLinkError
from durable_agents.models import Effect, EffectKind, EffectStatus, Wait, WaitStatus
from durable_agents.notify import Notification, get_notifier
from durable_agents.states import EffectOp
from durable_agents.workflows import RetryPolicy

logger = logging.getLogger("durable_agents.notify")

# These ask a human to act on an open wait: once it is decided, sending them would ask for nothing.
SENT_ONLY_WHILE_OPEN = frozenset({"requested", "reminder", "warning", "escalation"})
NO_RECIPIENTS = "no recipients"
MAX_ERROR_CHARS = 500


class Delivery(enum.Enum):
    """What one `deliver` call did."""

    SENT = "sent"
    RETRYING = "retrying"  # the send failed; tried again after the backoff
    FAILED = "failed"  # the last allowed attempt failed: given up, visibly
    SKIPPED = "skipped"  # not sent on purpose (wait closed, nobody to send to)
    NOT_DUE = "not_due"  # another sender holds it, it is backing off, or it is settled already


# --- Writing and enqueueing -------------------------------------------------------------------------------


def notify_txn(wait: Wait, kind: str, number: int = 1) -> Effect:
    """Write the notification's outbox row in the current transaction; enqueue its delivery after commit.

    The key (wait, kind, number) makes a repeated call a no-op. A worker that dies right after the commit,
    or a broker that loses the message, leaves the row pending: the sweep enqueues it again.
    """
    key = f"wait:{wait.pk}:{kind}:{number}"
    try:
        notification, unsendable = notification_for(wait, kind, number), None
    except DecisionLinkError as exc:
        notification, unsendable = notification_for(wait, kind, number, link=False), exc
    effect, created = Effect.objects.get_or_create(
        idempotency_key=key,
        defaults={
            "run_id": wait.run_id,
            "tool": f"notify.{kind}",
            "kind": EffectKind.NOTIFICATION,
            "args": asdict(notification),
            "args_hash": key,
        },
    )
    if created and unsendable is not None:
        _fail_unsendable_txn(effect, wait, unsendable)
    elif created:
        transaction.on_commit(partial(enqueue, effect.pk))
    return effect


def _fail_unsendable_txn(effect: Effect, wait: Wait, exc: DecisionLinkError) -> None:
    """A request whose decision link this site cannot make is failed at once, never sent: the run goes on waiting
    (the wait is open, decidable in the admin and by command), and an operator sees what to fix."""
    attention = (
        f"Not sent: {exc}. Meanwhile decide the wait in the admin, or with "
        f"`manage.py durable_decide {wait.pk} --approve` (or --reject)."
    )
    _mark_failed(effect.pk, 0, error_of(exc, MAX_ERROR_CHARS), attention)
    record_event(effect.run_id, "notification_failed", key=effect.idempotency_key, needs_attention=attention)
    transaction.on_commit(partial(logger.warning, "notification %s failed: %s", effect.idempotency_key, attention))


@cache
def _enqueuer(path: str) -> Any:
    return import_string(path)


def enqueue(effect_id: int) -> None:
    """Hand one notification to a worker through DURABLE_AGENTS['NOTIFICATION_ENQUEUER'].

    A broker that cannot take the message loses nothing: the row is committed and the sweep finds it.
    """
    try:
        _enqueuer(settings.NOTIFICATION_ENQUEUER)(effect_id)
    except OUTAGES as exc:
        # The broker is down: one line (the row is committed, the sweep enqueues it), never a traceback per row.
        logger.warning("could not enqueue notification %s (%s); the sweep will", effect_id, one_line(exc))
    except Exception:  # noqa: BLE001 - the database has the row; the sweep is the fallback
        logger.warning("could not enqueue notification %s now; the sweep will", effect_id, exc_info=True)


def enqueue_due(*, batch: int | None = None) -> int:
    """The sweep's share: enqueue a bounded batch of due notifications nobody has picked up. Never sends.

    Picked: pending rows that are due (never tried, or past their backoff) and not enqueued since they
    became due — or enqueued longer than NOTIFY_RETRY_SECONDS ago, so that message is presumed lost.
    `updated_at` marks the last hand-over (write, claim, outcome, enqueue), so two sweeps and the task
    itself do not enqueue the same row twice. Rows never tried go first, then by how long they have been
    due: undeliverable rows that keep failing are backed off and cannot starve a new one.
    """
    limit = batch or int(settings.SWEEP_BATCH)
    lost = Q(updated_at__lt=DbNow(timedelta(seconds=-float(settings.NOTIFY_RETRY_SECONDS))))
    not_enqueued_since_due = Q(next_attempt_at__isnull=False, updated_at__lt=F("next_attempt_at"))
    candidates = (
        _due(Effect.objects.filter(kind=EffectKind.NOTIFICATION, status=EffectStatus.PENDING))
        .filter(lost | not_enqueued_since_due)
        .order_by("attempts", Coalesce("next_attempt_at", "created_at"), "id")
    )
    with transaction.atomic():
        ids = list(candidates.select_for_update(skip_locked=True).values_list("id", flat=True)[:limit])
        if ids:
            Effect.objects.filter(pk__in=ids).update(updated_at=DbNow())
            transaction.on_commit(partial(_enqueue_all, ids))
    return len(ids)


def _enqueue_all(effect_ids: list[int]) -> None:
    for effect_id in effect_ids:
        enqueue(effect_id)


# --- Delivering one notification --------------------------------------------------------------------------


def deliver(effect_id: int) -> Delivery:
    """Send notification `effect_id` once if it is due; record the outcome. Call it outside any transaction.

    Safe to call concurrently and repeatedly (duplicate tasks, overlapping sweeps): the claim lets one in.
    """
    effect = Effect.objects.filter(pk=effect_id, kind=EffectKind.NOTIFICATION).first()
    if effect is None or effect.status != EffectStatus.PENDING:
        return Delivery.NOT_DUE
    notifier = get_notifier()
    reason = _skip_reason(effect, notifier)
    if reason:
        return _skip(effect, reason)
    attempt = effect.attempts + 1
    backoff = RetryPolicy(
        backoff=float(settings.NOTIFY_BACKOFF_SECONDS), backoff_max=float(settings.NOTIFY_BACKOFF_MAX_SECONDS)
    ).delay(attempt)
    # The hold covers the send and its backoff: if this worker dies mid-send, the row is due again after it.
    hold = float(settings.NOTIFY_SEND_TIMEOUT_SECONDS) + backoff
    # The claim checks again that the wait is open: one decided since the skip check is not asked about.
    still_open = (
        Exists(Wait.objects.open(keyed=True).filter(pk=effect.args.get("wait_id")))
        if effect.args.get("kind") in SENT_ONLY_WHILE_OPEN
        else Q()
    )
    claimable = Effect.objects.filter(still_open, pk=effect.pk, status=EffectStatus.PENDING, attempts=effect.attempts)
    claimed = _due(claimable).update(
        attempts=attempt, next_attempt_at=DbNow(timedelta(seconds=hold)), updated_at=DbNow()
    )
    if not claimed:
        reason = _skip_reason(effect, notifier)
        return _skip(effect, reason) if reason else Delivery.NOT_DUE
    try:
        notifier.send(_message(effect), idempotency_key=effect.idempotency_key)
    except Exception as exc:  # noqa: BLE001 - any failure of a pluggable notifier is one failed attempt
        return _record_failure(effect, attempt, backoff, exc)
    _mark_applied(effect.pk)
    return Delivery.SENT


def _message(effect: Effect) -> Notification:
    args = dict(effect.args)
    args["recipients"] = tuple(args.get("recipients", ()))
    return Notification(**args)


def _skip_reason(effect: Effect, notifier: Any) -> str:
    """Why this notification must not be sent at all, or "" to send it."""
    args = effect.args
    if args.get("kind") in SENT_ONLY_WHILE_OPEN:
        wait = Wait.objects.filter(pk=args.get("wait_id")).values_list("status", "decided_by").first()
        if wait is None:
            return f"wait {args.get('wait_id')} no longer exists"
        status, decided_by = wait
        if status != WaitStatus.OPEN:
            return f"wait {args['wait_id']} is already {status}" + (f" by {decided_by}" if decided_by else "")
    # A notifier that addresses people (email) has nobody to address; a webhook posts to its URL anyway.
    if not args.get("recipients") and getattr(notifier, "needs_recipients", True):
        return NO_RECIPIENTS
    return ""


def _skip(effect: Effect, reason: str) -> Delivery:
    with transaction.atomic():
        if not _mark_skipped(effect.pk, reason):
            return Delivery.NOT_DUE
        if reason == NO_RECIPIENTS:
            # Not an error of the send, but a request nobody receives is a misconfiguration to see.
            record_event(effect.run_id, "notification_skipped", key=effect.idempotency_key, reason=reason)
    if reason == NO_RECIPIENTS:
        logger.warning(
            "notification %s was not sent: no recipients; set notify_to or DURABLE_AGENTS['APPROVERS']",
            effect.idempotency_key,
        )
    return Delivery.SKIPPED


def _record_failure(effect: Effect, attempt: int, backoff: float, exc: Exception) -> Delivery:
    error = error_of(exc, MAX_ERROR_CHARS)
    allowed = int(settings.NOTIFY_MAX_ATTEMPTS)
    detail = {"key": effect.idempotency_key, "attempt": attempt, "error": error}
    if attempt < allowed:
        with transaction.atomic():
            recorded = {**error, "attempt": attempt, "backoff_seconds": round(backoff, 3)}
            if not _record_retry(effect.pk, attempt, recorded, backoff):
                return Delivery.NOT_DUE
            record_event(effect.run_id, "notification_retry", **detail, backoff_seconds=round(backoff, 3))
        logger.info("notification %s attempt %s failed: %s", effect.idempotency_key, attempt, error["message"])
        return Delivery.RETRYING
    attention = (
        f"Not delivered after {attempt} attempts; last error {error['type']}: {error['message']}. "
        f"Check the notifier ({settings.NOTIFIER}) and what it sends to, then tell "
        f"{', '.join(effect.args.get('recipients') or ()) or 'the approvers'} yourself "
        "or decide the wait in the admin."
    )
    with transaction.atomic():
        if not _mark_failed(effect.pk, attempt, {**error, "attempt": attempt}, attention):
            return Delivery.NOT_DUE
        record_event(effect.run_id, "notification_failed", **detail, needs_attention=attention)
    logger.warning("notification %s gave up: %s", effect.idempotency_key, attention)
    return Delivery.FAILED


def _record_retry(effect_id: int, attempt: int, error: dict[str, Any], backoff: float) -> bool:
    # Fenced by the attempt: a sender whose hold ran out and was overtaken does not rewrite the next one's.
    return bool(
        Effect.objects.filter(pk=effect_id, status=EffectStatus.PENDING, attempts=attempt).update(
            error=error, next_attempt_at=DbNow(timedelta(seconds=backoff)), updated_at=DbNow()
        )
    )


# --- Outcomes ---------------------------------------------------------------------------------------------


def _mark_applied(effect_id: int) -> bool:
    return transitions.move_effect(
        EffectOp.APPLY, effect_id, to=EffectStatus.APPLIED, applied_at=DbNow(), next_attempt_at=None, error=None
    )


def _mark_skipped(effect_id: int, reason: str) -> bool:
    # Only while due: a sender holding the row is mid-send, and its outcome is the one to record.
    return transitions.move_effect(
        EffectOp.SKIP,
        effect_id,
        to=EffectStatus.SKIPPED,
        where=_due_now(),
        result={"skipped": reason},
        next_attempt_at=None,
    )


def _mark_failed(effect_id: int, attempt: int, error: dict[str, Any], attention: str) -> bool:
    return transitions.move_effect(
        EffectOp.FAIL,
        effect_id,
        to=EffectStatus.FAILED,
        where=Q(attempts=attempt),
        error=error,
        needs_attention=attention,
        next_attempt_at=None,
    )


def _due_now() -> Q:
    return Q(next_attempt_at__isnull=True) | Q(next_attempt_at__lte=DbNow())


def _due(queryset: QuerySet[Effect]) -> QuerySet[Effect]:
    return queryset.filter(_due_now())


__all__ = ["Delivery", "deliver", "enqueue", "enqueue_due", "notify_txn"]
