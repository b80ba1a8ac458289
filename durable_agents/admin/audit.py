"""The console's audit trail: every operator action done in the admin is a `LogEntry` (who, when, what was done).

The admin index's "Recent actions" lists them, and the run and schedule pages show their own. The engine records
its own event with the operator as actor for run actions; the log entry says what the operator asked for in the
console's words ("Cancelled (with compensation)"), the event what the engine did.

Example::

    record(request, run, "Delivered signal 'paid'")
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db.models import Model
from django.http import HttpRequest

from durable_agents import clock
from durable_agents.models import Event

# The operator actions a page shows (newest first); the admin's own history page has all of them.
SHOWN = 50
REPR_CHARS = 200  # LogEntry.object_repr
# A log entry and the event the engine recorded for the same action are this close in time (one request).
LINK_WINDOW = timedelta(seconds=10)


def noted(text: str, what: str, value: Any) -> str:
    """`text`, then what the operator wrote (a reason, a comment), bounded for the log's one line."""
    value = str(value or "").strip()
    return f"{text} ({what}: {value[:200]}{'…' if len(value) > 200 else ''})" if value else text


def record(request: HttpRequest, obj: Model, message: str, *, added: bool = False) -> None:
    """Log that the operator of `request` did `message` to `obj` (a change; `added`: it was created)."""
    LogEntry.objects.bulk_create([_entry(request, obj, message, ADDITION if added else CHANGE, clock.now())])


def record_each(request: HttpRequest, model: type[Model], pks: Iterable[Any], message: str) -> None:
    """Log `message` once per object of `model` the operator changed in a bulk action (one INSERT)."""
    objects = list(model._default_manager.filter(pk__in=list(pks)))
    if objects:
        at = clock.now()
        LogEntry.objects.bulk_create([_entry(request, obj, message, CHANGE, at) for obj in objects])


def _entry(request: HttpRequest, obj: Model, message: str, flag: int, at: datetime) -> LogEntry:
    # "Recent actions" shows an entry's object_repr, never its message: the repr carries what was done too.
    # Stamped on the engine's clock, as its events are, so an entry finds its event (`with_events`).
    return LogEntry(
        action_time=at,
        user_id=request.user.pk,
        content_type=ContentType.objects.get_for_model(type(obj)),
        object_id=str(obj.pk),
        object_repr=f"{obj} — {message}"[:REPR_CHARS],
        action_flag=flag,
        change_message=message,
    )


def recorded_for(obj: Model) -> list[LogEntry]:
    """The console's log entries about `obj`, newest first (one query)."""
    content_type = ContentType.objects.get_for_model(type(obj))
    return list(
        LogEntry.objects.filter(content_type=content_type, object_id=str(obj.pk))
        .select_related("user")
        .order_by("-action_time", "-id")[:SHOWN]
    )


def with_events(entries: list[LogEntry], events: Iterable[Event]) -> list[tuple[LogEntry, Event | None]]:
    """Each log entry with the event the engine recorded for the same action (same actor, nearest in time), so
    the run page links the two instead of telling the action twice; None when the event is not among `events`."""
    free = [e for e in events if e.actor]
    linked = []
    for entry in entries:
        who = entry.user.get_username()
        near = [e for e in free if e.actor == who and abs(e.created_at - entry.action_time) <= LINK_WINDOW]
        event = min(near, key=lambda e: abs(e.created_at - entry.action_time), default=None)
        if event is not None:
            free.remove(event)
        linked.append((entry, event))
    return linked
