"""The broker's backlog: how many wake-up messages wait on the run queues, as the broker counts them.

The sweep backs off by it (a run whose wake-up may still be queued is not sent another), and health reports it
("workers are behind: 4,549 wake-ups queued on 'model'"). Read with a passive queue declaration, which every kombu
transport answers with the queue's message count (RabbitMQ's queue.declare-ok, Redis's list length, a filesystem
broker's files) and which never creates a queue nor changes one's arguments (a quorum queue stays as declared).

A broker that cannot be asked (down, slow, no Celery app) gives None: the backlog is then unknown, never zero.

Example::

    from durable_agents.broker import queue_depths

    queue_depths()   # {"celery": 12, "model": 4549}, or None
"""

from __future__ import annotations

import contextlib
import logging
import threading

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


def backlog() -> dict[str | None, int] | None:
    """Messages waiting on each run queue, as the sweep takes them (`sweep(backlog=)`): None keys the default queue,
    MODEL_QUEUE's name the model queue; None if the broker could not be asked."""
    names = run_queues()
    depths = queue_depths(names)
    if depths is None:
        return None
    model = {settings.MODEL_QUEUE: depths[settings.MODEL_QUEUE]} if settings.MODEL_QUEUE else {}
    return {None: depths[names[0]], **model}
