"""The run list as on-call reads it: the error and the stuck reason in the row, overview links that compose with
the sidebar's filters, one zoned time format, and a query count that does not grow with the runs.
"""

from __future__ import annotations

import html
import re
from datetime import timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext, override_settings

from durable_agents import api, clock
from durable_agents.admin.filters import AGING, STATUS_PARAMETER
from durable_agents.models import Run, RunStatus
from durable_agents.workflows import registry
from tests.integration.test_admin import LIST, ids, listed, login

pytestmark = pytest.mark.django_db

QUERY_BUDGET = 15


@pytest.fixture
def operator():
    return login("operator-list")


def row_of(page: str, run: Run) -> str:
    """The <tr> of `run` in the result list."""
    short = str(run.pk)[:8]
    rows = re.findall(r"<tr>.*?</tr>", page.split('id="result_list"', 1)[1], flags=re.S)
    matching = [row for row in rows if f">{short}</a>" in row]
    assert len(matching) == 1, f"run {short} is listed once"
    return matching[0]


def sidebar_link(page: str, label: str) -> str:
    """The href of the sidebar's filter choice labelled `label`."""
    sidebar = page.split('id="changelist-filter"', 1)[1]
    match = re.search(r'<a href="([^"]*)"[^>]*>\s*' + re.escape(label) + r"\s*</a>", sidebar)
    assert match, f"the sidebar offers {label!r}"
    return html.unescape(match.group(1))


def selected_choices(page: str) -> list[str]:
    sidebar = page.split('id="changelist-filter"', 1)[1]
    return [c.strip() for c in re.findall(r'<li class="selected">\s*<a[^>]*>([^<]*)</a>', sidebar)]


def test_failed_row_shows_the_error_type_and_message_escaped():
    client = login("operator-errors")
    long_message = "card <b>declined</b> by the issuer; " + "retrying will not help. " * 10
    failed = api.start("noop", {"steps": 1})
    Run.objects.filter(pk=failed.pk).update(
        status=RunStatus.FAILED, error={"type": "PaymentError", "message": long_message, "step": "charge"}
    )

    row = row_of(client.get(LIST).content.decode(), failed)

    assert "<strong>PaymentError:</strong> card &lt;b&gt;declined&lt;/b&gt; by the issuer" in row, "visible, escaped"
    assert "<b>declined</b>" not in row, "the message is never rendered as markup"
    assert "…" in row, "a long message is cut in the row"
    full = html.escape(f"PaymentError: {long_message} (step charge)")
    assert f'title="{full}"' in row, "the whole message is in the cell's title"


def test_stuck_rows_say_why_in_the_row():
    client = login("operator-stuck")
    now = clock.now()
    lost = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=lost.pk).update(
        status=RunStatus.RUNNING, lease_owner="worker-7@host-b", lease_expires_at=now - timedelta(minutes=4)
    )
    unpicked = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=unpicked.pk).update(updated_at=now - timedelta(minutes=25))
    overslept = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=overslept.pk).update(
        updated_at=now - timedelta(minutes=30), wake_at=now - timedelta(minutes=12)
    )
    healthy = api.start("noop", {"steps": 2})

    page = client.get(f"{LIST}?stuck=yes").content.decode()

    assert 'class="durable-reason">lease expired 4 min ago (worker worker-7@host-b)</div>' in row_of(page, lost)
    assert 'class="durable-reason">runnable but not picked up for 25 min</div>' in row_of(page, unpicked)
    assert 'class="durable-reason">wake time passed 12 min ago, not picked up</div>' in row_of(page, overslept)
    assert str(healthy.pk)[:8] not in page
    assert "durable-reason" not in row_of(client.get(LIST).content.decode(), healthy), "no reason for a healthy run"


