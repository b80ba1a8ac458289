"""One timestamp format across the console: the current zone, named; milliseconds where asked."""

from datetime import UTC, datetime, timedelta

from django.template import engines
from django.utils import timezone

from durable_agents.display import ago_text, human_duration, when_html, when_text

MOMENT = datetime(2026, 12, 1, 12, 3, 7, 123456, tzinfo=UTC)


def test_the_zone_is_always_named():
    assert when_text(MOMENT) == "2026-12-01 12:03:07 UTC"
    with timezone.override("America/New_York"):
        assert when_text(MOMENT) == "2026-12-01 07:03:07 EST"


def test_precise_adds_milliseconds_and_the_element_keeps_the_exact_instant():
    html = when_html(MOMENT, precise=True)
    assert html == '<time datetime="2026-12-01T12:03:07.123456+00:00">2026-12-01 12:03:07.123 UTC</time>'


def test_the_template_filters_render_a_dash_for_nothing():
    rendered = engines["django"].from_string("{% load durable %}{{ a|when }} | {{ b|when_precise }}")
    out = rendered.render({"a": MOMENT, "b": None})
    moment = '<time datetime="2026-12-01T12:03:07.123456+00:00">2026-12-01 12:03:07 UTC</time>'
    assert out == f'{moment} | <span class="durable-quiet">—</span>'


def test_every_duration_carries_its_unit_and_a_moment_ago_reads_as_just_now():
    assert human_duration(0) == "0s" and human_duration(-0.2) == "0s", "a bare 0 has no unit ('heartbeat 0 ago')"
    assert ago_text(MOMENT, MOMENT) == "just now"
    assert ago_text(MOMENT - timedelta(milliseconds=400), MOMENT) == "just now"
    assert ago_text(MOMENT - timedelta(seconds=2.9), MOMENT) == "3 s ago", "an age reads as the health verdicts do"
    assert ago_text(MOMENT - timedelta(minutes=11, seconds=9), MOMENT) == "11 min ago"
