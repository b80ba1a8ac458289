"""Health under load, where on-call looks first: the backlog the sweep measured and the workers' saturation reach the
console's overview (without the page asking the broker), `durable_status` and the metrics — and an unknown backlog
reads as unknown, never as 0 or OK.

Real Redis and Postgres; beat's pass is `tasks.sweep()` run here (it asks the broker, as beat's does).
"""

from __future__ import annotations

import html
import json
import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from durable_agents import api, clock, tasks
from durable_agents.engine.heartbeats import SWEEP, record_beat
from durable_agents.health import system_health
from durable_agents.models import ProcessHeartbeat
from durable_agents.testing import wait_for, wait_for_run
from tests.integration.test_admin import LIST, login
from tests.integration.test_run_list import QUERY_BUDGET
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "scrape-token-0123456789"


def health_panel(client: Client) -> str:
    """The overview's health panel as text, as on-call reads it."""
    page = client.get(LIST).content.decode()
    panel = page.split('id="durable-health"', 1)[1].split("</div>", 1)[0]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", panel)).split())


def status() -> tuple[str, dict, int]:
    """durable_status as text and --json, and its exit code."""
    text, report = StringIO(), StringIO()
    code = 0
    for command_args, out in (((), text), (("--json",), report)):
        try:
            call_command("durable_status", *command_args, stdout=out)
        except CommandError as exc:
            code = exc.returncode
    return text.getvalue(), json.loads(report.getvalue()), code


def scrape(settings) -> dict[tuple[str, str | None], float]:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "METRICS_TOKEN": TOKEN}
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    return {
        (s.name, s.labels.get("queue") or s.labels.get("worker")): s.value
        for f in text_string_to_metric_families(response.content.decode())
        for s in f.samples
    }


def a_live_worker() -> None:
    record_beat("worker:b@h:9", ProcessHeartbeat.Kind.WORKER, hostname="b@h", pid=9, queues=["celery"])


def test_overview__says_the_backlog_and_that_workers_are_behind_when_the_sweep_measured_a_deep_queue():
    operator = login("oncall-backlog")
    for _ in range(3):
        api.start("noop", {"steps": 1})  # no worker takes them: their wake-ups wait on the broker's queue
    clock.advance(timedelta(minutes=6))
    tasks.sweep()  # beat's pass: it asks the broker and records what it measured
    a_live_worker()

    panel = health_panel(operator)

    assert "System health: OK" not in panel, f"runs wait 6 min for a worker: the console must not say OK: {panel}"
    assert "workers are behind: a runnable run has waited 6 min for a worker" in panel, panel
    depth = re.search(r"queued wake-ups, as of the sweep's last pass \d+ s ago: celery ([\d,]+)", panel)
    assert depth and int(depth[1].replace(",", "")) >= 3, f"the overview shows the sweep's measurement: {panel}"
    assert "oldest runnable run waiting: 6 min" in panel, panel


def test_overview__stays_within_the_run_lists_query_budget_with_the_backlog():
    operator = login("oncall-budget")
    api.start("noop", {"steps": 1})
    tasks.sweep()
    a_live_worker()

    with CaptureQueriesContext(connection) as queries:
        assert operator.get(LIST).status_code == 200

    assert len(queries) <= QUERY_BUDGET, f"the run list with its backlog takes {len(queries)} queries"


def test_overview__says_the_backlog_is_unknown_when_the_sweeps_measurement_is_stale():
    operator = login("oncall-stale")
    tasks.sweep()
    a_live_worker()
    clock.advance(timedelta(minutes=10))
    a_live_worker()

    panel = health_panel(operator)

    assert "queued wake-ups: unknown (the sweep's last measurement is 10 min old)" in panel, panel
    assert "System health: OK" not in panel, panel


