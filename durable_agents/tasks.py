"""Celery tasks: thin wrappers that take ids only. Celery wakes workers; the engine owns the state.

Each task carries its own options (acks_late, reject_on_worker_lost, JSON): a product's global Celery
configuration is left alone. Delivery is at-least-once; the claim makes duplicates harmless. Celery never
retries `advance` or `deliver_notification`: the engine owns retries and persists every attempt. Messages go
to DURABLE_AGENTS["QUEUE"] (Celery's default queue if empty), notifications to NOTIFY_QUEUE (else QUEUE), so
a slow notification receiver never holds a worker slot a step is waiting for.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from celery import shared_task
from celery.exceptions import OperationalError as BrokerError
from celery.signals import (
    beat_init,
    celeryd_after_setup,
    celeryd_init,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from celery.worker import state as worker_state
from django.db import InterfaceError, OperationalError

from durable_agents import broker, preflight, retention
from durable_agents.agents import batcher
from durable_agents.agents.journal import PoolTimeout
from durable_agents.broker import countdown_route
from durable_agents.conf import settings as durable_settings
from durable_agents.connections import drop_connections
from durable_agents.engine import advance as engine_advance
from durable_agents.engine import batches as engine_batches
from durable_agents.engine import heartbeats as engine_heartbeats
from durable_agents.engine import outbox as engine_outbox
from durable_agents.engine import sweep as engine_sweep
from durable_agents.engine.eager import Batch
from durable_agents.engine.gather import GATHERER
from durable_agents.engine.lease import name_this_worker
from durable_agents.engine.wake import queue_for
from durable_agents.engine.wake import wake as engine_wake
from durable_agents.engine.wake import wake_many as engine_wake_many
from durable_agents.errors import BrokerUnavailableError

T = TypeVar("T")
logger = logging.getLogger("durable_agents.engine")


def _dropping_dead_connections(work: Callable[[], T]) -> T:
    """Run `work`; after a database connection error, drop this thread's connections (and the dead idle ones of
    their pools) and re-raise.

    Workers keep connections between tasks (CELERY_DB_REUSE_MAX, or Django's psycopg pool, which hands idle
    connections out untested), so after a Postgres restart nothing else would drop the dead ones. The lease expires
    and the sweep re-wakes the run. (Not after a PoolTimeout: no connection was had, none is dead.)
    """
    try:
        return work()
    except (OperationalError, InterfaceError) as exc:
        if not isinstance(exc.__cause__, PoolTimeout):
            drop_connections()
        raise


# Options of the tasks themselves, whatever the product's CELERY_TASK_* settings say: ids only, as JSON.
JSON = {"serializer": "json", "ignore_result": True}


@shared_task(bind=True, name="durable_agents.advance", acks_late=True, reject_on_worker_lost=True, **JSON)
def advance(self: Any, run_id: str) -> str:
    """Advance run `run_id` by one step, and by the next ones while the eager slice allows (or pass the message on
    to the queue its next step belongs to)."""
    delivered_on = (getattr(self.request, "delivery_info", None) or {}).get("routing_key")
    try:
        return _dropping_dead_connections(lambda: _advance_or_pass_on(run_id, delivered_on))
    except OperationalError as exc:
        if not isinstance(exc.__cause__, PoolTimeout):
            raise
        return _no_connection(run_id)


@shared_task(bind=True, name="durable_agents.advance_many", acks_late=True, reject_on_worker_lost=True, **JSON)
def advance_many(self: Any, run_ids: list[str]) -> str:
    """Advance runs woken together (engine/wake.py), one after another, each as `advance` advances a run sent on
    its own, all within one eager slice (a run's last commit may claim the next run: engine/eager.py Batch);
    those not begun when it is spent go on in a message each (those the broker refuses are advanced here, one step
    each: this message was theirs). A run whose advance raises ends the task as `advance` would end, once the runs
    after it have their message."""
    if not isinstance(run_ids, list) or not all(isinstance(run_id, str) for run_id in run_ids):
        logger.error("advance_many takes a list of run ids, not %r: message dropped", run_ids)
        return "rejected"
    if malformed := [run_id for run_id in run_ids if _as_id(run_id) is None]:
        logger.error("advance_many: %d ids are not run ids (%r…): left out", len(malformed), malformed[0])
        run_ids = [run_id for run_id in run_ids if _as_id(run_id) is not None]
    delivered_on = (getattr(self.request, "delivery_info", None) or {}).get("routing_key")
    batch = Batch.start()
    left, advanced, passed_on, spent = list(run_ids), 0, 0, False
    while left:
        if advanced and not spent and not batch.holds(_as_id(left[0])) and not batch.is_open():
            spent = True
            # One message each: passed on as one batch, the n-th run would wait behind n - 1 spent slices.
            refused = {run_id for run_id in left if not engine_wake(run_id)}
            passed_on = len(left) - len(refused)
            left = [run_id for run_id in left if run_id in refused]
            if not left:
                break
        run_id = left.pop(0)
        batch.following = _as_id(left[0]) if left and not spent else None
        try:
            _dropping_dead_connections(lambda run_id=run_id: _advance_or_pass_on(run_id, delivered_on, batch))
        except OperationalError as exc:
            if not isinstance(exc.__cause__, PoolTimeout):
                engine_wake_many(left)
                raise
            # The runs after it would wait out the same pool: left to the sweep with it, not sent again.
            return _no_connection(run_id, more=len(left))
        except BaseException:
            engine_wake_many(left)
            raise
        advanced += 1
    return f"{advanced} advanced, {passed_on} passed on" if passed_on else f"{advanced} advanced"


def _no_connection(run_id: str, *, more: int = 0) -> str:
    """After a PoolTimeout — overload, not a fault: more tasks than pooled connections waited longer than the pool's
    timeout. Nothing was written without a connection; a lease taken before runs out, and the sweep wakes the run
    again. One line, no traceback."""
    logger.warning(
        "run %s%s: no free database connection within the pool's timeout (the worker runs more tasks than it has "
        "connections); the sweep wakes %s again",
        run_id,
        f" and {more} more of its batch" if more else "",
        "them" if more else "it",
    )
    return "no_connection"


def _as_id(run_id: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(run_id)
    except ValueError:
        return None


def _advance_or_pass_on(run_id: str, delivered_on: str | None, batch: Batch | None = None) -> str:
    # A model-queue message for a run whose next step no longer waits on the model (a stale countdown after a
    # resume, a redelivery) goes to the default queue: plain steps, CPU-bound ones too, run on prefork. Unless
    # that is this very queue (MODEL_QUEUE names QUEUE, or Celery's default queue): passed on, the message would
    # come straight back here, for ever, and the step would never run. (A run of a batch whose claim this task
    # already holds is one whose step this worker runs: the claim checked.) The claim itself tells: it takes only
    # a run whose step waits on the model, so the common delivery costs no read before it.
    model_queue = durable_settings.MODEL_QUEUE
    model_bound = bool(
        model_queue
        and delivered_on == model_queue
        and delivered_on not in _plain_steps_queue()
        and not (batch is not None and batch.holds(_as_id(run_id)))
    )
    served = _queues_served(delivered_on)
    outcome = engine_advance.advance_slice(run_id, serves=served, batch=batch, model_bound=model_bound)
    if model_bound and outcome is engine_advance.Outcome.SKIPPED and queue_for(run_id) != model_queue:
        engine_wake(run_id)
        return "passed on"
    return outcome.value


def _queues_served(delivered_on: str | None) -> frozenset[str | None]:
    """The steps this delivery's worker may run eagerly after its own (None: the default queue's): those of the
    queue the message came from, so a model-bound step still goes to the model queue's workers and a plain step
    to prefork (both, if MODEL_QUEUE is the plain steps' queue). The REPLAY_QUEUE's worker runs every step of the
    replay runs it serves."""
    replay_queue = durable_settings.REPLAY_QUEUE
    if replay_queue and delivered_on == replay_queue:
        return frozenset({replay_queue})
    model_queue = durable_settings.MODEL_QUEUE
    if not model_queue or delivered_on != model_queue:
        return frozenset({None})
    return frozenset({model_queue, None}) if delivered_on in _plain_steps_queue() else frozenset({model_queue})


def _plain_steps_queue() -> frozenset[str]:
    """The name and routing key of the queue a plain step's wake-up goes to: QUEUE, else the product's routes, else
    Celery's default queue (worked out once per QUEUE and router: every delivery on the model queue asks)."""
    return _plain_steps_queue_of(durable_settings.QUEUE, advance.app.amqp.router)


@functools.lru_cache(maxsize=8)
def _plain_steps_queue_of(queue_setting: str | None, router: Any) -> frozenset[str]:
    try:
        queue = router.route(_routed(queue_setting), advance.name).get("queue")
    except Exception:  # noqa: BLE001 - e.g. a queue missing from task_queues: the wake-up's own send reports it
        return frozenset()
    return frozenset(name for name in (getattr(queue, "name", None), getattr(queue, "routing_key", None)) if name)


@shared_task(name="durable_agents.sweep", **JSON)
def sweep() -> dict[str, int]:
    """Re-wake lost runs and settle cancellations (scheduled by celery beat); backs off while the broker holds a
    backlog of wake-ups."""
    queued = broker.queue_depths()
    backlog = None if queued is None else broker.backlog(queued)
    report = _dropping_dead_connections(lambda: engine_sweep.sweep(backlog=backlog, queued=queued).as_dict())
    if _dropping_dead_connections(engine_batches.has_work):
        # Sent, not run here: the batcher waits on the API, and the sweep must not wait with it.
        send_batches.apply_async(expires=60, **_routed(durable_settings.QUEUE))
    return report


@shared_task(name="durable_agents.batches", **JSON)
def send_batches() -> dict[str, Any]:
    """Send queued batch turns as Message Batches, poll those in flight and record their results
    (agents/batcher.py); sent by the sweep while there is batch work, one pass at a time across machines."""
    return _dropping_dead_connections(batcher.run)


# No acks_late: a pass killed midway leaves whole batches (each one transaction); the next scheduled pass goes on.
@shared_task(name="durable_agents.prune", **JSON)
def prune() -> dict[str, object]:
    """Delete the finished runs DURABLE_AGENTS["RETENTION"] lets go, in batches (scheduled by celery beat)."""
    return _dropping_dead_connections(lambda: retention.prune().as_dict())


# Not reject_on_worker_lost: a worker lost mid-send left the row claimed, so a redelivered message would
# find it not due. The sweep enqueues it again once the claim's hold has passed.
@shared_task(name="durable_agents.deliver_notification", acks_late=True, **JSON)
def deliver_notification(effect_id: int) -> str:
    """Send one notification (an outbox row of kind "notification") if it is due, and record the outcome."""
    return _dropping_dead_connections(lambda: engine_outbox.deliver(effect_id).value)


def wake(run_id: str, countdown: float | None = None, queue: str | None = None) -> None:
    """The default DURABLE_AGENTS['WAKER']: send `durable_agents.advance` for the run, on `queue` (the model
    queue) if given, else on QUEUE, after `countdown` seconds (the engine sends only short ones)."""
    routed = _routed(queue or durable_settings.QUEUE)
    if countdown and countdown > 0:
        route = countdown_route(advance.app, routed.get("queue"))
        if route is not None and route.delayed_natively:
            # RabbitMQ delays it in whole seconds and refuses less than one (broker.py): round up, never sooner
            # than the run's wake_at, which the claim would refuse.
            countdown = math.ceil(countdown)
    with _to_the_broker("its wake-up"):
        advance.apply_async((run_id,), countdown=countdown or None, **routed)


def wake_many(run_ids: list[str], queue: str | None = None) -> None:
    """The default DURABLE_AGENTS['BATCH_WAKER']: send one `durable_agents.advance_many` for the runs, on `queue`
    (the model queue) if given, else on QUEUE."""
    with _to_the_broker("their wake-up"):
        advance_many.apply_async((list(run_ids),), **_routed(queue or durable_settings.QUEUE))


def enqueue_notification(effect_id: int) -> None:
    """The default DURABLE_AGENTS['NOTIFICATION_ENQUEUER']: send `durable_agents.deliver_notification` on
    NOTIFY_QUEUE, else QUEUE."""
    queue = durable_settings.NOTIFY_QUEUE or durable_settings.QUEUE
    with _to_the_broker("its delivery"):
        deliver_notification.apply_async((effect_id,), **_routed(queue))


@contextmanager
def _to_the_broker(what: str) -> Iterator[None]:
    """An unreachable broker as the engine's BrokerUnavailableError: Celery retries a publish, then raises kombu's
    OperationalError (Connection._reraise_as_library_errors), a message the engine logs in one line."""
    try:
        yield
    except BrokerError as exc:
        raise BrokerUnavailableError(f"the broker did not take {what}: {exc}") from exc


def _routed(queue: str) -> dict[str, str]:
    """An explicit queue wins over the product's CELERY_TASK_ROUTES; none leaves routing to Celery."""
    return {"queue": queue} if queue else {}


@celeryd_init.connect
def _name_leases(sender: Any = None, **_: Any) -> None:
    """Leases this worker takes name it as its heartbeat does (`celery@web-1:<pid>`), before its pool forks."""
    if isinstance(sender, str) and sender:
        name_this_worker(sender)


# Raised in a handler, SystemExit leaves Celery's Signal.send (it catches Exception only) and ends the process: from
# worker_init before the worker builds its pool and consumer (WorkController.setup_instance), from beat_init before
# beat's first tick (beat.Service.start). Any other exception would only be logged, and the process would serve.
_checked_here = False


@worker_init.connect
def _check_configuration(**_: Any) -> None:
    """A worker runs the system checks as it starts, as `manage.py` does, and refuses to serve on an error: its own
    environment and settings, not the web's, are the ones its steps run with."""
    global _checked_here
    _checked_here = True
    preflight.check_before_serving("celery worker")


@celeryd_after_setup.connect
def _room_to_ack(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """A gevent or threads worker on Redis gets a channel pool as wide as the tasks it may run at once, its autoscale
    maximum included (broker.py widen_redis_channel_pool): every task it runs can ack at once. Sent once the worker
    has resolved its pool and concurrency, before its consumer connects."""
    if instance is None or getattr(instance, "app", None) is None:
        return
    most = max(_as_count(getattr(instance, "concurrency", None)), _as_count(getattr(instance, "max_concurrency", None)))
    widened = broker.widen_redis_channel_pool(instance.app, instance.pool_cls, most)
    if widened:
        logger.info("the Redis transport's max_connections is %d, for up to %d tasks at once", widened, most)


def _as_count(value: object) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


@beat_init.connect
def _check_beat_configuration(sender: Any = None, **_: Any) -> None:
    """A beat that schedules the sweep runs them too (unless it is a worker's own, `worker --beat`: checked)."""
    if not _checked_here and _schedules_the_sweep(sender):
        preflight.check_before_serving("celery beat")


def _schedules_the_sweep(service: Any) -> bool:
    try:
        entries = service.scheduler.schedule.values()
        return any(getattr(entry, "task", None) == sweep.name for entry in entries)
    except Exception:  # noqa: BLE001 - a schedule this cannot read (a scheduler of its own): check, to be safe
        return True


_heartbeat: engine_heartbeats.WorkerHeartbeat | None = None


@worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: Any) -> None:
    """A ready worker records that it is alive every WORKER_HEARTBEAT_SECONDS (`durable_status` lists it)."""
    global _heartbeat
    hostname = getattr(sender, "hostname", None) or "celery"
    queues = [queue.name for queue in getattr(getattr(sender, "task_consumer", None), "queues", None) or []]
    _heartbeat = engine_heartbeats.WorkerHeartbeat(
        hostname, pid=os.getpid(), queues=queues, slots=lambda: _slots(sender)
    ).start()


def _slots(consumer: Any) -> tuple[int, int]:
    """(tasks executing, concurrency) of this worker: Celery's own count of the requests it accepted and has not
    finished (kept in the main process for every pool), against its pool's size (prefork: processes; gevent: limit)."""
    return len(worker_state.active_requests), int(getattr(consumer.pool, "num_processes", 0) or 0)


@worker_process_shutdown.connect
def _send_gathered_wake_ups(**_: Any) -> None:
    """A prefork pool process ends with os._exit, so atexit never runs: the wake-ups it gathered (of runs its steps
    started) are sent first, as a process that exits normally sends them (engine/gather.py)."""
    GATHERER.flush()


@worker_shutdown.connect
def _stop_heartbeat(**_: Any) -> None:
    """A worker leaving warmly removes its row: it has not died, it is not there."""
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None
