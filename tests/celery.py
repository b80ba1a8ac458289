"""The test suite's Celery app: configured from Django settings (CELERY_*), tasks autodiscovered from installed apps.

Worker subprocesses start with `celery -A tests` (durable_agents.testing.workers.celery_app_for finds it here, in
the package of tests/settings.py), and the test process publishes its wake-ups through it.

DURABLE_TEST_COUNT_DELIVERIES=1 in a worker's environment: each `durable_agents.advance` delivery it starts is
counted in the broker's Redis database (DURABLE_TEST_COUNT_REDIS, when the broker is not Redis), under
`deliveries_key(run_id)`; a `durable_agents.advance_many` delivery
counts once for each run it carries, and once under `BATCHES_KEY`.

DURABLE_TEST_CLOCK_KEY=<redis key> in a worker's environment: before each task the worker sets its engine time
shift (`clock.advance`) to the seconds stored under that key (in DURABLE_TEST_CLOCK_REDIS, else the broker's
Redis), so a test moves every process's clock at once (tests/integration/shared_clock.py).
"""

import os
from datetime import timedelta
from typing import Any

from celery import Celery
from celery.signals import task_prerun

from durable_agents import clock

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


BATCHES_KEY = "durable-test:batches"


def deliveries_key(run_id: object) -> str:
    return f"durable-test:deliveries:{run_id}"


if os.environ.get("DURABLE_TEST_COUNT_DELIVERIES"):

    @task_prerun.connect
    def _count_delivery(task: Any = None, args: Any = None, **_: Any) -> None:
        if task is None or not args or task.name not in ("durable_agents.advance", "durable_agents.advance_many"):
            return
        import redis

        counter = redis.Redis.from_url(os.environ.get("DURABLE_TEST_COUNT_REDIS") or os.environ["CELERY_BROKER_URL"])
        if task.name == "durable_agents.advance":
            counter.incr(deliveries_key(args[0]))
            return
        counter.incr(BATCHES_KEY)
        for run_id in args[0] if isinstance(args[0], list) else ():
            counter.incr(deliveries_key(run_id))


if os.environ.get("DURABLE_TEST_CLOCK_KEY"):

    @task_prerun.connect
    def _follow_test_clock(**_: Any) -> None:
        import redis

        store = os.environ.get("DURABLE_TEST_CLOCK_REDIS") or os.environ["CELERY_BROKER_URL"]
        shift = redis.Redis.from_url(store).get(os.environ["DURABLE_TEST_CLOCK_KEY"])
        clock.reset()
        clock.advance(timedelta(seconds=float(shift or 0)))
