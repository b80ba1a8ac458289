"""Waking a run: hands its id to the configured waker (the Celery task by default) after commit.

With a MODEL_QUEUE, a run whose next step waits on the model (agent, judge, planner, approval) is woken on that
queue, served by a gevent worker where a thousand such steps wait at once; every other step stays on the default
queue and its prefork workers. A waker then receives `queue=` (None: the default).

Runs woken by one transaction — a thousand started together, the sweep re-waking those an outage stranded, a
fan-out's children — go out WAKE_BATCH_SIZE to a message (BATCH_WAKER): one task advances them one after another
within its eager slice, each by its own claim exactly as if it had its own message, and passes the rest on when
the slice is spent. A batch is a delivery of several runs, nothing more: a duplicate, a redelivery after a
worker's death or a lost message does to each of its runs what it does to a run with a message of its own.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Callable, Sequence
from functools import cache

from django.db import connection, transaction
from django.db.models import Subquery
from django.utils.module_loading import import_string

from durable_agents.conf import DEFAULTS, settings
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


def wake_many(run_ids: Sequence[uuid.UUID | str], *, kinds: Sequence[str | None] | None = None) -> None:
    """Ask workers to advance each of `run_ids` now: WAKE_BATCH_SIZE to a message, by queue, if batching is on
    (else, and for a lone run, as wake() does). `kinds`: each run's next step's, where known (saves a query each).
    Like wake(), it loses nothing if the broker refuses: the sweep wakes what was not sent."""
    kinds = kinds if kinds is not None else [None] * len(run_ids)
    batch_waker = _batch_waker_path()
    if len(run_ids) < 2 or not batch_waker:
        for run_id, kind in zip(run_ids, kinds, strict=True):
            wake(run_id, kind=kind)
        return
    by_queue: dict[str | None, list[str]] = {}
    for run_id, kind in zip(run_ids, kinds, strict=True):
        try:
            by_queue.setdefault(queue_for(run_id, kind), []).append(str(run_id))
        except Exception:  # noqa: BLE001 - as wake(): the database has the run; the sweep is the fallback
            logger.warning("could not wake run %s now; the sweep will", run_id, exc_info=True)
    size = int(settings.WAKE_BATCH_SIZE)
    for queue, ids in by_queue.items():
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            try:
                _waker(batch_waker)(chunk, **({"queue": queue} if queue else {}))
            except Exception:  # noqa: BLE001 - the database has the runs; the sweep is the fallback
                logger.warning("could not wake %d runs now (%s…); the sweep will", len(chunk), chunk[0], exc_info=True)


def _batch_waker_path() -> str:
    """BATCH_WAKER, if runs go out in batches: not with WAKE_BATCH_SIZE 1 or one step per task (EAGER_SLICE_MS 0),
    nor when a WAKER of the product's own would be bypassed by the default BATCH_WAKER."""
    path = settings.BATCH_WAKER
    if not path or int(settings.WAKE_BATCH_SIZE) < 2 or float(settings.EAGER_SLICE_MS) <= 0:
        return ""
    own_waker = settings.WAKER
    return "" if path == DEFAULTS["BATCH_WAKER"] and own_waker != DEFAULTS["WAKER"] else path


class _WakeBatch:
    """The runs woken in one transaction at one savepoint level, sent together (wake_many) once it commits.

    It is one on-commit hook among the transaction's others, so a rollback — of the transaction, or of the
    savepoint it was registered in — discards it and sends nothing, as it would each run's own hook."""

    def __init__(self) -> None:
        self.run_ids: list[uuid.UUID | str] = []
        self.kinds: list[str | None] = []

    def add(self, run_id: uuid.UUID | str, kind: str | None) -> None:
        self.run_ids.append(run_id)
        self.kinds.append(kind)

    def __call__(self) -> None:
        wake_many(self.run_ids, kinds=self.kinds)


def wake_on_commit(run_id: uuid.UUID | str, countdown: float | None = None, *, kind: str | None = None) -> None:
    """Wake the run once the current transaction commits; a rollback sends nothing. Runs woken now (no countdown)
    in one transaction go out together (wake_many)."""
    if countdown is None and connection.in_atomic_block and _batch_waker_path():
        _open_batch().add(run_id, kind)
        return
    transaction.on_commit(lambda: wake(run_id, countdown=countdown, kind=kind))


def _open_batch() -> _WakeBatch:
    """This transaction's batch at the current savepoint level, registered as an on-commit hook on first use.

    Found among the connection's pending hooks (Django keeps them, each with the savepoints active when it was
    registered, in `run_on_commit`): one that a rollback discarded or a commit ran is no longer there."""
    savepoints = set(connection.savepoint_ids)
    for registered_in, hook, _robust in reversed(connection.run_on_commit):
        if isinstance(hook, _WakeBatch):
            if registered_in == savepoints:
                return hook
            break
    batch = _WakeBatch()
    transaction.on_commit(batch)
    return batch
