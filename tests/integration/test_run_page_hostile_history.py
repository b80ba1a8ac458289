"""The run page tells the truth about a damaged or hostile history: an event the engine never wrote, clock
skew, ten thousand attempts or a right-to-left override in a worker name neither take the page down nor draw
anything false, in a bounded number of queries and size.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents import api, clock
from durable_agents.admin.guards import DIRECTION_CONTROLS
from durable_agents.models import Event, Run, RunStatus, Step
from tests.integration.test_admin import LIST, login
from tests.integration.test_run_page import page, svg_of

# --- the run page: hostile data, clocks that disagree -----------------------------------------------------------

HOSTILE_TEXT = "<script>alert(1)</script></svg>\"'&\u202eevil"
SVG = "{http://www.w3.org/2000/svg}"
# Event details the engine never writes, but an older version, a hand edit or a damaged row may hold.
DAMAGED = [
    ("step_retry", {"started_at": "2026-02-30T00:00:00+00:00", "attempt": 1, "error": {"type": HOSTILE_TEXT}}),
    ("failed", {"started_at": "2026-01-01T00:00:00", "attempt": "abc", "error": HOSTILE_TEXT}),
    ("failed", {"started_at": 12345, "attempt": 1.5}),
    ("lease_takeover", {"previous_claimed_at": "2026-01-01T00:00:00", "previous_expires_at": "2026-01-01T00:01:00Z"}),
    ("lease_takeover", {"previous_claimed_at": "2026-13-01T00:00:00Z", "previous_expires_at": "x", "attempt": "x"}),
    ("step_retry", ["not", "a", "mapping"]),
    ("failed", "a string"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "detail"), DAMAGED)
def test_run_page__an_event_the_engine_never_wrote_does_not_take_the_page_down(kind, detail):
    run = api.start("noop", {"steps": 2})
    Event.objects.create(run=run, kind=kind, step_id="tick-1", detail=detail)
    shown = page(login("operator-damaged"), run)
    assert "<script>alert" not in shown
    ET.fromstring(svg_of(shown))


@pytest.mark.django_db
def test_run_page__a_claim_stamped_after_now_and_a_lease_out_before_it_draw_nothing_past_now():
    clock.reset()
    run = api.start("noop", {"steps": 2})
    now = clock.now()
    Step.objects.filter(run=run, position=0).update(step_id=f"s{HOSTILE_TEXT}")
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING,
        lease_owner=HOSTILE_TEXT,
        attempt=3,
        claimed_at=now + timedelta(hours=1),
        lease_expires_at=now - timedelta(hours=1),
    )
    shown = page(login("operator-clocks"), run)
    assert "<script>alert" not in shown and '</svg>"' not in shown
    svg = ET.fromstring(svg_of(shown))
    now_x = next(float(line.get("x1")) for line in svg.iter(f"{SVG}line") if line.findtext(f"{SVG}title") == "now")
    for bar in svg.iter(f"{SVG}rect"):
        if "attempt" in (bar.get("class") or ""):
            right = float(bar.get("x")) + float(bar.get("width"))
            assert right <= now_x + 2.1, f"{bar.findtext(f'{SVG}title')}: drawn past now"


def _history_of(run: Run, attempts: int) -> None:
    """`attempts` failed, retried and taken-over attempts of the run's first step, as the engine records them."""
    now = clock.now()
    events = []
    for n in range(attempts):
        began, ended = now - timedelta(seconds=2 * (attempts - n)), now - timedelta(seconds=2 * (attempts - n) - 1)
        kind = ("step_retry", "failed", "lease_takeover")[n % 3]
        detail = {"attempt": n + 1, "started_at": began.isoformat(), "error": {"type": "E", "message": "x" * 500}}
        if kind == "lease_takeover":
            detail = {
                "attempt": n + 1,
                "previous_owner": f"host:{n}",
                "previous_claimed_at": began.isoformat(),
                "previous_expires_at": ended.isoformat(),
                "token": n,
            }
        events.append(Event(run=run, kind=kind, step_id="tick-1", detail=detail))
    Event.objects.bulk_create(events)


@pytest.mark.django_db
def test_run_page__ten_thousand_attempts_read_in_the_same_queries_and_render_in_bounded_size():
    client = login("operator-history")
    sizes, counts = [], []
    for attempts in (3, 10_000):
        run = api.start("noop", {"steps": 2})
        _history_of(run, attempts)
        with CaptureQueriesContext(connection) as queries:
            sizes.append(len(page(client, run)))
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1], f"queries grow with the history: {counts}"
    assert sizes[1] < 2_000_000, f"the page grows with the history: {sizes}"


@pytest.mark.django_db
def test_run_page__a_right_to_left_override_in_a_worker_name_does_not_reverse_the_words_after_it():
    run = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, lease_owner="host\u202e:42", claimed_at=clock.now(), lease_expires_at=clock.now()
    )
    client = login("operator-bidi")
    Step.objects.filter(run=run, position=0).update(error={"type": "E\u2067", "message": "m\u202d"})
    for shown in (page(client, run), client.get(LIST).content.decode()):
        assert not any(control in shown for control in DIRECTION_CONTROLS), "a direction control is obeyed"
        assert "host⟨U+202E⟩:42" in shown, "the control is shown where it is, visibly"
