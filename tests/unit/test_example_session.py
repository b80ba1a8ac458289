"""The example project's session beside the library's shares no database, broker, var dir or artifacts folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.example_session import example_environ, own_broker, redis_database_beside

LIBRARY = {
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/durable_ci",
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/3",
    "DURABLE_VAR_DIR": "/tmp/durable-tests-library",
}


def test_example_session__has_a_database_and_a_redis_database_of_its_own():
    env = example_environ(LIBRARY)
    assert env["DATABASE_URL"] == "postgres://postgres@127.0.0.1:5432/durable_ci_example"
    assert env["CELERY_BROKER_URL"] == "redis://127.0.0.1:6379/4", "its workers would take the library's wake-ups"


@pytest.mark.parametrize(("library", "example"), [(0, 1), (3, 4), (14, 15), (15, 14)])
def test_example_session__redis_database_is_next_to_the_librarys_and_exists(library, example):
    assert redis_database_beside(library) == example


def test_example_session__a_redis_url_without_a_database_means_database_0():
    assert own_broker("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379/1"


def test_example_session__a_named_broker_is_taken_as_given():
    env = example_environ({**LIBRARY, "DURABLE_TEST_EXAMPLE_BROKER_URL": "redis://127.0.0.1:6379/9"})
    assert env["CELERY_BROKER_URL"] == "redis://127.0.0.1:6379/9"


def test_example_session__a_broker_it_cannot_split_asks_for_one():
    with pytest.raises(pytest.UsageError, match="DURABLE_TEST_EXAMPLE_BROKER_URL"):
        own_broker("filesystem://")


def test_example_session__var_dir_and_artifacts_are_its_own():
    env = example_environ({**LIBRARY, "DURABLE_TEST_ARTIFACTS": "/tmp/artifacts"})
    var_dir = Path(env["DURABLE_VAR_DIR"])
    assert var_dir != Path(LIBRARY["DURABLE_VAR_DIR"]) and var_dir.is_dir()
    var_dir.rmdir()
    assert env["DURABLE_TEST_ARTIFACTS"] == "/tmp/artifacts/example", "worker logs of equal test names would mix"
