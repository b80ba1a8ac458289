"""Batch delivery's pages in a real browser at a laptop's 1,280 px: a run page with turns in Message Batches (its
Message Batches section, the batch-priced turn), the Message Batches list and one batch's page, and the run list's
batches-in-flight card.

Each must say what it shows without scrolling sideways and without a table spilling out of its box; full-page
screenshots are artifacts (DURABLE_TEST_ARTIFACTS), `batches-<page>-1280.png` (and the run list's cards alone).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from tests.e2e.test_admin_browser import CHROMIUM, chromium_page, sign_in
from tests.e2e.test_console_walkthrough import SPILL
from tests.integration.test_admin_batches import batched_run

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTH = 1280


def test_batch_pages__run_page_batches_list_and_card_fit_1280_px(live_server, artifacts):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    User.objects.create_superuser("oncall", password="correct horse battery")
    run, ended, flying = batched_run(turns=4, provider="msgbatch_013f9XkqbNvYk4dLPeGv2RTy")
    pages = {
        "run": reverse("admin:durable_agents_run_change", args=[run.pk]),
        "list": reverse("admin:durable_agents_messagebatch_changelist"),
        "batch": reverse("admin:durable_agents_messagebatch_change", args=[flying.pk]),
        "runs": reverse("admin:durable_agents_run_changelist"),
    }
    wanted = {
        "run": ("Message Batches", flying.provider_id, "in_progress", "waiting 12 min", "ended after 36 min", "batch"),
        "list": ("Message Batches", flying.provider_id, "processing 3", "ended after 35 min", "12 min"),
        "batch": (flying.provider_id, "processing 3", "submitted", "review"),
        "runs": ("MESSAGE BATCHES IN FLIGHT", "1 batch", "3 turns processing", "oldest made 12 min ago"),
    }
    problems: dict[str, Any] = {}

    with chromium_page() as page:
        sign_in(page, live_server.url, "oncall")
        page.set_viewport_size({"width": WIDTH, "height": 900})
        for name, path in pages.items():
            label = f"batches-{name}-{WIDTH}"
            response = page.goto(f"{live_server.url}{path}")
            if name == "run":
                page.locator("#batches").scroll_into_view_if_needed()
            page.screenshot(path=str(artifacts / f"{label}.png"), full_page=True)
            if name == "runs":
                page.locator("#durable-overview").screenshot(path=str(artifacts / f"{label}-cards.png"))
            if response is None or response.status != 200:
                problems[label] = f"not opened: {response.status if response else None}"
                continue
            body = page.inner_text("body")
            if missing := [w for w in wanted[name] if w not in body]:
                problems[label] = f"does not say {missing}"
            overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
            if overflow > 0:
                problems[label] = f"scrolls sideways by {overflow} px"
            if spill := page.evaluate(SPILL):
                problems[label] = f"a table spills out of {spill}"

    assert not problems, f"batch pages that do not fit or do not say what they show: {problems}"
