"""The pytest plugin's helpers that need no database: the test database's URL, the workers' Celery app."""

from __future__ import annotations

import pytest

from durable_agents.testing.pytest_plugin import database_url
from durable_agents.testing.workers import celery_app_for


def test_database_url__names_the_test_database_with_quoted_credentials():
    db = {"ENGINE": "django.db.backends.postgresql", "NAME": "test_shop", "USER": "app", "PASSWORD": "p@ss/w:rd"}
    db |= {"HOST": "db.internal", "PORT": 5433}
    assert database_url(db) == "postgres://app:p%40ss%2Fw%3Ard@db.internal:5433/test_shop"


def test_database_url__without_user_or_port_leaves_them_to_libpq():
    db = {"ENGINE": "django.db.backends.postgresql", "NAME": "test_shop", "USER": "", "PASSWORD": "", "HOST": ""}
    assert database_url(db) == "postgres://127.0.0.1/test_shop"


def test_database_url__a_sqlite_file_is_shared_and_memory_is_refused():
    assert (
        database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "/tmp/t.sqlite3"}) == "sqlite:////tmp/t.sqlite3"
    )
    with pytest.raises(pytest.fail.Exception, match="in memory"):
        database_url({"ENGINE": "django.db.backends.sqlite3", "NAME": "file:memorydb_default?mode=memory&cache=shared"})


@pytest.mark.parametrize(
    ("env", "app"),
    [
        ({"DJANGO_SETTINGS_MODULE": "mysite.settings.test"}, "mysite"),
        ({"DJANGO_SETTINGS_MODULE": "tests.settings"}, "tests"),
        ({"DJANGO_SETTINGS_MODULE": "config.settings", "DURABLE_CELERY_APP": "config.celery_app"}, "config.celery_app"),
    ],
)
def test_celery_app_for__the_settings_package_unless_named(env, app):
    assert celery_app_for(env) == app


def test_celery_app_for__without_settings_says_what_to_set():
    with pytest.raises(ValueError, match="DURABLE_CELERY_APP"):
        celery_app_for({})
