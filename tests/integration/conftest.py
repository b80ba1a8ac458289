"""Integration tests prove the guarantees on real Postgres, Redis and `celery worker` processes."""

import pytest
from django.db import connection


@pytest.fixture(autouse=True)
def _require_postgres() -> None:
    assert connection.vendor == "postgresql", (
        "integration tests prove the guarantees on Postgres: set DATABASE_URL=postgres://... (see .ci/run)"
    )
