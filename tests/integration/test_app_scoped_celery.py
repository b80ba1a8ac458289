"""Durable tasks carry their own Celery options: a product's global configuration neither breaks nor routes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.test import override_settings

from durable_agents import api, tasks
from durable_agents.models import StepStatus
from durable_agents.testing import wait_for, wait_for_run

OWN_QUEUE = "durable-own"
ROOT = Path(__file__).resolve().parents[2]


def test_celery__each_task_is_acks_late_json_and_resultless_whatever_the_global_settings(tmp_path):
    """In a product whose global Celery settings say pickle, results kept and early acks, the durable tasks
    still send JSON, keep no result and acknowledge late."""
    (tmp_path / "pickle_settings.py").write_text(
        "from tests.settings import *\n"
        "CELERY_TASK_SERIALIZER = 'pickle'\nCELERY_ACCEPT_CONTENT = ['pickle', 'json']\n"
        "CELERY_TASK_IGNORE_RESULT = False\nCELERY_TASK_ACKS_LATE = False\nCELERY_TASK_REJECT_ON_WORKER_LOST = False\n"
    )
    probe = (
        "import django; django.setup()\n"
        "from tests.celery import app\n"
        "from durable_agents import tasks\n"
        "assert app.conf.task_serializer == 'pickle'\n"
        "for t in (tasks.advance, tasks.sweep, tasks.deliver_notification):\n"
        "    print(t.name, t.serializer, t.ignore_result, t.acks_late, t.reject_on_worker_lost)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "pickle_settings", "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    options = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()}
    assert options == {
        "durable_agents.advance": ["json", "True", "True", "True"],
        "durable_agents.sweep": ["json", "True", "False", "False"],
        "durable_agents.deliver_notification": ["json", "True", "True", "False"],
    }


@pytest.mark.django_db(transaction=True)
def test_celery__the_queue_setting_sends_every_durable_message_to_the_apps_own_workers(start_worker):
    """A worker serving only QUEUE runs the whole workflow; the product's default queue gets nothing, though its
    global routes send everything elsewhere and its global serializer is pickle."""
    hostile = {
        "CELERY_TASK_SERIALIZER": "pickle",
        "CELERY_TASK_ROUTES": {"*": {"queue": "the-products-own"}},
    }
    app = tasks.advance.app
    before = {"task_serializer": app.conf.task_serializer, "task_routes": app.conf.task_routes}
    own = {**settings.DURABLE_AGENTS, "QUEUE": OWN_QUEUE}
    with override_settings(DURABLE_AGENTS=own, **hostile):
        app.conf.update(task_serializer="pickle", task_routes=hostile["CELERY_TASK_ROUTES"])
        app.amqp.flush_routes()
        try:
            start_worker(
                env={"DURABLE_TEST_SETTINGS": json.dumps({"QUEUE": OWN_QUEUE})}, extra_args=["--queues", OWN_QUEUE]
            )
            run = api.start("noop", {"steps": 3})
            wait_for_run(run.id, "completed", timeout=120)
        finally:
            app.conf.update(before)
            app.amqp.flush_routes()
    assert api.get(run.id).steps.filter(status=StepStatus.DONE).count() == 3


@pytest.mark.django_db(transaction=True)
def test_celery__a_worker_runs_the_system_checks_as_it_starts(start_worker):
    """Workers never run `manage.py`: a worker started with a misspelled setting says so in its own log."""
    worker = start_worker(env={"DURABLE_TEST_SETTINGS": json.dumps({"LEASE_SECOND": 5})})
    wait_for(
        lambda: "durable_agents.E002" in worker.log_path.read_text(),
        timeout=120,
        what="the worker's log to report the misspelled setting",
    )
    assert "Did you mean 'LEASE_SECONDS'?" in worker.log_path.read_text()
