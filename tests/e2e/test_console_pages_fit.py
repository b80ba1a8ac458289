"""The console's pages in a real browser at a laptop's 1,280 px and a desktop's 1,920 px: none scrolls sideways.

An on-call engineer found the run page 1,606 px wide at 1,280 (steps and effects overflowed). Each page here is
opened with what stretches it — a run waiting on a signal (the deliver form), a run with a failed, retried step and
a long error, a paused schedule, an approval asking for an amount — and `document.documentElement.scrollWidth`
must not exceed the window. Screenshots are artifacts (DURABLE_TEST_ARTIFACTS).
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from durable_agents import api
from durable_agents.models import Wait
from durable_agents.testing import drive
from tests.e2e.test_admin_browser import CHROMIUM, chromium_page

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTHS = (1280, 1920)


def _pages() -> dict[str, str]:
    signal = drive(api.start("signal_flow", {"order_id": "A-1001"}).id)
    approval = drive(api.start("approve_charge", {"amount": "40.00"}).id)
    flaky = drive(api.start("flaky", {"failures": 2}).id)
    api.schedule("nightly-refunds-report", "record", cron="0 3 * * *", input={"steps": 1})
    api.pause_schedule("nightly-refunds-report")
    wait = Wait.objects.get(run=approval, status="open")
    return {
        "run-list": "/admin/durable_agents/run/",
        "run-page-signal": f"/admin/durable_agents/run/{signal.pk}/change/",
        "signal-form": reverse("admin:durable_agents_run_action", args=[signal.pk, "signal"]),
        "run-page-approval": f"/admin/durable_agents/run/{approval.pk}/change/",
        "run-page-retried": f"/admin/durable_agents/run/{flaky.pk}/change/",
        "approvals-queue": "/admin/durable_agents/wait/",
        "wait-page": f"/admin/durable_agents/wait/{wait.pk}/change/",
        "schedules": "/admin/durable_agents/schedule/",
    }


def test_console_pages__none_scrolls_sideways_at_1280_or_1920(live_server, artifacts):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    User.objects.create_superuser("oncall", password="correct horse battery")
    pages = _pages()
    overflowing: dict[str, int] = {}
    statuses: dict[str, int] = {}

    with chromium_page() as page:
        page.goto(f"{live_server.url}/admin/login/")
        page.fill("#id_username", "oncall")
        page.fill("#id_password", "correct horse battery")
        page.click("input[type=submit]")
        for width in WIDTHS:
            page.set_viewport_size({"width": width, "height": 900})
            for name, path in pages.items():
                response = page.goto(f"{live_server.url}{path}")
                # A page the admin cannot find redirects to its index: the landing URL must be the page asked for.
                statuses[name] = response.status if response and response.url.endswith(path) else 0
                page.screenshot(path=str(artifacts / f"{name}-{width}.png"), full_page=True)
                overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
                if overflow > 0:
                    overflowing[f"{name}@{width}"] = overflow

    assert all(status == 200 for status in statuses.values()), statuses
    assert not overflowing, f"pages that scroll sideways (px): {overflowing}"
