"""Fixtures for real-service tests: the Postgres test database, a clean Redis broker DB, worker processes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.db import connection

from durable_agents.testing import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def broker_url() -> Iterator[str]:
    """The test broker (a Redis DB of its own), emptied before each test so no stale message leaks in."""
    url = settings.CELERY_BROKER_URL
    if url.startswith("redis://"):
        redis.Redis.from_url(url).flushdb()
    yield url


@pytest.fixture
def worker_env(transactional_db: Any, broker_url: str) -> dict[str, str]:
    """Environment that points a worker subprocess at this test's database and broker."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("postgresql"):
        url = f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    else:
        url = f"sqlite:///{db['NAME']}"
    return {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": url,
        "CELERY_BROKER_URL": broker_url,
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def start_worker(
    worker_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: start_worker(beat=False, pool="solo", concurrency=1, env={...}) → a running WorkerProcess.

    `env` adds to the worker environment (e.g. DURABLE_VAR_DIR: a machine with a disk of its own).
    Every worker is SIGKILLed at teardown, before the database is flushed.
    """
    started: list[WorkerProcess] = []
    artifacts = (
        Path(os.environ["DURABLE_TEST_ARTIFACTS"]) / request.node.name
        if "DURABLE_TEST_ARTIFACTS" in os.environ
        else tmp_path
    )
    artifacts.mkdir(parents=True, exist_ok=True)

    def start(*, env: dict[str, str] | None = None, **kwargs: Any) -> WorkerProcess:
        worker = WorkerProcess(
            env={**worker_env, **(env or {})}, cwd=ROOT, log_path=artifacts / f"worker-{len(started)}.log", **kwargs
        )
        started.append(worker.start())
        return worker

    yield start
    for worker in started:
        worker.kill()
