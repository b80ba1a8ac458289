"""The embedded default: SQLite and kombu's filesystem broker, with a real worker subprocess and no servers."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from durable_agents.testing import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]


def _embedded_defaults(tmp_path: Path) -> dict[str, str]:
    """This environment without a database or broker named: the project's embedded SQLite file under `tmp_path` and
    kombu's filesystem broker."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DURABLE_VAR_DIR=str(tmp_path),
        CELERY_BROKER_URL="filesystem://",
        DJANGO_LOCAL_SECRET_KEY="1",
    )
    return env


def _manage(env: dict[str, str], *args: str) -> str:
    """`manage.py *args`'s output; it must succeed."""
    result = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (args, result.stderr[-3000:])
    return result.stdout


def test_sqlite__noop_run_completes_on_embedded_defaults(tmp_path):
    env = _embedded_defaults(tmp_path)

    def manage(*args: str) -> str:
        return _manage(env, *args)

    def health() -> dict:
        # durable_status exits 1 while unhealthy (e.g. before the worker's first heartbeat): read its JSON anyway.
        result = subprocess.run(
            [sys.executable, "manage.py", "durable_status", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode in (0, 1), result.stderr
        return json.loads(result.stdout)

    manage("migrate", "--verbosity", "0")
    run_id = manage("durable_start", "noop", "--input", '{"steps": 5}').strip()
    with WorkerProcess(env=env, inherit_env=False, cwd=ROOT, log_path=tmp_path / "worker.log"):
        deadline = time.monotonic() + 90
        while (shown := json.loads(manage("durable_show", run_id, "--json")))["status"] != "completed":
            assert time.monotonic() < deadline, f"run did not complete on SQLite: {shown['status']}"
            time.sleep(0.5)
        manage("durable_sweep")
        # The heartbeats' SQLite path: the worker is listed and, the sweep just run, all is well.
        while not (status := health())["ok"]:
            assert time.monotonic() < deadline, f"durable_status on SQLite: {status['verdict']}"
            time.sleep(0.5)
    assert [s["status"] for s in shown["step_rows"]] == ["done"] * 5
    assert len(status["live_workers"]) == 1, status
    assert (tmp_path / "durable_agents.sqlite3").exists(), "the embedded default is a SQLite file under var/"


def test_sqlite__a_run_is_found_by_its_search_attributes(tmp_path):
    """SQLite has no `@>`: the search matches each key exactly (a scan), with the same answers as on Postgres."""
    env = _embedded_defaults(tmp_path)

    def manage(*args: str) -> str:
        return _manage(env, *args)

    manage("migrate", "--verbosity", "0")
    wanted = manage("durable_start", "refund_agent", "--input", '{"order_id": "A-1001", "message": "hi"}')
    manage("durable_start", "refund_agent", "--input", '{"order_id": "A-1002", "message": "A-1001"}')

    found = json.loads(manage("durable_runs", "--search", "order_id=A-1001", "--json"))
    assert [row["id"] for row in found] == [wanted.strip()]
    assert found[0]["search"] == {"order_id": "A-1001"}
    assert json.loads(manage("durable_runs", "--search", "order_id=A-404", "--json")) == []
    # The admin's bare-value search, on SQLite.
    script = (
        "from durable_agents.models import Run; "
        "print(list(Run.objects.holding_search_value('A-1001', ['customer', 'order_id']).values_list('id', flat=True)))"
    )
    assert wanted.strip() in manage("shell", "-c", script)


def test_sqlite__the_console_s_pages_open(tmp_path):
    """The embedded default is where a first user opens the console: each page must render on SQLite too (it once
    failed there: SQLite refuses a LIMIT inside a UNION, which the overview used)."""
    env = _embedded_defaults(tmp_path)
    _manage(env, "migrate", "-v0")
    script = """
from django.contrib.auth.models import User
from django.test import Client
from durable_agents import api
run = api.start("noop", {"steps": 2})
client = Client(HTTP_HOST="localhost")
client.force_login(User.objects.create_superuser("oncall"))
pages = ["/admin/", "/admin/durable_agents/run/", f"/admin/durable_agents/run/{run.pk}/change/",
         "/admin/durable_agents/wait/", "/admin/durable_agents/schedule/", "/admin/durable_agents/run/?count=exact"]
for page in pages:
    print(page, client.get(page).status_code)
"""
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    statuses = dict(line.rsplit(" ", 1) for line in result.stdout.split("\n") if line.startswith("/admin/"))
    assert statuses and set(statuses.values()) == {"200"}, statuses


def test_sqlite__an_index_migration_interrupted_backwards_finishes_when_run_again(tmp_path):
    """The embedded default migrates back as well: a migration of the index operations (`_operations`) stopped after
    its first backward statement finishes when `migrate` runs again, each operation skipping what is done."""
    env = _embedded_defaults(tmp_path)

    def manage(*args: str) -> str:
        return _manage(env, *args)

    manage("migrate", "-v0")
    database = sqlite3.connect(tmp_path / "durable_agents.sqlite3")
    for name, before in [("0035", "0034"), ("0034", "0033")]:
        backwards = manage("sqlmigrate", "--backwards", "durable_agents", name).splitlines()
        first = next(line for line in backwards if line.strip() and not line.startswith("--"))
        database.execute(first)  # the interrupted run's first statement, committed
        database.commit()
        manage("migrate", "-v0", "durable_agents", before)
    manage("migrate", "-v0")
    indexes = {row[0] for row in database.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"durable_step_run_position", "durable_wait_deadline_due", "durable_wait_open_approvals"} <= indexes
    assert "durable_wait_open_deadline" not in indexes
