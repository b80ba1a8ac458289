"""Waking a run: hands its id to the configured waker (the Celery task by default) after commit."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from functools import cache

from django.db import transaction
from django.utils.module_loading import import_string

from durable_agents.conf import settings

logger = logging.getLogger("durable_agents.engine")


@cache
def _waker(path: str) -> Callable[..., None]:
    return import_string(path)


def wake(run_id: uuid.UUID | str, countdown: float | None = None) -> None:
    """Ask a worker to advance `run_id` (now, or after `countdown` seconds).

    A broker that cannot take the message loses nothing: the run is committed and the sweep wakes it
    later, so the caller (who may be starting the run) must not see an error for it.
    """
    try:
        _waker(settings.WAKER)(str(run_id), countdown=countdown)
    except Exception:  # noqa: BLE001 - the database has the run; the sweep is the fallback
        logger.warning("could not wake run %s now; the sweep will", run_id, exc_info=True)


def wake_on_commit(run_id: uuid.UUID | str, countdown: float | None = None) -> None:
    """Wake the run once the current transaction commits; a rollback sends nothing."""
    transaction.on_commit(lambda: wake(run_id, countdown=countdown))
