"""Durable tasks carry their own Celery options: a product's global configuration neither breaks nor routes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.test import override_settings

from durable_agents import api, tasks
from durable_agents.models import RunStatus, StepStatus
from durable_agents.testing import wait_for_run

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
        "for t in (tasks.advance, tasks.sweep, tasks.deliver_notification, tasks.send_batches):\n"
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
        "durable_agents.batches": ["json", "True", "False", "False"],
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


# A Celery signal handler that raises an Exception is only logged (celery/utils/dispatch/signal.py, Signal.send:
# `except Exception`, "the exception is returned as the corresponding response"); SystemExit is not an Exception and
# leaves the handler. worker_init is sent by WorkController.setup_instance before the blueprint (pool, consumer) is
# built (celery/worker/worker.py), beat_init by beat.Service.start before its first tick (celery/beat.py): raised
# there, the process exits with its code before it takes a message or sends one.
EX_CONFIG = 78


@pytest.mark.django_db(transaction=True)
def test_worker__refuses_to_start_on_a_system_check_error_and_takes_no_message(start_worker, broker_url):
    """Workers never run `manage.py`: a worker whose settings fail a check exits, saying why in one line, before
    it takes a message (LEASE_SECONDS=-5 would kill its lease renewer: steps would run with no renewal)."""
    run = api.start("noop", {"steps": 1})  # its wake-up waits on the broker for the worker
    worker = start_worker(env={"DURABLE_LEASE_SECONDS": "-5"})
    code = worker.process.wait(timeout=120)
    log = worker.log_path.read_text()
    assert code == EX_CONFIG, f"the worker exited {code}, not 78 (configuration error):\n{log[-2000:]}"
    said = [line for line in log.splitlines() if "durable_agents.E003" in line]
    assert len(said) == 1 and "LEASE_SECONDS" in said[0] and "HINT:" in said[0], log[-2000:]
    assert "celery worker refuses to start: 1 system check error" in log, log[-2000:]
    assert "Traceback" not in log, f"a configuration error is a line, not a traceback:\n{log[-2000:]}"
    assert redis.Redis.from_url(broker_url).llen("celery") == 1, "the worker took the wake-up message"
    assert api.get(run.id).status == RunStatus.PENDING
    assert not api.get(run.id).steps.exclude(status=StepStatus.PENDING).exists(), "a refused worker ran a step"


@pytest.mark.django_db(transaction=True)
def test_worker__with_worker_checks_warn_starts_and_says_so_loudly(start_worker):
    settings_json = json.dumps({"LEASE_SECOND": 5, "WORKER_CHECKS": "warn"})
    worker = start_worker(env={"DURABLE_TEST_SETTINGS": settings_json})
    run = api.start("noop", {"steps": 2})
    wait_for_run(run.id, "completed", timeout=120)
    log = worker.log_path.read_text()
    assert "durable_agents.E002" in log and "Did you mean 'LEASE_SECONDS'?" in log, log[-2000:]
    assert "celery worker starts despite 1 system check error" in log and "WORKER_CHECKS" in log, log[-2000:]


@pytest.mark.django_db(transaction=True)
def test_beat__that_schedules_the_sweep_refuses_to_start_on_a_system_check_error(worker_env, tmp_path):
    beat = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests", "beat", "--schedule", str(tmp_path / "beat"), "-l", "WARNING"],
        env={**worker_env, "DURABLE_LEASE_SECONDS": "-5"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = beat.stdout + beat.stderr
    assert beat.returncode == EX_CONFIG, f"beat exited {beat.returncode}, not 78:\n{out[-2000:]}"
    assert "durable_agents.E003" in out and "celery beat refuses to start" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
