"""A new user's ten minutes: the wheel, installed into a fresh virtualenv, in a project made by
`django-admin startproject` that knows nothing of this repository.

The system checks report a broken configuration and pass a good one; migrate runs on Postgres; a workflow with
an agent step (a scripted participant calling a tool), an approval and an effectful tool step runs on a real
`celery worker` of that virtualenv and is decided with `durable_decide`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = """
import json
import os

INSTALLED_APPS += ["durable_agents", "orders"]
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": os.environ["SHOP_DB"],
                         "HOST": "127.0.0.1", "PORT": 5432, "USER": "postgres"}}
CELERY_BROKER_URL = os.environ["SHOP_BROKER"]
CELERY_BEAT_SCHEDULE = {
    "durable-agents-sweep": {"task": "durable_agents.sweep", "schedule": 5.0, "options": {"expires": 30}},
}
LOGIN_URL = "admin:login"
EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"
DURABLE_AGENTS = json.loads(os.environ["SHOP_DURABLE"])
"""

CELERY = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

URLS = """
from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls), path("durable/", include("durable_agents.urls"))]
"""

WORKFLOWS = '''
from durable_agents.api import ScriptedParticipant, agent, approval, participants, tool, tool_step, workflow


@tool
def lookup_order(order_id: str) -> dict:
    """Look an order up: what was paid."""
    return {"order": order_id, "paid_cents": 5000}


@tool(effectful=True)
def refund(order_id: str, amount_cents: int, *, idempotency_key: str) -> dict:
    """Refund part of an order to the original payment method."""
    return {"order": order_id, "refunded_cents": amount_cents, "receipt": idempotency_key}


def script(request):
    if request.turn_number == 0:
        return [{"type": "tool_use", "name": "lookup_order", "input": {"order_id": "A-1"}}]
    return "Order A-1 was paid 50.00: a refund of 20.00 is fair."


participants.register("shop-script", ScriptedParticipant(script))

workflow("refund_order", steps=[
    agent("assess", instructions="Assess the refund request.", tools=[lookup_order], participant="shop-script"),
    approval("sign_off", question="Refund 20.00 on order A-1?"),
    tool_step("pay", refund, args={"order_id": "A-1", "amount_cents": 2000}),
])
'''

GOOD = {"APPROVERS": ["leads@shop.example"], "BASE_URL": "https://shop.example", "DEFAULT_PARTICIPANT": "shop-script"}


@pytest.fixture
def shop_db() -> Iterator[str]:
    name = f"durable_shop_{uuid.uuid4().hex[:8]}"
    psql = ["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc"]
    subprocess.run([*psql, f"CREATE DATABASE {name}"], check=True)
    yield name
    subprocess.run([*psql, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"], check=False)


@pytest.mark.timeout(1200)
def test_installed_package__from_wheel_to_a_decided_run_in_a_fresh_project(tmp_path, shop_db, broker_url):
    wheels = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "-w", str(wheels)], check=True, timeout=600)
    (wheel,) = wheels.glob("durable_agents-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "-q", "install", f"{wheel}[anthropic,redis]"]
        + ["psycopg[binary]"],
        check=True,
        timeout=600,
    )

    site = tmp_path / "site"
    site.mkdir()
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "DJANGO_SETTINGS_MODULE": "shop.settings",
        "SHOP_DB": shop_db,
        "SHOP_BROKER": broker_url,
        "SHOP_DURABLE": json.dumps(GOOD),
    }

    def run(*args: str, check: bool = True, **extra: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(args), cwd=site, env={**env, **extra}, capture_output=True, text=True, timeout=300)
        if check:
            assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done

    def manage(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return run(python, "manage.py", *args, **extra)

    # The package, not this checkout: the fresh project cannot import the repository's files.
    where = run(python, "-c", "import durable_agents; print(durable_agents.__file__)").stdout
    assert str(venv) in where, where
    run(str(venv / "bin" / "django-admin"), "startproject", "shop", ".")
    manage("startapp", "orders")
    with (site / "shop" / "settings.py").open("a") as settings:
        settings.write(SETTINGS)
    (site / "shop" / "celery.py").write_text(CELERY)
    (site / "shop" / "__init__.py").write_text("from shop.celery import app as celery_app\n")
    (site / "shop" / "urls.py").write_text(URLS)
    (site / "orders" / "workflows.py").write_text(textwrap.dedent(WORKFLOWS))

    broken = run(python, "manage.py", "check", check=False, SHOP_DURABLE=json.dumps({**GOOD, "LEASE_SECOND": 5}))
    assert broken.returncode != 0, broken.stdout
    assert "durable_agents.E" in broken.stderr and "LEASE_SECONDS" in broken.stderr, broken.stderr
    assert "Traceback" not in broken.stderr, broken.stderr
    good = manage("check")
    assert "durable_agents." not in good.stdout + good.stderr, good.stdout + good.stderr

    manage("migrate", "--verbosity", "0")
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [str(venv / "bin" / "celery"), "-A", "shop", "worker", "--pool", "solo", "--prefetch-multiplier", "1"],
        cwd=site,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        run_id = json.loads(manage("durable_start", "refund_order", "--json", "--input", '{"order": "A-1"}').stdout)[
            "id"
        ]
        shown = _wait_for(manage, run_id, "waiting")
        (wait,) = [w for w in shown["waits"] if w["status"] == "open"]
        manage("durable_decide", str(wait["id"]), "--approve", "--as", "leads@shop.example", "--comment", "fair")
        shown = _wait_for(manage, run_id, "completed")
    finally:
        worker.kill()
        worker.wait(timeout=30)
        log.close()
    assert [s["status"] for s in shown["step_rows"]] == ["done", "done", "done"]
    (effect,) = [e for e in shown["effects"] if e["tool"] == "refund"]
    assert effect["status"] == "applied", effect
    shutil.rmtree(venv, ignore_errors=True)


def _wait_for(manage, run_id: str, status: str, timeout: float = 180.0) -> dict:
    """Poll `durable_show --json` until the run reaches `status`; fail early on a finished run of another status."""
    deadline = time.monotonic() + timeout
    while True:
        shown = json.loads(manage("durable_show", run_id, "--json").stdout)
        if shown["status"] == status:
            return shown
        assert shown["status"] not in {"completed", "failed", "cancelled"}, shown
        assert time.monotonic() < deadline, f"run {run_id} is {shown['status']}, not {status}: see worker.log"
        time.sleep(0.5)
