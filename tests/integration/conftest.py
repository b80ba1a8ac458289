"""Integration tests prove the guarantees on real Postgres, Redis and `celery worker` processes."""

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from durable_agents import clock, tasks
from tests.chaos.services import refused_port
from tests.integration.batch_helpers import batch_fake, batched_workflows  # noqa: F401 - fixtures of the batch tests
from tests.integration.outside_carrier import CARRIER
from tests.integration.tracing_helpers import spans  # noqa: F401 - the tracing tests' in-memory exporter
from tests.testapp.trust import HOOKS

MODEL_QUEUE = "durable-model"
ROUTED = {"MODEL_QUEUE": MODEL_QUEUE}  # DURABLE_AGENTS for a test (and its workers) with a model worker


@pytest.fixture
def hooks_cleared() -> Iterator[None]:
    """The interleaving tests' hooks (HOOKS, the outside carrier's CARRIER) empty before and after the test, and
    the clock back on the database's own."""
    HOOKS.clear()
    CARRIER.clear()
    yield
    HOOKS.clear()
    CARRIER.clear()
    clock.reset()


@pytest.fixture(autouse=True)
def _require_postgres() -> None:
    assert connection.vendor == "postgresql", (
        "integration tests prove the guarantees on Postgres: set DATABASE_URL=postgres://... (see .ci/run)"
    )


@pytest.fixture
def clock_mid_hour() -> None:
    """The engine's time moved to the next hh:29:30: a test that moves it by whole minutes and hours stays half a
    minute (and half an hour) away from a cron slot the real time would otherwise cross between two readings."""
    now = clock.now()
    ahead = now.replace(minute=29, second=30, microsecond=0) - now
    clock.advance(ahead if ahead > timedelta(0) else ahead + timedelta(hours=1))


@pytest.fixture
def routed():
    """This process wakes model-bound steps on MODEL_QUEUE (workers get ROUTED via DURABLE_TEST_SETTINGS)."""
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **ROUTED}):
        yield


@contextlib.contextmanager
def broker_down() -> Iterator[str]:
    """This process's Celery app publishes to a port nothing listens on, as during a broker outage."""
    with refused_port() as port:
        app, url = tasks.advance.app, f"redis://127.0.0.1:{port}/0"
        saved = {"broker_url": app.conf.broker_url, "broker_write_url": app.conf.broker_write_url}
        app.conf.update(broker_url=url, broker_write_url=url)  # publishing connects to the write URL
        app._after_fork()  # the connection and producer pools were made for the old URL: drop them (as a forked child)
        try:
            yield url
        finally:
            app.conf.update(saved)
            app._after_fork()
