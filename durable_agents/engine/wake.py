"""Waking a run: hands its id to the configured waker (the Celery task by default) after commit.

With a MODEL_QUEUE, a run whose next step waits on the model (agent, judge, planner, approval) is woken on that
queue, served by a gevent worker where a thousand such steps wait at once; every other step stays on the default
queue and its prefork workers. A waker then receives `queue=` (None: the default).
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Callable
from functools import cache

from django.db import transaction
from django.db.models import Subquery
from django.utils.module_loading import import_string

from durable_agents.conf import settings
from durable_agents.models import Run, Step, StepKind

# Steps that spend their time waiting on the model's answer (an approval may ask for its brief).
MODEL_BOUND_KINDS = frozenset({StepKind.AGENT, StepKind.JUDGE, StepKind.PLANNER, StepKind.APPROVAL})

logger = logging.getLogger("durable_agents.engine")


@cache
def _waker(path: str) -> Callable[..., None]:
    return import_string(path)


@cache
def _takes_queue(path: str) -> bool:
    """True if the WAKER accepts `queue=` (the pre-MODEL_QUEUE signature was `waker(run_id, countdown=None)`)."""
    try:
        parameters = inspect.signature(_waker(path)).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "queue" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def wake(run_id: uuid.UUID | str, countdown: float | None = None, *, kind: str | None = None) -> None:
    """Ask a worker to advance `run_id` (now, or after `countdown` seconds).

    A broker that cannot take the message loses nothing: the run is committed and the sweep wakes it
    later, so the caller (who may be starting the run) must not see an error for it. `kind`: the next step's,
    when the caller knows it (it saves a query).
    """
    try:
        queue = queue_for(run_id, kind)
        routed = {"queue": queue} if queue else {}
        if routed and not _takes_queue(settings.WAKER):
            logger.error("WAKER %s takes no `queue`: run %s is woken on its default queue", settings.WAKER, run_id)
            routed = {}
        _waker(settings.WAKER)(str(run_id), countdown=countdown, **routed)
    except Exception:  # noqa: BLE001 - the database has the run; the sweep is the fallback
        logger.warning("could not wake run %s now; the sweep will", run_id, exc_info=True)


def queue_for(run_id: uuid.UUID | str, kind: str | None = None) -> str | None:
    """MODEL_QUEUE if the run's next step (of `kind`, if known) waits on the model, else None (the default)."""
    model_queue = settings.MODEL_QUEUE
    if not model_queue:
        return None
    if kind is None:
        kind = next_kind(run_id)
    return model_queue if kind in MODEL_BOUND_KINDS else None


def next_kind(run_id: uuid.UUID | str) -> str | None:
    """The kind of the step under the run's cursor (one query); None if there is none."""
    cursor = Run.objects.filter(pk=run_id).values("cursor")[:1]
    steps = Step.objects.live().filter(run_id=run_id, position=Subquery(cursor))
    return steps.values_list("kind", flat=True).first()


def wake_on_commit(run_id: uuid.UUID | str, countdown: float | None = None, *, kind: str | None = None) -> None:
    """Wake the run once the current transaction commits; a rollback sends nothing."""
    transaction.on_commit(lambda: wake(run_id, countdown=countdown, kind=kind))
