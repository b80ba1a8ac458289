"""Integration tests prove the guarantees on real Postgres, Redis and `celery worker` processes."""

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

MODEL_QUEUE = "durable-model"
ROUTED = {"MODEL_QUEUE": MODEL_QUEUE}  # DURABLE_AGENTS for a test (and its workers) with a model worker


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
