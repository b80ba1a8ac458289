"""What the engine knows of the configured broker: its backlog, and what Celery does there with a delayed wake-up.

**The backlog**: how many wake-up messages wait on the run queues, as the broker counts them. The sweep backs off by
it (a run whose wake-up may still be queued is not sent another), and health reports it ("workers are behind: 4,549
wake-ups queued on 'model'"). Read with a passive queue declaration, which every kombu transport answers with the
queue's message count (RabbitMQ's queue.declare-ok, Redis's list length, a filesystem broker's files) and which
never creates a queue nor changes one's arguments (a quorum queue stays as declared).

A broker that cannot be asked (down, slow, no Celery app) gives None: the backlog is then unknown, never zero.

Example::

    from durable_agents.broker import queue_depths

    queue_depths()   # {"celery": 12, "model": 4549}, or None

**Delayed wake-ups**: Celery delays one in the broker, or a worker holds it. The engine sends a countdown only for a
delay up to MAX_COUNTDOWN_SECONDS (engine/wake.py); checks.py asks this module whether Celery would make a worker
hold even those, and the Celery waker (tasks.py) whether RabbitMQ delays them itself. The rules, as Celery 5.5+
applies them:

* Celery delays a message in RabbitMQ itself ("native delayed delivery": kombu.transport.native_delayed_delivery,
  a chain of TTL queues) only when some declared queue is a quorum queue and the message's exchange is not direct
  (celery/app/base.py `Celery.send_task`: "Direct exchanges are not supported with native delayed delivery"; the
  worker binds only non-direct exchanges to the delay chain: kombu `bind_queue_to_native_delayed_delivery_exchange`).
* Otherwise the worker that receives the message holds it until its ETA. With quorum queues that takes the worker's
  prefetch slot: "ETA/Countdown will block the worker when received until the ETA arrives since we can no longer
  increase the prefetch count" (Celery docs, "Using RabbitMQ" > "Using Quorum Queues" > "Limitations").
* Classic queues keep global QoS, so Celery raises the prefetch count for each message it holds and the slot stays
  free: not reported. Redis and the other transports are not RabbitMQ: not reported either.
* RabbitMQ's delay counts whole seconds, and refuses less than one: send_task passes `int(countdown)` to kombu's
  `calculate_routing_key`, which raises ValueError("countdown must be a positive number") below 1 (tried here:
  a 0.4 s countdown on a topic exchange beside a quorum queue raises; 1.5 s is sent, delayed 1 s in the broker,
  and the message keeps its ETA, whose last half second the worker waits out).
* With `worker_detect_quorum_queues` off, a worker asks RabbitMQ for global QoS on its quorum queues, which RabbitMQ
  refuses ("NOT_IMPLEMENTED - queue ... does not support global qos"): the worker consumes nothing.

For the checks, Celery's configuration is read as the product's app reads it, `config_from_object(
"django.conf:settings", namespace="CELERY")`, into a throwaway app that never connects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from celery import Celery
from celery.utils.quorum_queues import detect_quorum_queues

from durable_agents.conf import settings

logger = logging.getLogger("durable_agents.engine")

# Seconds the broker may take to answer: the sweep and `durable_status` must not hang on a broker that is down.
ANSWER_WITHIN_SECONDS = 2.0


def run_queues() -> list[str]:
    """The queues run wake-ups go to: QUEUE — else where the product's CELERY_TASK_ROUTES send
    `durable_agents.advance`, else Celery's default queue — and MODEL_QUEUE, if set."""
    from celery import current_app

    default = settings.QUEUE
    if not default:
        try:
            routed = current_app.amqp.router.route({}, "durable_agents.advance").get("queue")
        except Exception:  # noqa: BLE001 - a route to a queue Celery cannot resolve: its default queue then
            routed = None
        default = getattr(routed, "name", None) or current_app.conf.task_default_queue or "celery"
    return list(dict.fromkeys(q for q in (default, settings.MODEL_QUEUE) if q))


def queue_depths(queues: list[str] | None = None) -> dict[str, int] | None:
    """Messages ready on each of `queues` (default: the run queues); None if the broker could not be asked within
    ANSWER_WITHIN_SECONDS (down, or connected but silent). A queue the broker does not have (nothing sent to it yet,
    or an emptied Redis list) holds 0."""
    answer: dict[str, dict[str, int] | None] = {}
    names = queues if queues is not None else run_queues()
    # The socket timeouts bound each wait on a silent broker; the thread bounds them all (a transport that ignores
    # them): a stalled broker never freezes the sweep, `durable_status` or a metrics scrape.
    asking = threading.Thread(target=lambda: answer.setdefault("depths", _ask(names)), daemon=True)
    asking.start()
    asking.join(ANSWER_WITHIN_SECONDS * 2)
    if asking.is_alive():
        logger.info("the broker's backlog is unknown: no answer within %.0f s", ANSWER_WITHIN_SECONDS * 2)
        return None
    return answer.get("depths")


