"""The run list in a real browser at laptop widths: every column visible (Tokens and Cost too) with a long
idempotency key, a failed run's error and a stuck run's reason in their rows. Screenshots are artifacts.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User

from durable_agents import api, clock
from durable_agents.models import Run, RunStatus
from tests.e2e.test_admin_browser import CHROMIUM, chromium_page

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LONG_KEY = "tenant-42:order-" + "9f3c2a" * 24


def runs_that_stretch_the_table() -> None:
    keyed = api.start("noop", {"steps": 3}, idempotency_key=LONG_KEY)
    Run.objects.filter(pk=keyed.pk).update(input_tokens=1_234_567, output_tokens=89_012, cost_usd="1234.5678")
    failed = api.start("noop", {"steps": 2})
    message = "the payment provider refused the charge: " + "card_declined insufficient_funds " * 6
    Run.objects.filter(pk=failed.pk).update(
        status=RunStatus.FAILED, error={"type": "PaymentProviderError", "message": message, "step": "charge"}
    )
    stuck = api.start("noop", {"steps": 2})
    Run.objects.filter(pk=stuck.pk).update(
        status=RunStatus.RUNNING,
        lease_owner="celery@worker-host-with-a-long-name-7",
        lease_expires_at=clock.now() - timedelta(minutes=4),
    )


@pytest.mark.parametrize("width", [1280, 1440])
def test_run_list__every_column_fits_the_viewport(live_server, artifacts, width):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    User.objects.create_superuser("lister", password="correct horse battery")
    runs_that_stretch_the_table()

    with chromium_page() as page:
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(f"{live_server.url}/admin/login/?next=/admin/durable_agents/run/")
        page.fill("#id_username", "lister")
        page.fill("#id_password", "correct horse battery")
        page.click("input[type=submit]")
        page.wait_for_selector("#result_list")
        page.screenshot(path=str(artifacts / f"run-list-{width}.png"), full_page=True)

        cost = page.locator("#result_list th.column-cost").bounding_box()
        tokens = page.locator("#result_list th.column-tokens").bounding_box()
        table = page.locator("#result_list").bounding_box()
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        # The table sits in a box that scrolls sideways when it is too wide: what does not fit is hidden there.
        hidden = page.evaluate("(b => b.scrollWidth - b.clientWidth)(document.querySelector('#changelist .results'))")
        sidebar = page.locator("#changelist-filter").bounding_box()
        key = page.locator(".durable-key").first.bounding_box()
        errors = page.locator(".durable-error-cell").all_inner_texts()
        reasons = page.locator(".durable-reason").all_inner_texts()

    assert cost["x"] + cost["width"] <= width, f"the Cost column is cut off at {width} px: {cost}"
    assert tokens["x"] + tokens["width"] <= width, f"the Tokens column is cut off at {width} px: {tokens}"
    assert table["x"] + table["width"] <= sidebar["x"], f"the results table runs under the filters: {table}"
    assert hidden <= 0, f"{hidden} px of the results table are scrolled out of sight at {width} px"
    assert overflow <= 0, f"the page scrolls sideways by {overflow} px at {width} px"
    assert key["width"] < width / 4, f"the long idempotency key wraps inside its column: {key}"
    assert any(text.startswith("PaymentProviderError:\nthe payment provider refused") for text in errors), errors
    assert any("lease expired 4 min ago (worker celery@worker-host-with-a-long-name-7)" in r for r in reasons), reasons
