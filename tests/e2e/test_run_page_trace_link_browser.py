"""In a real browser, a traced run's page shows its trace id linked to the operators' trace viewer (`TRACE_URL`);
the link opens the viewer in a new tab. A screenshot of the page is a test artifact."""

from __future__ import annotations

import pytest

from durable_agents import api, tracing
from durable_agents.testing import drive
from tests.e2e.test_admin_browser import CHROMIUM, chromium_page, oncall_operator
from tests.integration import tracing_helpers

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

spans = tracing_helpers.spans


def test_run_page__the_trace_link_opens_the_runs_trace_in_the_viewer(live_server, artifacts, spans, settings):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACE_URL": "http://localhost:16686/trace/{trace_id}"}
    oncall_operator()
    run = drive(api.start("noop", {"steps": 3}).id)
    trace_id = tracing.trace_id(run.trace_context)
    assert trace_id == f"{spans.one('run noop').context.trace_id:032x}"

    with chromium_page() as page:
        page.goto(f"{live_server.url}/admin/")
        page.fill("#id_username", "oncall")
        page.fill("#id_password", "correct horse battery")
        page.click("input[type=submit]")
        page.wait_for_selector("#user-tools")
        page.goto(f"{live_server.url}/admin/durable_agents/run/{run.pk}/change/")
        link = page.locator("#trace-link a")
        link.wait_for()
        assert link.inner_text() == trace_id
        assert link.get_attribute("href") == f"http://localhost:16686/trace/{trace_id}"
        assert link.get_attribute("target") == "_blank"
        page.screenshot(path=str(artifacts / "run-page-trace-link.png"), full_page=False)
