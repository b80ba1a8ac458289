"""The console refreshes itself in a real browser (Debian's headless Chromium): the run page and the run list show a
run's new state without a reload, and never under the operator's hands — a focused or edited field, a selected
row, Pause — and they say so when the server stops answering or the session is gone.

The poll interval is DURABLE_AGENTS['ADMIN_REFRESH_SECONDS'], 0.2 s here. No fixed sleeps: a test waits for the
indicator's counters (`data-ticks` counts the script's checks, `data-polls` the refreshes applied), so "nothing
was swapped" is proven over several checks that were due, however slow the machine. `window.durableMarker`, set
once after the page loaded, survives only if the page was never reloaded.
Screenshots at 1,280 px are artifacts (DURABLE_TEST_ARTIFACTS).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import expect

from durable_agents import api
from durable_agents.models import Run, Wait, WaitStatus
from durable_agents.testing import drive
from tests.e2e.test_admin_browser import CHROMIUM, approver, chromium_page, in_own_thread

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# Generous: a busy 2-core machine renders the page and runs Chromium at once.
TIMEOUT_MS = 30_000
INDICATOR = "#durable-live"
# A stop the operator must notice (signed out, refused) is shown in red; a finished run's is not.
ALARM = re.compile(r"\bdurable-live-alarm\b")
# Checks the script made while it held (or was paused) before a test trusts that nothing was swapped.
CHECKS_WHILE_HELD = 5


@pytest.fixture(autouse=True)
def fast_refresh(settings: Any) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "ADMIN_REFRESH_SECONDS": 0.2}


@pytest.fixture
def oncall(live_server: Any) -> str:
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    User.objects.create_superuser("oncall", password="correct horse battery")
    return live_server.url


def waiting_for_approval(order_id: str) -> Run:
    run = drive(api.start("approve_charge", {"order_id": order_id}).id)
    assert run.status == "waiting", run.status
    return run


def approve_and_finish(run: Run) -> None:
    """From inside the browser block: on a connection of its own (see `in_own_thread`)."""

    def work() -> None:
        wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
        api.decide(wait.pk, True, by="manager-1")
        drive(run.id)

    in_own_thread(work)


def open_signed_in(page: Any, base: str, path: str, username: str = "oncall") -> None:
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(f"{base}/admin/login/?next={path}")
    page.fill("#id_username", username)
    page.fill("#id_password", "correct horse battery")
    page.click("input[type=submit]")
    page.wait_for_selector(INDICATOR)
    expect(page.locator(INDICATOR)).to_be_visible(timeout=TIMEOUT_MS)
    page.evaluate("window.durableMarker = 'never reloaded'")


def counter(page: Any, name: str) -> int:
    return int(page.locator(INDICATOR).get_attribute(f"data-{name}") or 0)


def wait_for_checks(page: Any, count: int = CHECKS_WHILE_HELD) -> None:
    """Until the script has checked `count` more times (each a moment a refresh was due, at 0.2 s)."""
    ticks = counter(page, "ticks")
    page.wait_for_function(
        f"Number(document.querySelector('{INDICATOR}').dataset.ticks) >= {ticks + count}", timeout=TIMEOUT_MS
    )


def wait_for_a_refresh(page: Any) -> None:
    polls = counter(page, "polls")
    page.wait_for_function(f"Number(document.querySelector('{INDICATOR}').dataset.polls) > {polls}", timeout=TIMEOUT_MS)


def document_listeners(page: Any) -> dict[str, int]:
    """The listeners on `document` by event type, as DevTools lists them."""
    session = page.context.new_cdp_session(page)
    try:
        document = session.send("Runtime.evaluate", {"expression": "document"})["result"]["objectId"]
        listeners = session.send("DOMDebugger.getEventListeners", {"objectId": document})["listeners"]
    finally:
        session.detach()
    counts: dict[str, int] = {}
    for listener in listeners:
        counts[listener["type"]] = counts.get(listener["type"], 0) + 1
    return counts


def assert_never_reloaded(page: Any) -> None:
    assert page.evaluate("window.durableMarker") == "never reloaded", "the page was reloaded, not refreshed in place"


def test_run_page__shows_the_new_status_in_place_and_stops_on_the_final_state(oncall, artifacts):
    run = waiting_for_approval("LIVE-1")
    path = f"/admin/durable_agents/run/{run.pk}/change/"

    with chromium_page() as page:
        open_signed_in(page, oncall, path)
        expect(page.locator("#run-status")).to_have_text("waiting")
        wait_for_a_refresh(page)
        expect(page.locator(INDICATOR)).to_contain_text("Live · updated")
        page.screenshot(path=str(artifacts / "run-page-live-1280.png"), full_page=True)

        approve_and_finish(run)

        expect(page.locator("#run-status")).to_have_text("completed", timeout=TIMEOUT_MS)
        expect(page.locator("#steps")).to_contain_text("charge")
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "stopped", timeout=TIMEOUT_MS)
        expect(page.locator(INDICATOR)).to_contain_text("Final state")
        expect(page.locator(INDICATOR)).not_to_have_class(ALARM)
        assert_never_reloaded(page)
        page.screenshot(path=str(artifacts / "run-page-final-1280.png"), full_page=True)
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")

    assert overflow <= 0, f"the run page with its indicator scrolls sideways by {overflow} px at 1,280"


def test_run_page__an_open_brief_and_the_keyboard_focus_survive_a_swap(oncall):
    run = waiting_for_approval("LIVE-10")
    brief = "#waits details"

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/")
        page.click(f"{brief} summary")
        expect(page.locator(brief)).to_have_attribute("open", "")
        approve_and_finish(run)

        expect(page.locator("#run-status")).to_have_text("completed", timeout=TIMEOUT_MS)
        expect(page.locator("#waits")).to_contain_text("approved")
        expect(page.locator(brief)).to_have_attribute("open", "")
        assert page.evaluate("document.activeElement.matches('#waits summary')"), "the keyboard focus was lost"
        assert_never_reloaded(page)


def test_run_page__a_focused_or_edited_field_holds_the_swap(oncall):
    run = waiting_for_approval("LIVE-2")

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/")
        # The run page's own forms are buttons: a field an operator types into stands in for any future one.
        page.evaluate(
            "document.querySelector('#troubleshooting').insertAdjacentHTML('beforeend', '<input id=\"probe\">')"
        )
        page.focus("#probe")
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "held", timeout=TIMEOUT_MS)
        approve_and_finish(run)
        polls = counter(page, "polls")

        wait_for_checks(page)
        assert counter(page, "polls") == polls, "a refresh was applied while a field had focus"
        expect(page.locator("#run-status")).to_have_text("waiting")
        expect(page.locator(INDICATOR)).to_contain_text("on hold while a field has focus")

        page.fill("#probe", "escalate to payments")
        page.evaluate("document.activeElement.blur()")
        wait_for_checks(page)
        assert counter(page, "polls") == polls, "a refresh was applied over unsaved input"
        expect(page.locator(INDICATOR)).to_contain_text("on hold while a field has unsaved input")
        assert page.input_value("#probe") == "escalate to payments"

        page.fill("#probe", "")
        page.evaluate("document.activeElement.blur()")
        expect(page.locator("#run-status")).to_have_text("completed", timeout=TIMEOUT_MS)
        assert_never_reloaded(page)


def test_run_page__selected_text_holds_the_swap(oncall):
    run = waiting_for_approval("LIVE-7")

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/")
        # The operator selects the question to copy it into a chat.
        page.evaluate("getSelection().selectAllChildren(document.querySelector('#open-wait'))")
        expect(page.locator(INDICATOR)).to_contain_text("on hold while text is selected", timeout=TIMEOUT_MS)
        approve_and_finish(run)
        polls = counter(page, "polls")

        wait_for_checks(page)
        assert counter(page, "polls") == polls, "a refresh was applied over the operator's selection"
        assert "Charge the customer 40.00?" in page.evaluate("getSelection().toString()")

        page.evaluate("getSelection().removeAllRanges()")
        expect(page.locator("#run-status")).to_have_text("completed", timeout=TIMEOUT_MS)
        assert_never_reloaded(page)


def test_live_refresh__a_hidden_tab_does_not_poll_and_refreshes_when_shown_again(oncall):
    run = waiting_for_approval("LIVE-8")

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/")
        wait_for_a_refresh(page)
        page.evaluate(
            "Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => 'hidden'});"
            "document.dispatchEvent(new Event('visibilitychange'))"
        )
        approve_and_finish(run)
        polls = counter(page, "polls")

        wait_for_checks(page)
        assert counter(page, "polls") == polls, "a hidden tab kept polling"

        page.evaluate("delete document.visibilityState; document.dispatchEvent(new Event('visibilitychange'))")
        expect(page.locator("#run-status")).to_have_text("completed", timeout=TIMEOUT_MS)
        assert_never_reloaded(page)


def test_live_refresh__stops_and_says_so_when_access_is_refused(oncall):
    run = waiting_for_approval("LIVE-9")
    viewer = approver("viewer", may_decide=False)

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/", username="viewer")
        wait_for_a_refresh(page)
        in_own_thread(lambda: viewer.user_permissions.clear())

        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "stopped", timeout=TIMEOUT_MS)
        expect(page.locator(INDICATOR)).to_contain_text("access refused (403)")
        expect(page.locator(INDICATOR)).to_have_class(ALARM)
        expect(page.locator("#run-status")).to_have_text("waiting")
        assert_never_reloaded(page)


def test_live_refresh__stops_and_says_so_when_the_run_was_deleted_meanwhile(oncall):
    run = waiting_for_approval("LIVE-10")

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/")
        wait_for_a_refresh(page)
        in_own_thread(lambda: Run.objects.filter(pk=run.pk).delete())

        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "stopped", timeout=TIMEOUT_MS)
        expect(page.locator(INDICATOR)).to_contain_text("no longer exists")
        expect(page.locator("#run-status")).to_have_text("waiting")
        assert_never_reloaded(page)


def test_run_list__a_selected_row_holds_the_swap_and_bulk_selection_works_after_new_rows(oncall, artifacts):
    first, second = waiting_for_approval("LIVE-3"), waiting_for_approval("LIVE-4")
    rows = "#result_list tbody"

    with chromium_page() as page:
        open_signed_in(page, oncall, "/admin/durable_agents/run/")
        expect(page.locator(f"{rows} tr")).to_have_count(2)
        wait_for_a_refresh(page)
        page.screenshot(path=str(artifacts / "run-list-live-1280.png"), full_page=True)
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        page.check(f"{rows} tr:first-child input.action-select")
        expect(page.locator(INDICATOR)).to_contain_text("on hold while rows are selected", timeout=TIMEOUT_MS)
        approve_and_finish(first)
        approve_and_finish(second)
        polls = counter(page, "polls")

        wait_for_checks(page)
        assert counter(page, "polls") == polls, "a refresh was applied while rows were selected"
        expect(page.locator(rows)).not_to_contain_text("completed")

        page.uncheck(f"{rows} tr:first-child input.action-select")
        expect(page.locator(f"{rows} tr", has_text="completed")).to_have_count(2, timeout=TIMEOUT_MS)
        expect(page.locator("#durable-overview")).to_contain_text("completed")

        in_own_thread(lambda: drive(api.start("noop", {"steps": 1}).id))
        expect(page.locator(f"{rows} tr")).to_have_count(3, timeout=TIMEOUT_MS)
        listeners = document_listeners(page)
        in_own_thread(lambda: drive(api.start("noop", {"steps": 1}).id))
        expect(page.locator(f"{rows} tr")).to_have_count(4, timeout=TIMEOUT_MS)
        assert document_listeners(page) == listeners, "each swap of new rows left listeners (and its old table) behind"
        # New rows replaced the form: the admin's bulk selection must be bound to them.
        page.check("#action-toggle")
        expect(page.locator(".action-counter")).to_have_text("4 of 4 selected")
        expect(page.locator(INDICATOR)).to_contain_text("on hold while rows are selected", timeout=TIMEOUT_MS)
        assert_never_reloaded(page)

    assert overflow <= 0, f"the run list with its indicator scrolls sideways by {overflow} px at 1,280"


def test_live_refresh__pause_is_remembered_and_holds_until_resumed(oncall):
    run = waiting_for_approval("LIVE-5")
    path = f"/admin/durable_agents/run/{run.pk}/change/"

    with chromium_page() as page:
        open_signed_in(page, oncall, path)
        page.click(f"{INDICATOR} button")
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "paused")
        page.goto(f"{oncall}/admin/durable_agents/run/")
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "paused", timeout=TIMEOUT_MS)
        page.goto(f"{oncall}{path}")
        expect(page.locator(INDICATOR)).to_contain_text("Paused", timeout=TIMEOUT_MS)
        page.evaluate("window.durableMarker = 'never reloaded'")
        approve_and_finish(run)
        polls = counter(page, "polls")

        wait_for_checks(page)
        assert counter(page, "polls") == polls, "a paused page refreshed"
        expect(page.locator("#run-status")).to_have_text("waiting")

        page.click(f"{INDICATOR} button")
        expect(page.locator("#run-status")).to_have_text("completed", timeout=TIMEOUT_MS)
        assert_never_reloaded(page)


def test_live_refresh__says_when_the_server_is_unreachable_or_not_itself_and_stops_when_signed_out(oncall, artifacts):
    run = waiting_for_approval("LIVE-6")

    with chromium_page() as page:
        open_signed_in(page, oncall, f"/admin/durable_agents/run/{run.pk}/change/")
        wait_for_a_refresh(page)
        page.route("**/*", lambda route: route.abort() if route.request.resource_type == "fetch" else route.continue_())
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "stale", timeout=TIMEOUT_MS)
        stale = page.locator(INDICATOR).inner_text()
        assert "Not updated since" in stale and "(server unreachable)" in stale, stale
        page.screenshot(path=str(artifacts / "run-page-unreachable-1280.png"), full_page=True)

        page.unroute("**/*")
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "live", timeout=TIMEOUT_MS)

        # A proxy's maintenance page answers 200: the console must not call that "updated".
        page.route(
            "**/*",
            lambda route: (
                route.fulfill(status=200, content_type="text/html", body="<p>Down for maintenance</p>")
                if route.request.resource_type == "fetch"
                else route.continue_()
            ),
        )
        expect(page.locator(INDICATOR)).to_contain_text("(the server answered with another page)", timeout=TIMEOUT_MS)
        expect(page.locator("#run-status")).to_have_text("waiting")
        page.unroute("**/*")
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "live", timeout=TIMEOUT_MS)

        page.context.clear_cookies()
        expect(page.locator(INDICATOR)).to_have_attribute("data-state", "stopped", timeout=TIMEOUT_MS)
        expect(page.locator(INDICATOR)).to_contain_text("signed out")
        expect(page.locator(INDICATOR)).to_have_class(ALARM)
        expect(page.locator("#run-status")).to_have_text("waiting")
        assert_never_reloaded(page)
        page.screenshot(path=str(artifacts / "run-page-signed-out-1280.png"), full_page=True)
