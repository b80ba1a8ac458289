"""The console's live refresh, server side: the run list and the run page carry the indicator, the regions the
script swaps (each present on the page, so a refetch finds it again), the poll interval from
DURABLE_AGENTS['ADMIN_REFRESH_SECONDS'], and the final mark on a finished run; the script is a static file.

The browser half (the swap, the holds, Pause, sign-out) is tests/e2e/test_live_refresh.py.
"""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
from django.conf import settings
from django.contrib.staticfiles import finders
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.admin.live import LIVE_HEADER
from durable_agents.testing import drive
from tests.integration.test_admin import LIST, action_url, login, page_url

pytestmark = pytest.mark.django_db


class _Elements(HTMLParser):
    """Every element's attributes, by id, and every script's src."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, dict[str, str | None]] = {}
        self.scripts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if attributes.get("id"):
            self.by_id[str(attributes["id"])] = attributes
        if tag == "script" and attributes.get("src"):
            self.scripts.append(str(attributes["src"]))


def _elements(html: str) -> _Elements:
    parsed = _Elements()
    parsed.feed(html)
    return parsed


def _live(html: str) -> tuple[dict[str, str | None], _Elements]:
    page = _elements(html)
    assert "durable-live" in page.by_id, "the page has no live refresh indicator (the durable_live tag)"
    return page.by_id["durable-live"], page


def test_run_page__carries_the_live_indicator_its_region_and_the_script():
    run = drive(api.start("approve_charge", {"amount": "40.00"}).id)

    indicator, page = _live(login("operator").get(page_url(run)).content.decode())

    assert indicator["data-interval-ms"] == "5000", "the default interval is 5 s (ADMIN_REFRESH_SECONDS)"
    assert indicator["data-regions"] == "#content-main"
    assert "content-main" in page.by_id
    assert "data-final" not in indicator, "a waiting run is not final: the page must keep refreshing"
    assert "hidden" in indicator, "hidden until the script runs: without it nothing is live"
    assert any(src.endswith("durable_agents/live.js") for src in page.scripts), page.scripts
    assert finders.find("durable_agents/live.js"), "the script is a static file of the app (collectstatic finds it)"


def test_run_page__of_a_finished_run_is_marked_final():
    run = drive(api.start("noop", {"steps": 1}).id)
    assert run.status == "completed"

    indicator, _ = _live(login("operator").get(page_url(run)).content.decode())

    assert "data-final" in indicator, "the script stops refreshing once the final state is shown"


def test_run_list__carries_the_live_indicator_and_every_region_it_names():
    drive(api.start("approve_charge", {"amount": "40.00"}).id)

    indicator, page = _live(login("operator").get(LIST).content.decode())

    regions = str(indicator["data-regions"]).split(",")
    assert regions == ["#durable-overview", "#durable-health", "#changelist-form"]
    missing = [region for region in regions if region.removeprefix("#") not in page.by_id]
    assert not missing, f"regions the script cannot find on the page: {missing}"


@override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "ADMIN_REFRESH_SECONDS": 0})
def test_live_refresh__off_when_the_interval_is_zero():
    run = drive(api.start("approve_charge", {"amount": "40.00"}).id)
    operator = login("operator")

    for url in (LIST, page_url(run)):
        page = _elements(operator.get(url).content.decode())
        assert "durable-live" not in page.by_id, url
        assert not any(src.endswith("durable_agents/live.js") for src in page.scripts), url


@override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "ADMIN_REFRESH_SECONDS": 0.25})
def test_live_refresh__interval_follows_the_setting():
    indicator, _ = _live(login("operator").get(LIST).content.decode())

    assert indicator["data-interval-ms"] == "250"


@pytest.mark.parametrize("page", ["run page", "run list"])
def test_live_refresh__a_refetch_leaves_the_messages_to_the_page_opened_next(page):
    """An action's message waits for the page its redirect opens; a refetch of another tab racing that redirect
    must not spend it (the operator would never read 'Cancel does not apply…')."""
    run = drive(api.start("noop", {"steps": 1}).id)
    operator = login("operator", codenames=("cancel_run",))
    operator.post(action_url(run, "cancel"), {"reason": "x"})
    url = page_url(run) if page == "run page" else LIST

    refetched = operator.get(url, headers={LIVE_HEADER: "1"})
    opened = operator.get(url)

    assert refetched.status_code == 200
    assert "Cancel does not apply to a completed run." in opened.content.decode(), "the refetch spent the message"


def test_live_refresh__a_refetch_of_a_run_gone_meanwhile_is_a_404_that_spends_no_message():
    # Django's admin redirects a missing object to the index with a warning; fetch() would follow it and the index
    # would spend that warning and any confirmation waiting for the operator's next page.
    gone, kept = (drive(api.start("noop", {"steps": 1}).id) for _ in range(2))
    operator = login("operator", codenames=("cancel_run",))
    operator.post(action_url(kept, "cancel"), {"reason": "x"})
    url = page_url(gone)
    gone.delete()

    refetched = operator.get(url, headers={LIVE_HEADER: "1"})
    opened = operator.get(LIST)

    assert refetched.status_code == 404, "live.js stops and says the page is gone"
    assert "Cancel does not apply to a completed run." in opened.content.decode(), "the refetch spent the message"
