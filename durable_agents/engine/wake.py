"""Waking a run: hands its id to the configured waker (the Celery task by default) after commit."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import cache

from django.db import transaction
from django.utils.module_loading import import_string

from durable_agents.conf import settings


@cache
def _waker(path: str) -> Callable[..., None]:
    return import_string(path)


def wake(run_id: uuid.UUID | str, countdown: float | None = None) -> None:
    """Ask a worker to advance `run_id` (now, or after `countdown` seconds)."""
    _waker(settings.WAKER)(str(run_id), countdown=countdown)


def wake_on_commit(run_id: uuid.UUID | str, countdown: float | None = None) -> None:
    """Wake the run once the current transaction commits; a rollback sends nothing."""
    transaction.on_commit(lambda: wake(run_id, countdown=countdown))
