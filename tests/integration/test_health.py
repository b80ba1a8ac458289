"""System health: the sweep and the workers record that they are alive, and `durable_status`, the metrics and
the console say so — or name the likely cause when runs are stuck ("is celery beat up?")."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from durable_agents import api, clock
from durable_agents.engine.heartbeats import SWEEP, WorkerHeartbeat, record_beat
from durable_agents.engine.sweep import sweep
from durable_agents.health import read_presence, system_health
from durable_agents.models import ProcessHeartbeat, Run, RunStatus
from durable_agents.testing import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def status() -> tuple[dict, int]:
    """durable_status --json as an operator runs it: (its report, its exit code)."""
    out = StringIO()
    try:
        call_command("durable_status", "--json", stdout=out)
        code = 0
    except CommandError as exc:
        code = exc.returncode
    return json.loads(out.getvalue()), code


def make_stuck_run() -> Run:
    """A run whose worker died: running, its lease expired a minute ago. Created directly, so no worker is woken."""
    return Run.objects.create(
        workflow="record",
        workflow_version=1,
        status=RunStatus.RUNNING,
        lease_owner="dead-worker:1",
        lease_expires_at=clock.now() - timedelta(minutes=1),
    )


def set_back(name: str, minutes: float) -> None:
    ProcessHeartbeat.objects.filter(name=name).update(last_seen=clock.now() - timedelta(minutes=minutes))


def wait_until_alive(worker) -> dict:
    def seen() -> dict | None:
        report, _ = status()
        return next((w for w in report["live_workers"] if w["pid"] == worker.pid), None)

    return wait_for(seen, timeout=120, interval=0.5, what=f"worker {worker.name} to appear in durable_status")


def test_status__a_started_worker_appears_and_after_a_sweep_all_is_ok(start_worker):
    worker = start_worker()

    seen = wait_until_alive(worker)
    sweep()
    report, code = status()

    assert seen["hostname"].startswith(f"{worker.name}@"), f"the worker's Celery hostname is listed: {seen}"
    assert seen["queues"], "the worker's queues are listed"
    assert report["sweep_lag_seconds"] is not None and report["sweep_lag_seconds"] < 120, report
    assert report["ok"] and code == 0, f"a live worker and a fresh sweep are healthy: {report['verdict']}"
    assert report["verdict"].startswith("OK: the sweep ran"), report["verdict"]
    assert set(report["runs_by_status"]) == set(RunStatus.values)


def test_status__a_sweep_ten_minutes_late_with_a_stuck_run_names_beat(start_worker):
    worker = start_worker()
    wait_until_alive(worker)
    sweep()
    set_back(SWEEP, minutes=10)
    make_stuck_run()

    report, code = status()

    assert code == 1, "an unhealthy system exits 1, so a probe notices"
    assert not report["ok"] and report["stuck"] == 1
    assert "the sweep has not run for 10 min — is celery beat up?" in report["verdict"], report["verdict"]
    assert "1 run stuck" in report["verdict"]


def test_status__no_worker_seen_names_the_workers_not_beat():
    record_beat("worker:old@host:42", ProcessHeartbeat.Kind.WORKER, hostname="old@host", pid=42)
    set_back("worker:old@host:42", minutes=5)
    set_back(SWEEP, minutes=10)  # workers run the sweep too: a late sweep is their consequence
    make_stuck_run()

    health = system_health()

    assert not health.ok and health.presence.live_workers == ()
    assert health.verdict == "no worker has been seen for 5 min — are the workers up? (1 run stuck)"


def test_status__text_output_lists_the_sweep_workers_and_verdict():
    sweep()
    record_beat("worker:w@h:7", ProcessHeartbeat.Kind.WORKER, hostname="w@h", pid=7, queues=["celery"])
    out = StringIO()

    call_command("durable_status", stdout=out)

    text = out.getvalue()
    assert "last sweep:" in text and "w@h pid 7  queues celery" in text
    assert "verdict: OK: the sweep ran" in text, text
    assert "queued messages: celery " in text and "oldest runnable run waiting: none" in text


def test_sweep__records_its_pass_and_forgets_workers_unseen_for_a_day():
    record_beat("worker:gone@h:1", ProcessHeartbeat.Kind.WORKER, hostname="gone@h", pid=1)
    set_back("worker:gone@h:1", minutes=25 * 60)
    record_beat("worker:recent@h:2", ProcessHeartbeat.Kind.WORKER, hostname="recent@h", pid=2)

    sweep()

    names = set(ProcessHeartbeat.objects.values_list("name", flat=True))
    assert names == {SWEEP, "worker:recent@h:2"}, f"the sweep records itself and prunes day-old workers: {names}"


def test_worker_heartbeat__beats_on_its_own_thread_and_leaves_on_stop():
    beat = WorkerHeartbeat("thread@h", pid=99, queues=["b", "a"]).start()
    try:
        row = wait_for(
            lambda: ProcessHeartbeat.objects.filter(name=beat.name).first(), timeout=60, what="the first beat"
        )
        assert (row.hostname, row.pid, row.queues) == ("thread@h", 99, ["a", "b"])
    finally:
        beat.stop()
    assert not ProcessHeartbeat.objects.filter(name=beat.name).exists(), "a worker that left warmly is not listed"


def test_metrics__include_the_sweep_lag_and_live_workers(settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "METRICS_TOKEN": "scrape-token-0123456789"}

    def scrape() -> dict[str, float]:
        response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-token-0123456789")
        assert response.status_code == 200, response.content
        families = text_string_to_metric_families(response.content.decode())
        return {s.name: s.value for f in families for s in f.samples if not s.labels}

    before = scrape()
    sweep(queued={"celery": 0})  # as the sweep's task measured the broker
    record_beat("worker:m@h:3", ProcessHeartbeat.Kind.WORKER, hostname="m@h", pid=3)
    after = scrape()

    assert before["durable_sweep_lag_seconds"] == float("inf"), "a sweep that never ran is infinitely late"
    assert before["durable_live_workers"] == 0
    assert 0 <= after["durable_sweep_lag_seconds"] < 120
    assert after["durable_live_workers"] == 1
    # The console reads the queue depths the sweep measured: an alert on this age sees it stop measuring.
    assert before["durable_queue_depth_measured_seconds"] == float("inf"), "never measured is infinitely old"
    assert 0 <= after["durable_queue_depth_measured_seconds"] < 120


def test_admin_overview__shows_the_health_panel():
    user = User.objects.create_user("oncall", password="secret", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(user)
    record_beat("worker:a@h:5", ProcessHeartbeat.Kind.WORKER, hostname="a@h", pid=5, queues=["celery"])
    record_beat(SWEEP, ProcessHeartbeat.Kind.SWEEP)
    set_back(SWEEP, minutes=10)

    html = client.get(reverse("admin:durable_agents_run_changelist")).content.decode()

    assert 'id="durable-health"' in html, "the run list shows the health panel"
    assert "the sweep has not run for 10 min — is celery beat up?" in html
    assert "a@h (pid 5, celery" in html
    assert read_presence().live_workers[0].hostname == "a@h"


def test_status__a_gevent_worker_on_a_database_pool_appears_too(start_worker):
    """The model worker's shape: its heartbeat takes a connection outside the pool, as the lease renewer does."""
    worker = start_worker(pool="gevent", concurrency=10, env={"DJANGO_DB_POOL": "1"})

    seen = wait_until_alive(worker)

    assert seen["hostname"].startswith(f"{worker.name}@")


