"""Integration tests prove the guarantees on real Postgres, Redis and `celery worker` processes."""

import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

MODEL_QUEUE = "durable-model"
ROUTED = {"MODEL_QUEUE": MODEL_QUEUE}  # DURABLE_AGENTS for a test (and its workers) with a model worker
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _require_postgres() -> None:
    assert connection.vendor == "postgresql", (
        "integration tests prove the guarantees on Postgres: set DATABASE_URL=postgres://... (see .ci/run)"
    )


@pytest.fixture
def routed():
    """This process wakes model-bound steps on MODEL_QUEUE (workers get ROUTED via DURABLE_TEST_SETTINGS)."""
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **ROUTED}):
        yield


@pytest.fixture
def manage(worker_env):
    """Run `python -m django ARGS` in a subprocess with the workers' environment (this test's database)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "django", *args],
            cwd=ROOT,
            env={**worker_env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run
