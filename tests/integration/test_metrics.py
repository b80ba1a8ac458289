"""The Prometheus endpoint: its figures equal what the database says, and only staff or the token read it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from durable_agents import api, clock
from durable_agents.conf import settings as durable_settings
from durable_agents.metrics import QUANTILES, _quantile
from durable_agents.models import Event, Run, RunStatus, Step
from durable_agents.testing import drive

pytestmark = pytest.mark.django_db

TOKEN = "scrape-token-0123456789"
URL = "/metrics"


@pytest.fixture
def with_token(settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "METRICS_TOKEN": TOKEN}


def scrape(client: Client | None = None, **headers: str) -> dict[str, dict[tuple, float]]:
    response = (client or Client()).get(URL, HTTP_AUTHORIZATION=f"Bearer {TOKEN}", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    figures: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            figures.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return figures


def seed() -> dict[str, Run]:
    now = clock.now()
    runs = {
        "done": drive(api.start("noop", {"steps": 3}).id),
        "done2": drive(api.start("record", {"steps": 2}).id),
        "failed": drive(api.start("broken").id),
        "flaky": drive(api.start("flaky", {"failures": 2}).id),
        "pending": api.start("noop", {"steps": 2}),
        "cancelled": api.cancel(api.start("noop", {"steps": 1}).id, "x"),
        "stuck": api.start("noop", {"steps": 2}),
        "waiting": drive(api.start("approve_charge", {"order_id": "M-1"}).id),
    }
    Run.objects.filter(pk=runs["stuck"].pk).update(
        status=RunStatus.RUNNING, lease_owner="gone", lease_expires_at=now - timedelta(minutes=1)
    )
    Run.objects.filter(pk=runs["stuck"].pk).update(created_at=now - timedelta(minutes=30))
    Run.objects.filter(pk=runs["waiting"].pk).update(updated_at=now - timedelta(hours=2))
    return runs


def label(**labels: str) -> tuple:
    return tuple(sorted(labels.items()))


def test_metrics__figures_match_the_database(with_token):
    seed()
    figures = scrape()
    now = clock.now()

    in_db = {
        (r["workflow"], r["status"]): r["n"] for r in Run.objects.values("workflow", "status").annotate(n=Count("pk"))
    }
    for (workflow, status), n in in_db.items():
        assert figures["durable_runs"][label(workflow=workflow, status=status)] == n, f"{workflow} {status}"
    assert sum(figures["durable_runs"].values()) == Run.objects.count(), "every run is counted exactly once"
    assert figures["durable_runs"][label(workflow="two_charges", status="running")] == 0, "zeros are exported too"

    stuck_after = timedelta(seconds=float(durable_settings.STUCK_AFTER_SECONDS))
    stuck = Run.objects.stuck(now=now, stuck_after=stuck_after)
    assert figures["durable_runs_stuck"][label(workflow="noop")] == stuck.filter(workflow="noop").count() == 1
    assert sum(figures["durable_runs_stuck"].values()) == stuck.count()

    waiting_age = figures["durable_run_oldest_waiting_age_seconds"][label(workflow="approve_charge")]
    assert 7200 <= waiting_age < 7200 + 60, "the oldest waiting run's age is measured from when it parked"
    running_age = figures["durable_run_oldest_running_age_seconds"][label(workflow="noop")]
    assert 1800 <= running_age < 1800 + 60

    since = now - timedelta(seconds=float(durable_settings.METRICS_WINDOW_SECONDS))
    for workflow in ("noop", "record", "flaky", "broken"):
        steps = Step.objects.filter(run__workflow=workflow, finished_at__gte=since, started_at__isnull=False)
        durations = sorted((s.finished_at - s.started_at).total_seconds() for s in steps)
        assert figures["durable_steps_finished_recent"][label(workflow=workflow)] == len(durations)
        for q in QUANTILES:
            exported = figures["durable_step_latency_seconds"][label(workflow=workflow, quantile=str(q))]
            assert exported == pytest.approx(_quantile(durations, q), abs=1e-6), f"{workflow} p{q}"

    retries = Event.objects.filter(kind="step_retry", run__workflow="flaky").count()
    assert retries == 2 and figures["durable_step_retries_recent"][label(workflow="flaky")] == retries
    assert figures["durable_step_retries_recent"][label(workflow="noop")] == 0
    assert figures["durable_metrics_scrape_seconds"][()] > 0


def test_metrics__scrape_runs_a_fixed_number_of_queries(with_token):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            scrape()
        return len(captured)

    seed()
    few = queries()
    for _ in range(3):
        seed()
    assert queries() == few, "the collector's queries must not grow with the number of runs"


def test_metrics__access_needs_the_token_or_a_staff_login(with_token):
    anonymous = Client().get(URL)
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"].startswith("Bearer")
    assert Client().get(URL, HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert Client().get(URL, HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200

    staff, member = Client(), Client()
    staff.force_login(User.objects.create_user("staff", is_staff=True))
    member.force_login(User.objects.create_user("member"))
    assert staff.get(URL).status_code == 200, "a staff login reads the metrics in a browser"
    assert member.get(URL).status_code == 403
    assert staff.post(URL).status_code == 405
    openmetrics = staff.get(URL, HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert openmetrics["Content-Type"].startswith("application/openmetrics-text"), "content negotiation"


def test_metrics__without_a_configured_token_no_bearer_is_accepted(settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "METRICS_TOKEN": None}
    assert Client().get(URL, HTTP_AUTHORIZATION="Bearer None").status_code == 401
    assert Client().get(URL, HTTP_AUTHORIZATION="Bearer ").status_code == 401