def _ask(names: list[str]) -> dict[str, int] | None:
    try:
        from celery import current_app
        from kombu.exceptions import ChannelError, OperationalError

        timeouts = {
            "socket_timeout": ANSWER_WITHIN_SECONDS,  # Redis
            "socket_connect_timeout": ANSWER_WITHIN_SECONDS,
            "read_timeout": ANSWER_WITHIN_SECONDS,  # RabbitMQ (py-amqp)
            "write_timeout": ANSWER_WITHIN_SECONDS,
        }
        depths: dict[str, int] = {}
        conn = current_app.connection_for_read(connect_timeout=ANSWER_WITHIN_SECONDS, transport_options=timeouts)
        with conn:
            conn.ensure_connection(max_retries=1, timeout=ANSWER_WITHIN_SECONDS)
            for name in names:
                # A channel each: RabbitMQ closes the channel that asked for a queue it does not have.
                channel = conn.channel()
                try:
                    depths[name] = int(channel.queue_declare(queue=name, passive=True).message_count)
                except ChannelError:
                    depths[name] = 0
                finally:
                    with contextlib.suppress(Exception):  # a channel the broker already closed
                        channel.close()
        return depths
    except (OperationalError, OSError, TimeoutError) as exc:
        logger.info("the broker's backlog is unknown: %s", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - a transport without counts, no app: unknown, never an error
        logger.info("the broker's backlog is unknown: %s: %s", type(exc).__name__, exc)
        return None


def backlog(depths: dict[str, int] | None = None) -> dict[str | None, int] | None:
    """Messages waiting on each run queue, as the sweep takes them (`sweep(backlog=)`): None keys the default queue,
    MODEL_QUEUE's name the model queue; None if the broker could not be asked. `depths`: what queue_depths() already
    measured (beat's pass records it too); without it the broker is asked here."""
    names = run_queues()
    depths = depths if depths is not None else queue_depths(names)
    if depths is None or any(name not in depths for name in names):
        return None
    model = {settings.MODEL_QUEUE: depths[settings.MODEL_QUEUE]} if settings.MODEL_QUEUE else {}
    return {None: depths[names[0]], **model}


# --- Delayed wake-ups -------------------------------------------------------------------------------------------------

ADVANCE_TASK = "durable_agents.advance"
RABBITMQ = "amqp"  # kombu's driver_type of RabbitMQ transports (pyamqp, librabbitmq)


@dataclass(frozen=True)
class CountdownRoute:
    """Where a countdown of `durable_agents.advance` goes on RabbitMQ, and who waits it out."""

    queue: str
    exchange: str
    exchange_type: str
    # Some declared queue is a quorum queue: workers run without global QoS, and Celery can delay natively.
    quorum: bool

    @property
    def delayed_natively(self) -> bool:
        """RabbitMQ waits it out (native delayed delivery): no worker holds the message."""
        return self.quorum and self.exchange_type != "direct"

    @property
    def holds_a_slot(self) -> bool:
        """The worker that receives it holds it in its only prefetch slot until due."""
        return self.quorum and self.exchange_type == "direct"


@contextmanager
def _celery_app() -> Iterator[Celery]:
    # No fixups: the Django fixup would connect this app to the worker's signals.
    app = Celery("durable_agents_checks", set_as_current=False, fixups=[])
    app.config_from_object("django.conf:settings", namespace="CELERY")
    try:
        yield app
    finally:
        app.close()


def _is_redis(app: Celery) -> bool:
    """True if the broker `app`'s workers consume from (and ack to) is Redis: redis://, rediss://, sentinel://."""
    return _driver_type(app, read=True) == "redis"


def _is_rabbitmq(app: Celery) -> bool:
    return _driver_type(app) == RABBITMQ


def _driver_type(app: Celery, *, read: bool = False) -> str:
    if not (app.conf.broker_read_url if read else app.conf.broker_write_url):
        return ""
    try:
        connect = app.connection_for_read if read else app.connection_for_write
        with connect() as connection:  # lazy: nothing is connected
            return str(connection.transport.driver_type)
    except Exception:  # noqa: BLE001 - a transport that does not load (its client is not installed) is neither
        return ""


# kombu's Redis transport: a worker's channel sends its commands over a redis-py pool of at most this many
# connections (kombu.transport.redis.Channel.max_connections, transport option `max_connections`). redis-py's pool does
# not wait for one: past the cap a command raises MaxConnectionsError("Too many connections").
REDIS_CHANNEL_CONNECTIONS = 10
# Pools whose tasks run (and ack, with acks_late) side by side in the worker's own process.
IN_PROCESS_POOLS = ("gevent", "eventlet", "thread")


def widen_redis_channel_pool(app: Celery, pool: object, concurrency: object) -> int | None:
    """Let a worker of `pool` running up to `concurrency` tasks at once ack them all at once: on the Redis transport
    it consumes from, raise its channel's `max_connections` (10 by default) to the concurrency plus the consumer's own,
    unless the product set it. The cap it set, or None if nothing needed it (or `concurrency` is not a number).

    A worker acks each task (`acks_late`) on the greenlet or thread that ran it, one command over the channel's pool.
    A gevent model worker ending more than ten conversations together had the rest refused ("Couldn't ack ...
    Too many connections", logged CRITICAL), its consumer reconnected, and a prefetched wake-up could be lost until
    the sweep sent it again. A prefork pool acks from the consumer alone: left as it is.
    """
    name = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    try:
        tasks = int(str(concurrency))
    except ValueError:
        return None
    if tasks < 1 or not any(kind in str(name).lower() for kind in IN_PROCESS_POOLS) or not _is_redis(app):
        return None
    options = dict(app.conf.broker_transport_options or {})
    if "max_connections" in options:
        return None  # the product's own
    options["max_connections"] = tasks + REDIS_CHANNEL_CONNECTIONS
    app.conf.broker_transport_options = options
    return options["max_connections"]


def countdown_route(app: Celery, queue: str | None) -> CountdownRoute | None:
    """Where `app` sends a countdown of `durable_agents.advance` to `queue` (None: where its routes send it), as
    `Celery.send_task` decides; None if the broker is not RabbitMQ, or Celery refuses the queue (check E009's)."""
    if not _is_rabbitmq(app):
        return None
    try:
        options = app.amqp.router.route({"queue": queue} if queue else {}, ADVANCE_TASK)
    except Exception:  # noqa: BLE001 - e.g. QueueNotFound
        return None
    routed = options.get("queue")
    exchange = getattr(routed, "exchange", None)
    exchange_type = exchange.type if exchange is not None else options.get("exchange_type")
    exchange_name = getattr(exchange, "name", None) or options.get("exchange") or ""
    # As send_task decides: after routing (which may declare the queue), any quorum queue at all.
    quorum = detect_quorum_queues(app, RABBITMQ)[0]
    return CountdownRoute(getattr(routed, "name", queue or ""), str(exchange_name), str(exchange_type), quorum)


def countdowns_holding_a_slot(queues: Iterable[str | None]) -> list[CountdownRoute]:
    """The routes of `queues` (None: the default route) on which a worker would hold a countdown's message in its
    prefetch slot until due, under the project's Celery settings.

    Example: on RabbitMQ with CELERY_TASK_DEFAULT_QUEUE_TYPE = "quorum" and Celery's default (direct) exchange,
    `countdowns_holding_a_slot([None])` → [CountdownRoute("celery", "celery", "direct", quorum=True)].
    """
    with _celery_app() as app:
        routes = (countdown_route(app, queue) for queue in dict.fromkeys(queues))
        return [route for route in routes if route is not None and route.holds_a_slot]


def cancels_steps_on_connection_loss() -> bool:
    """Whether workers stop every late-acked task in flight when the broker connection drops (Celery's
    `worker_cancel_long_running_tasks_on_connection_loss`, off by default until Celery 6)."""
    with _celery_app() as app:
        return bool(app.conf.worker_cancel_long_running_tasks_on_connection_loss)


# kombu's filesystem transport: the folders it reads and writes (its defaults are relative to the worker's cwd).
FILESYSTEM_FOLDERS = {"data_folder_in": "data_in", "data_folder_out": "data_out", "control_folder": "control"}


def missing_filesystem_folders() -> list[tuple[str, str]]:
    """(transport option, folder) of each folder kombu's filesystem:// broker needs that does not exist: its worker
    dies on the first poll with a FileNotFoundError traceback. Empty for any other broker.

    Example: with CELERY_BROKER_URL = "filesystem://" and no transport options, in an empty directory →
    [("data_folder_in", "data_in"), ("data_folder_out", "data_out"), ("control_folder", "control")].
    """
    with _celery_app() as app:
        if not str(app.conf.broker_url or "").startswith("filesystem:"):
            return []
        options = dict(app.conf.broker_transport_options or {})
    needed = dict(FILESYSTEM_FOLDERS)
    if options.get("store_processed"):
        needed["processed_folder"] = "processed"
    folders = {option: str(options.get(option) or default) for option, default in needed.items()}
    return [(option, folder) for option, folder in folders.items() if not os.path.isdir(folder)]


def quorum_queue_refusing_global_qos() -> str | None:
    """The quorum queue RabbitMQ would refuse a worker's global QoS on (`worker_detect_quorum_queues` off), if any."""
    with _celery_app() as app:
        if not _is_rabbitmq(app) or app.conf.worker_detect_quorum_queues:
            return None
        found, name = detect_quorum_queues(app, RABBITMQ)
        return name if found else None
