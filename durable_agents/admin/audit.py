"""The console's audit trail: every operator action done in the admin is a `LogEntry` (who, when, what was done).

The admin index's "Recent actions" lists them, and the run and schedule pages show their own. The engine records
its own event with the operator as actor for run actions; the log entry says what the operator asked for in the
console's words ("Cancelled (with compensation)"), the event what the engine did.

Example::

    record(request, run, "Delivered signal 'paid'")
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db.models import Model
from django.http import HttpRequest

# The operator actions a page shows (newest first); the admin's own history page has all of them.
SHOWN = 50
REPR_CHARS = 200  # LogEntry.object_repr


def noted(text: str, what: str, value: Any) -> str:
    """`text`, then what the operator wrote (a reason, a comment), bounded for the log's one line."""
    value = str(value or "").strip()
    return f"{text} ({what}: {value[:200]}{'…' if len(value) > 200 else ''})" if value else text


def record(request: HttpRequest, obj: Model, message: str, *, added: bool = False) -> None:
    """Log that the operator of `request` did `message` to `obj` (a change; `added`: it was created)."""
    LogEntry.objects.bulk_create([_entry(request, obj, message, ADDITION if added else CHANGE)])


def record_each(request: HttpRequest, model: type[Model], pks: Iterable[Any], message: str) -> None:
    """Log `message` once per object of `model` the operator changed in a bulk action (one INSERT)."""
    objects = list(model._default_manager.filter(pk__in=list(pks)))
    LogEntry.objects.bulk_create([_entry(request, obj, message, CHANGE) for obj in objects])


def _entry(request: HttpRequest, obj: Model, message: str, flag: int) -> LogEntry:
    # "Recent actions" shows an entry's object_repr, never its message: the repr carries what was done too.
    return LogEntry(
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