def test_overview__says_the_backlog_is_unknown_when_the_sweep_did_not_ask_the_broker():
    from durable_agents.engine.sweep import sweep

    operator = login("oncall-unasked")
    sweep()  # a pass given no backlog (the broker did not answer)
    a_live_worker()

    panel = health_panel(operator)

    assert "queued wake-ups: unknown (the broker did not answer the sweep)" in panel, panel
    assert " celery 0" not in panel, "unknown is never shown as 0"


def test_status__a_growing_backlog_says_by_how_much_since_the_previous_pass(settings):
    for _ in range(2):
        api.start("noop", {"steps": 1})
    tasks.sweep()
    for _ in range(3):
        api.start("noop", {"steps": 1})
    clock.advance(timedelta(minutes=6))
    tasks.sweep()
    a_live_worker()

    health = system_health()
    text, report, code = status()

    growing = [p for p in health.problems if p.startswith("backlog growing:")]
    assert growing and re.fullmatch(
        r"backlog growing: [\d,]+ wake-ups on 'celery', up from [\d,]+ a pass ago", growing[0]
    )
    assert health.problems[-1].startswith("workers are behind"), health.problems
    assert code == 1 and "backlog growing" in report["verdict"] and "up from" in text


def test_status__an_old_console_and_a_worker_without_load_say_nothing_about_saturation():
    tasks.sweep()
    a_live_worker()

    health = system_health(ask_broker=False)

    assert health.ok, health.verdict
    assert health.presence.live_workers[0].load is None


def test_saturated_worker__is_reported_on_the_overview_in_durable_status_and_in_the_metrics(
    start_worker, tmp_path, settings
):
    # The model worker's shape: gevent, more greenlets than pooled connections. One step holds the only connection;
    # the next two tasks wait for it.
    worker = start_worker(pool="gevent", concurrency=3, env={"DJANGO_DB_POOL": "1", "DJANGO_DB_POOL_TIMEOUT": "120"})
    release = tmp_path / "release"
    holder = api.start("slow", {"until": str(release)})
    wait_for(lambda: Execution.objects.filter(run_id=holder.id).exists(), timeout=60, what="the holder's step")
    starved = [api.start("noop", {"steps": 1}) for _ in range(2)]
    tasks.sweep()
    try:

        def saturated_row() -> ProcessHeartbeat | None:
            row = ProcessHeartbeat.objects.filter(kind="worker", pid=worker.pid).first()
            return row if row and (row.load.get("pool") or {}).get("waiting", 0) >= 2 else None

        row = wait_for(saturated_row, timeout=60, interval=0.5, what="the worker's beat to see its pool waits")
        operator = login("oncall-saturated")

        panel = health_panel(operator)
        text, report, code = status()
        samples = scrape(settings)

        said = re.compile(
            rf"the worker {re.escape(row.hostname)} \(celery\) is saturated: 3 of 3 slots busy, 2 tasks waiting for a "
            r"database connection \(pool of 1\)"
        )
        assert said.search(panel), f"the overview names the saturated worker: {panel}"
        assert said.search(report["verdict"]) and code == 1, report["verdict"]
        assert "3 of 3 slots busy, 2 tasks waiting for a database connection (pool of 1)" in text, text
        seen = next(w for w in report["live_workers"] if w["pid"] == worker.pid)
        assert seen["load"]["slots_busy"] == 3 and seen["load"]["pool"]["waiting"] == 2, seen
        assert samples[("durable_worker_slots_busy", row.hostname)] == 3
        assert samples[("durable_worker_slots", row.hostname)] == 3
        assert samples[("durable_worker_pool_waiting", row.hostname)] == 2
    finally:
        release.touch()
    for run in (holder, *starved):
        wait_for_run(run.id, "completed", timeout=120)


def test_sweep__keeps_one_previous_measurement_on_its_row():
    tasks.sweep()
    tasks.sweep()

    load = ProcessHeartbeat.objects.get(name=SWEEP).load

    assert set(load) == {"queued", "measured_at", "previous"}, load
    assert "previous" not in load["previous"], "only the pass before is kept, not the whole chain"
