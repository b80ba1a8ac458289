"""The run page links a traced run to its trace in the operators' viewer (`TRACE_URL`), and `durable_show` names
the trace; neither shows anything for a run started untraced or with no viewer configured.

The trace id shown is the one the run's stored W3C `traceparent` carries (W3C Trace Context, "trace-id": 32
lowercase hex digits), the id Jaeger and Tempo key a trace by.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from durable_agents import api, tracing
from tests.integration import tracing_helpers
from tests.integration.test_admin import login
from tests.integration.test_run_page import page, section

pytestmark = pytest.mark.django_db(transaction=True)  # the run span ends when its start commits

spans = tracing_helpers.spans

VIEWER = "http://jaeger.example:16686/trace/{trace_id}"


def _trace_id(span) -> str:
    return f"{span.context.trace_id:032x}"


def test_run_page__links_the_run_to_its_trace_when_a_trace_url_is_set(spans, settings):
    run = api.start("noop", {"steps": 1})
    trace_id = _trace_id(spans.one("run noop"))
    assert tracing.trace_id(run.trace_context) == trace_id
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACE_URL": VIEWER}
    html = page(login("operator"), run)
    link = section(html, "trace-link")
    assert f'href="http://jaeger.example:16686/trace/{trace_id}"' in link, link
    assert f">{trace_id}</a>" in link


def test_run_page__shows_no_trace_without_a_trace_url(spans):
    run = api.start("noop", {"steps": 1})
    assert run.trace_context, "traced: the row keeps the run span's context"
    html = page(login("operator"), run)
    assert 'id="trace-link"' not in html and "<dt>Trace</dt>" not in html


def test_run_page__shows_no_trace_for_a_run_started_untraced(settings):
    settings.DURABLE_AGENTS = {**getattr(settings, "DURABLE_AGENTS", {}), "TRACE_URL": VIEWER}
    run = api.start("noop", {"steps": 1})
    assert run.trace_context == ""
    html = page(login("operator"), run)
    assert 'id="trace-link"' not in html and "{trace_id}" not in html


def test_durable_show__names_the_trace_and_its_link(spans, settings):
    run = api.start("noop", {"steps": 1})
    trace_id = _trace_id(spans.one("run noop"))
    out = io.StringIO()
    call_command("durable_show", str(run.id), stdout=out)
    assert f"  trace {trace_id}\n" in out.getvalue(), out.getvalue()
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACE_URL": VIEWER}
    out = io.StringIO()
    call_command("durable_show", str(run.id), stdout=out)
    assert f"  trace {trace_id}  http://jaeger.example:16686/trace/{trace_id}\n" in out.getvalue()


def test_durable_show__says_nothing_of_a_trace_for_an_untraced_run():
    run = api.start("noop", {"steps": 1})
    out = io.StringIO()
    call_command("durable_show", str(run.id), stdout=out)
    assert "trace" not in out.getvalue().split("steps:")[0]
