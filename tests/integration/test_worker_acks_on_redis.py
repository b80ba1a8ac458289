"""A worker that runs its tasks side by side in one process (gevent, threads) on Redis can ack them all at once.

kombu's Redis transport sends a worker's acks over a redis-py pool of at most `max_connections` (transport option,
10 by default: kombu.transport.redis.Channel.max_connections), and redis-py's pool raises rather than waits past it.
With `acks_late`, each task is acked by the greenlet or thread that ran it: the Procfile's gevent model worker, ending
more than ten conversations together, had the rest refused ("Couldn't ack ... Too many connections", CRITICAL) and its
consumer reconnected. A worker now widens its channel's pool to the tasks it may run at once, its autoscale maximum
included (broker.widen_redis_channel_pool, once the worker has resolved its concurrency: `celeryd_after_setup`); what
the product set stays, and a prefork pool (acks from its consumer) is left as it is.
"""

from __future__ import annotations

import os

import pytest
from celery import Celery

from durable_agents.broker import widen_redis_channel_pool
from durable_agents.testing import wait_for
from tests.celery import app as celery_app

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("pool", "concurrency", "extra", "cap"),
    [
        ("gevent", 50, [], 60),
        ("threads", 6, [], 16),
        ("gevent", 5, ["--autoscale", "40,5"], 50),  # its pool grows to 40
        ("gevent", "auto", [], None),  # one per CPU, whatever the machine: checked below
        ("prefork", 2, [], None),
    ],
    ids=["gevent", "threads", "gevent-autoscale", "gevent-auto", "prefork"],
)
def test_a_worker_s_channel_pool_is_as_wide_as_the_tasks_it_runs_at_once(start_worker, pool, concurrency, extra, cap):
    start_worker(pool=pool, concurrency=concurrency, extra_args=extra)

    # The worker's own configuration, as it answers `celery inspect conf`.
    answers = wait_for(lambda: celery_app.control.inspect(timeout=1).conf(), timeout=30, what="the worker's conf")
    (conf,) = answers.values()
    widened = (conf.get("broker_transport_options") or {}).get("max_connections")
    if concurrency == "auto":
        # Found by attack: at worker_init "auto" was not yet a number, and the hook raised.
        assert widened in (len(os.sched_getaffinity(0)) + 10, (os.cpu_count() or 0) + 10), widened
    else:
        assert widened == cap


def app_on(url: str, read_url: str | None = None, **options: object) -> Celery:
    app = Celery("widen", set_as_current=False, fixups=[])
    app.conf.broker_url = url
    if read_url:
        app.conf.broker_read_url = read_url
    if options:
        app.conf.broker_transport_options = dict(options)
    return app


@pytest.mark.parametrize(
    ("url", "pool", "options", "cap"),
    [
        ("redis://127.0.0.1:6379/0", "gevent", {}, 1010),
        # Consumed (and acked) over the read URL: found by attack, the write URL's transport was asked.
        (("amqp://guest@127.0.0.1//", "redis://127.0.0.1:6379/0"), "gevent", {}, 1010),
        (("redis://127.0.0.1:6379/0", "amqp://guest@127.0.0.1//"), "gevent", {}, None),
        ("rediss://cache.internal:6380/0", "celery.concurrency.eventlet:TaskPool", {"visibility_timeout": 60}, 1010),
        ("redis://a:6379/0;redis://b:6379/0", "threads", {}, 1010),
        ("redis://127.0.0.1:6379/0", "gevent", {"max_connections": 200}, None),  # the product's own stays
        ("redis://127.0.0.1:6379/0", "prefork", {}, None),
        ("redis://127.0.0.1:6379/0", "solo", {}, None),
        ("amqp://guest@127.0.0.1//", "gevent", {}, None),
        ("filesystem://", "gevent", {}, None),
    ],
)
def test_widen_redis_channel_pool(monkeypatch, url, pool, options, cap):
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)  # Celery takes it over the app's broker_url
    app = app_on(*(url if isinstance(url, tuple) else (url,)), **options)

    assert widen_redis_channel_pool(app, pool, 1000) == cap

    expected = {**options, "max_connections": cap} if cap else options
    assert dict(app.conf.broker_transport_options or {}) == expected


@pytest.mark.parametrize("concurrency", ["auto", None, 0, "many"])
def test_widen_redis_channel_pool__a_concurrency_that_is_no_number_widens_nothing(monkeypatch, concurrency):
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    app = app_on("redis://127.0.0.1:6379/0")

    assert widen_redis_channel_pool(app, "gevent", concurrency) is None
    assert not app.conf.broker_transport_options