def test_overview_links_use_the_sidebar_parameters_and_compose(operator):
    runs = {status: api.start("noop", {"steps": 1}) for status in RunStatus.values}
    for status, run in runs.items():
        Run.objects.filter(pk=run.pk).update(status=status)
    overview = operator.get(LIST).context["overview"]
    card = {c.label: c.link for c in overview.by_status}["failed"]
    assert card == f"?{STATUS_PARAMETER}=failed"

    page = operator.get(LIST + card).content.decode()
    assert ids(listed(operator, card[1:])) == {runs["failed"].pk}
    assert selected_choices(page)[0] == "Failed", "the card's filter is the one highlighted in the sidebar"

    running = sidebar_link(page, "Running")
    assert "failed" not in running, f"the sidebar's next choice replaces the card's filter: {running}"
    assert ids(listed(operator, running.lstrip("?"))) == {runs["running"].pk}

    stuck = sidebar_link(operator.get(LIST + overview.stuck.link).content.decode(), "Running")
    assert "stuck=yes" in stuck and STATUS_PARAMETER in stuck, "a status click keeps the stuck filter"
    assert overview.waits_past_deadline.link == "?wait=overdue"


@override_settings(TIME_ZONE="America/New_York")
def test_times_are_in_the_current_zone_and_say_so(operator):
    running = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=running.pk).update(status=RunStatus.RUNNING, lease_expires_at=clock.now())
    waiting = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=waiting.pk).update(status=RunStatus.WAITING)

    page = operator.get(LIST).content.decode()

    zone = clock.now().astimezone(ZoneInfo("America/New_York")).strftime("%Z")
    stamps = re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: [A-Z]{2,5})?", page)
    assert stamps, "the overview and the rows carry absolute times"
    assert all(stamp.endswith(f" {zone}") for stamp in stamps), f"every time names the zone {zone}: {stamps}"
    # As a word: a page's CSRF tokens are random letters and digits, which spell "UTC" now and then.
    assert not re.search(r"\bUTC\b", page), "a time in UTC where the current zone was asked for"


def seed(n: int) -> None:
    """`n` runs of every kind the filters select: each status, stuck, old, failed with an error, keyed."""
    now = clock.now()
    statuses = RunStatus.values
    names = sorted(registry.names())
    first = Run.objects.count()
    runs = []
    for i in range(n):
        status = statuses[i % len(statuses)]
        runs.append(
            Run(
                workflow=names[i % len(names)],
                workflow_version=1,
                status=status,
                input_hash=f"h{i}",
                idempotency_key=f"order-{first + i}" if i % 3 == 0 else None,
                error={"type": "ValueError", "message": "bad"} if status == RunStatus.FAILED else None,
                step_count=2,
                lease_owner="worker-1" if status == RunStatus.RUNNING else "",
                lease_expires_at=now - timedelta(minutes=1) if status == RunStatus.RUNNING and i % 2 else None,
                created_at=now - timedelta(days=i % 5),
                updated_at=now - timedelta(minutes=i % 40),
            )
        )
    Run.objects.bulk_create(runs)


def list_queries() -> list[str]:
    today = clock.now()
    return [
        "",
        *[f"{STATUS_PARAMETER}={status}" for status in RunStatus.values],
        "stuck=yes",
        f"stuck=yes&{STATUS_PARAMETER}=running",
        *[f"workflow={name}" for name in sorted(registry.names())],
        *[f"aging={key}" for key in AGING],
        "error_type=ValueError",
        "wait=overdue",
        "drift=yes",
        f"created_at__year={today.year}",
        f"created_at__year={today.year}&created_at__month={today.month}",
        f"created_at__year={today.year}&created_at__month={today.month}&created_at__day={today.day}",
        "q=0123abcd",
        "q=order-3",
        "q=A-1001",
        "q=order_id:A-1001",
        "p=2",
    ]


def test_every_list_filter_stays_within_the_query_budget_whatever_the_number_of_runs(operator):
    def count(query: str) -> int:
        with CaptureQueriesContext(connection) as queries:
            assert operator.get(f"{LIST}?{query}").status_code == 200
        return len(queries)

    queries = list_queries()  # once: the date filters name today, which may not be the same day at a second reading
    seed(50)
    few = {query: count(query) for query in queries}
    seed(450)
    many = {query: count(query) for query in queries}

    over = {query: n for query, n in many.items() if n > QUERY_BUDGET}
    assert not over, f"at most {QUERY_BUDGET} queries per list page: {over}"
    grew = {query: (few[query], many[query]) for query in few if few[query] != many[query]}
    assert not grew, f"queries per list page must not grow with the number of runs: {grew}"
