"""Waking a run: hands its id to the configured waker (the Celery task by default) after commit.

With a MODEL_QUEUE, a run whose next step waits on the model (agent, judge, planner, approval) is woken on that
queue, served by a gevent worker where a thousand such steps wait at once; every other step stays on the default
queue and its prefork workers. A waker then receives `queue=` (None: the default).

Runs woken by one transaction — a thousand started together, the sweep re-waking those an outage stranded, a
fan-out's children — go out WAKE_BATCH_SIZE to a message (BATCH_WAKER): one task advances them one after another
within its eager slice, each by its own claim exactly as if it had its own message, and passes each of the rest on
in a message of its own when the slice is spent (so none waits behind more than one spent slice). Model-bound runs,
whose steps spend any slice waiting on the model, are woken one message each. A batch is a delivery of several runs,
nothing more: a duplicate, a redelivery after a worker's death or a lost message does to each of its runs what it
does to a run with a message of its own.

A run woken later (a retry's backoff, a wait for the model's capacity) is parked until its `wake_at`, on the database
clock. Only a short delay, up to MAX_COUNTDOWN_SECONDS, also goes out as a broker countdown: Celery hands a countdown's
message to a worker at once, and the worker holds it until it is due — on RabbitMQ without native delayed delivery
(a quorum queue on a direct exchange: checks W010) in its only prefetch slot, which no other run can use meanwhile.
A longer delay sends nothing: the sweep wakes every runnable run whose wake_at has passed, within its period.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from django.db import connection, transaction
from django.db.models import Subquery
from django.utils.module_loading import import_string

from durable_agents.conf import DEFAULTS, settings
from durable_agents.errors import BrokerUnavailableError
from durable_agents.models import Run, Step, StepKind

# Steps that spend their time waiting on the model's answer (an approval may ask for its brief).
MODEL_BOUND_KINDS = frozenset({StepKind.AGENT, StepKind.JUDGE, StepKind.PLANNER, StepKind.APPROVAL})

logger = logging.getLogger("durable_agents.engine")

# A broker that did not take a message: the default wakers' translation (tasks.py), or a waker's own socket error.
OUTAGES: tuple[type[Exception], ...] = (BrokerUnavailableError, OSError)


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


def wake(run_id: uuid.UUID | str, countdown: float | None = None, *, kind: str | None = None) -> bool:
    """Ask a worker to advance `run_id` (now, or after `countdown` seconds); False if that could not be asked.

    A broker that cannot take the message loses nothing: the run is committed and the sweep wakes it
    later, so the caller (who may be starting the run) must not see an error for it. `kind`: the next step's,
    when the caller knows it (it saves a query). A countdown longer than MAX_COUNTDOWN_SECONDS sends nothing: its
    caller parked the run until then (`wake_at`), and the sweep wakes it when it is due.
    """
    if countdown is not None and countdown > float(settings.MAX_COUNTDOWN_SECONDS):
        return True
    try:
        queue = queue_for(run_id, kind)
    except Exception:  # noqa: BLE001 - the database has the run; the sweep is the fallback
        logger.warning("could not wake run %s now; the sweep will", run_id, exc_info=True)
        return False
    return _send(run_id, countdown, queue)


def _send(run_id: uuid.UUID | str, countdown: float | None, queue: str | None) -> bool:
    """Hand the run to the WAKER, on `queue` (None: the default); False if it could not take it."""
    try:
        routed = {"queue": queue} if queue else {}
        if routed and not _takes_queue(settings.WAKER):
            logger.error("WAKER %s takes no `queue`: run %s is woken on its default queue", settings.WAKER, run_id)
            routed = {}
        _waker(settings.WAKER)(str(run_id), countdown=countdown, **routed)
    except Exception as exc:  # noqa: BLE001 - the database has the run; the sweep is the fallback
        _could_not_wake([str(run_id)], exc)
        return False
    return True


def _could_not_wake(run_ids: Sequence[str], exc: Exception) -> None:
    """Log a wake-up that did not leave: one line for a broker outage (the sweep rides it out; a traceback per run
    would bury the log), with its traceback for anything else (a bug in a waker of the product's)."""
    what = f"run {run_ids[0]}" if len(run_ids) == 1 else f"{len(run_ids)} runs ({run_ids[0]}…)"
    if isinstance(exc, OUTAGES):
        kept = (
            "the run is kept, and the sweep wakes it"
            if len(run_ids) == 1
            else "the runs are kept, and the sweep wakes them"
        )
        logger.warning("could not wake %s (%s): %s once the broker is back", what, one_line(exc), kept)
    else:
        logger.warning("could not wake %s now; the sweep will", what, exc_info=True)


def one_line(exc: BaseException) -> str:
    """An error's message on one line, for a log line (its type if it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def queue_for(run_id: uuid.UUID | str, kind: str | None = None) -> str | None:
    """REPLAY_QUEUE for a replay run (if set), else MODEL_QUEUE if the run's next step (of `kind`, if known) waits on
    the model, else None (the default)."""
    replay_queue = settings.REPLAY_QUEUE
    if replay_queue and Run.objects.filter(pk=run_id).exclude(replay_lane="").exists():
        return replay_queue
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


def wake_many(run_ids: Sequence[uuid.UUID | str], *, kinds: Sequence[str | None] | None = None) -> list[str]:
    """Ask workers to advance each of `run_ids` now: WAKE_BATCH_SIZE to a message if batching is on, a model-bound
    run (with a MODEL_QUEUE) alone (else, and for a lone run, as wake() does). `kinds`: each run's next step's,
    where known (saves a query each). Like wake(), it loses nothing if the broker refuses: the sweep wakes what was
    not sent. Returns the runs that could not be woken."""
    kinds = kinds if kinds is not None else [None] * len(run_ids)
    batch_waker = batch_waker_path()
    if len(run_ids) < 2 or not batch_waker:
        return [str(run_id) for run_id, kind in zip(run_ids, kinds, strict=True) if not wake(run_id, kind=kind)]
    refused: list[str] = []
    by_queue: dict[str | None, list[str]] = {}
    for run_id, kind in zip(run_ids, kinds, strict=True):
        try:
            by_queue.setdefault(queue_for(run_id, kind), []).append(str(run_id))
        except Exception:  # noqa: BLE001 - as wake(): the database has the run; the sweep is the fallback
            logger.warning("could not wake run %s now; the sweep will", run_id, exc_info=True)
            refused.append(str(run_id))
    size = int(settings.WAKE_BATCH_SIZE)
    for queue, ids in by_queue.items():
        if queue:
            # The model queue: each step waits on the model, which spends any slice, so in one message the runs
            # would wait one after another; a message each lets the model queue's pool wait on them all at once.
            refused.extend(run_id for run_id in ids if not _send(run_id, None, queue))
            continue
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            try:
                _waker(batch_waker)(chunk, **({"queue": queue} if queue else {}))
            except Exception as exc:  # noqa: BLE001 - the database has the runs; the sweep is the fallback
                _could_not_wake(chunk, exc)
                refused.extend(chunk)
    return refused


def batch_waker_path() -> str:
    """BATCH_WAKER, if runs go out in batches: not with WAKE_BATCH_SIZE 1 or one step per task (EAGER_SLICE_MS 0),
    nor when a WAKER of the product's own would be bypassed by the default BATCH_WAKER."""
    path = settings.BATCH_WAKER
    if not path or int(settings.WAKE_BATCH_SIZE) < 2 or float(settings.EAGER_SLICE_MS) <= 0:
        return ""
    own_waker = settings.WAKER
    return "" if path == DEFAULTS["BATCH_WAKER"] and own_waker != DEFAULTS["WAKER"] else path


class _WakeBatch:
    """Runs woken one after another in one transaction at one savepoint level, each by an on-commit hook of its own
    (a _Wake), sent together (wake_many) by the first of those hooks that runs.

    Each run keeps its own hook, so Django does to it what it does to a lone run's: a rollback — of the
    transaction, or of the savepoint it was registered in — discards it (all of a batch's hooks share their
    savepoints, so a rollback discards all or none); hooks registered between two wakes keep their place (a run
    woken after another hook opens a new batch); TestCase.captureOnCommitCallbacks captures and runs the hooks
    registered in its block. A hook sends its own run and the batch's later ones not yet sent."""

    def __init__(self) -> None:
        self.run_ids: list[uuid.UUID | str] = []
        self.kinds: list[str | None] = []
        self.sent: list[bool] = []

    def add(self, run_id: uuid.UUID | str, kind: str | None) -> None:
        self.run_ids.append(run_id)
        self.kinds.append(kind)
        self.sent.append(False)
        transaction.on_commit(_Wake(self, len(self.run_ids) - 1))

    def send_from(self, index: int) -> None:
        """Send the runs from `index` on that no hook has sent yet."""
        unsent = [i for i in range(index, len(self.run_ids)) if not self.sent[i]]
        for i in unsent:
            self.sent[i] = True
        wake_many([self.run_ids[i] for i in unsent], kinds=[self.kinds[i] for i in unsent])


@dataclass(frozen=True)
class _Wake:
    """The on-commit hook of the `index`-th run of a batch."""

    batch: _WakeBatch
    index: int

    def __call__(self) -> None:
        self.batch.send_from(self.index)


def wake_on_commit(run_id: uuid.UUID | str, countdown: float | None = None, *, kind: str | None = None) -> None:
    """Wake the run once the current transaction commits; a rollback sends nothing. Runs woken now (no countdown)
    one after another in one transaction go out together (wake_many)."""
    if countdown is None and connection.in_atomic_block and batch_waker_path():
        _open_batch().add(run_id, kind)
        return
    transaction.on_commit(lambda: wake(run_id, countdown=countdown, kind=kind))


def _open_batch() -> _WakeBatch:
    """The batch of the last hook registered in this transaction, if it is a run's and was registered at the
    current savepoint level (Django keeps the pending hooks, each with the savepoints active when it was
    registered, in `run_on_commit`); else a new one."""
    pending = connection.run_on_commit
    if pending:
        registered_in, hook, _robust = pending[-1]
        if isinstance(hook, _Wake) and registered_in == set(connection.savepoint_ids):
            return hook.batch
    return _WakeBatch()
