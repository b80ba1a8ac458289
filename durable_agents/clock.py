"""The engine's clock is the database's: leases, wake-ups, deadlines and "stuck" are compared on it.

Workers disagree about the time (a clock 20 s ahead would take over live leases); the database is the
one referee they share. `now()` reads it (one round trip); `db_now()` is the same time as an SQL
expression, for writes and filters that need no round trip. On SQLite, the embedded default, the
database runs inside this process, so its clock is this machine's.

Tests may shift the engine's time with `advance()`; the shift applies to both, in this process only.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import DateTimeField, Func
from django.utils import timezone

_offset = timedelta(0)


def now(using: str = "default") -> datetime:
    """The database's current time (UTC, aware), shifted by `advance()` in tests."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return timezone.now() + _offset
    with connection.cursor() as cursor:
        cursor.execute("SELECT STATEMENT_TIMESTAMP()")
        (value,) = cursor.fetchone()
    return value + _offset


def offset(plus: timedelta = timedelta(0)) -> timedelta:
    """The test shift plus `plus`: what SQL adds to the database's time (`STATEMENT_TIMESTAMP() + %s`)."""
    return _offset + plus


class DbNow(Func):
    """The database's time (+ `plus`) as an SQL expression: `.update(updated_at=DbNow())`,
    `.filter(lease_expires_at__lt=DbNow())`, `.update(wake_at=DbNow(timedelta(seconds=5)))`.

    STATEMENT_TIMESTAMP, not CLOCK_TIMESTAMP: it is stable within a statement, so indexes still serve
    comparisons with it, and one statement sees one time.
    """

    output_field = DateTimeField()

    def __init__(self, plus: timedelta = timedelta(0)) -> None:
        super().__init__()
        self.plus = plus

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        shift = offset(self.plus)
        if not shift:
            return "STATEMENT_TIMESTAMP()", []
        return "(STATEMENT_TIMESTAMP() + %s)", [shift]

    def as_sql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list[Any]]:
        # The embedded database shares this process's clock: pass the time as a parameter.
        return "%s", [connection.ops.adapt_datetimefield_value(timezone.now() + offset(self.plus))]


def advance(delta: timedelta) -> None:
    """Move this process's engine time forward; for tests of deadlines, leases and freshness."""
    global _offset
    _offset += delta


def reset() -> None:
    global _offset
    _offset = timedelta(0)
