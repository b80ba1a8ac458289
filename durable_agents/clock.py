"""The engine's clock: one place to read the time, so tests can move it."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

_offset = timedelta(0)


def now() -> datetime:
    """The current time (UTC, aware), shifted by `advance()` in tests."""
    return timezone.now() + _offset


def advance(delta: timedelta) -> None:
    """Move this process's clock forward; for tests of deadlines and freshness."""
    global _offset
    _offset += delta


def reset() -> None:
    global _offset
    _offset = timedelta(0)
