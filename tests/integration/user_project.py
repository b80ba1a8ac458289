"""A user's Django project, written by pytester: its settings, Celery app, one app and its tests; nothing of this
repository's but durable_agents on the path (as if installed). Its tests run in a pytest process of their own.

Example::

    write_user_project(pytester, workflows=WORKFLOWS, tests={"test_shop.py": TESTS})
    run_user_tests(pytester, monkeypatch).assert_outcomes(passed=1)
"""

from __future__ import annotations

import importlib.metadata
import os
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import ROOT

SETTINGS = """
import os

import dj_database_url

SECRET_KEY = "shopsite-tests-not-a-secret"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "durable_agents", "shop"]
DATABASES = {"default": dj_database_url.config()}
USE_TZ = True
ROOT_URLCONF = "shopsite.urls"

CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
"""

URLS = """
from django.urls import include, path

urlpatterns = [path("durable/", include("durable_agents.urls"))]  # the signed links approval requests carry
"""

CELERY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shopsite.settings")
app = Celery("shopsite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""


def write_user_project(pytester: pytest.Pytester, *, workflows: str, tests: dict[str, str], models: str = "") -> None:
    """shopsite/ (settings, urls, the Celery app), the app shop/ (workflows, models), pytest.ini and `tests`."""
    pytester.makeini("[pytest]\nDJANGO_SETTINGS_MODULE = shopsite.settings\n")
    pytester.mkpydir("shopsite")
    pytester.path.joinpath("shopsite", "__init__.py").write_text("from shopsite.celery import app as celery_app\n")
    pytester.path.joinpath("shopsite", "settings.py").write_text(SETTINGS)
    pytester.path.joinpath("shopsite", "urls.py").write_text(URLS)
    pytester.path.joinpath("shopsite", "celery.py").write_text(CELERY)
    pytester.mkpydir("shop")
    pytester.path.joinpath("shop", "workflows.py").write_text(workflows)
    pytester.path.joinpath("shop", "models.py").write_text(models)
    for name, text in tests.items():
        pytester.path.joinpath(name).write_text(text)


def run_user_tests(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    """pytest in a subprocess, in the project: the plugin by its entry point when installed (as a user has it),
    else named; a database of its own on this suite's server, this suite's broker."""
    installed = importlib.metadata.entry_points(group="pytest11", name="durable_agents")
    plugin = [] if installed else ["-p", "durable_agents.testing.pytest_plugin"]
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)  # the project's pytest.ini names its settings
    monkeypatch.setenv("DATABASE_URL", _own_database(os.environ["DATABASE_URL"]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return pytester.runpytest_subprocess(*plugin, "-p", "no:cacheprovider", timeout=600)


def _own_database(url: str) -> str:
    """The same server, another database: the project's test database must not be this suite's."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"{parts.path}_user_project"))