def test_status__a_configured_queue_no_live_worker_consumes_is_named(settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "MODEL_QUEUE": "model"}
    sweep()
    record_beat("worker:d@h:8", ProcessHeartbeat.Kind.WORKER, hostname="d@h", pid=8, queues=["celery"])

    health = system_health()

    assert health.verdict == "no live worker consumes the queue 'model' (MODEL_QUEUE) — start one with `--queues model`"


def test_status__runs_waiting_long_for_a_worker_say_the_workers_are_behind(broker_url, settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "METRICS_TOKEN": "scrape-token-0123456789"}
    for _ in range(3):
        api.start("noop", {"steps": 1})  # no worker takes them: their wake-ups wait on the broker's queue
    clock.advance(timedelta(minutes=6))
    sweep()  # the sweep is on time...
    record_beat("worker:b@h:9", ProcessHeartbeat.Kind.WORKER, hostname="b@h", pid=9, queues=["celery"])  # ...and alive

    health = system_health()
    report, code = status()

    assert re.fullmatch(
        r"workers are behind: a runnable run has waited 6 min for a worker \((\d+) messages queued on 'celery'\) — "
        r"add workers or concurrency for the busiest queue, or lower the load \(3 runs stuck\)",
        health.verdict,
    ), health.verdict
    assert health.backlog.queued["celery"] >= 3 and code != 0
    assert report["backlog"]["oldest_runnable_seconds"] >= 360 and report["backlog"]["queued"]["celery"] >= 3
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-token-0123456789")
    samples = {
        (s.name, s.labels.get("queue")): s.value
        for f in text_string_to_metric_families(response.content.decode())
        for s in f.samples
    }
    assert samples[("durable_oldest_runnable_seconds", None)] >= 360
    assert samples[("durable_queue_depth", "celery")] >= 3
