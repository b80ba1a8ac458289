"""Operators' journeys in a real browser (Debian's headless Chromium through Playwright): the on-call
operator logs in, filters the stuck runs, reads a timeline, resumes; with beat down and a worker SIGKILLed
mid-step, the console says why the run is stuck and which step was running; the approver decides exactly what
they were shown. Screenshots are test artifacts.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.db import connections

from durable_agents import api, clock
from durable_agents.clock import DbNow
from durable_agents.engine.advance import advance
from durable_agents.engine.heartbeats import SWEEP, record_beat
from durable_agents.links import decision_path
from durable_agents.models import (
    Effect,
    EffectStatus,
    Event,
    ProcessHeartbeat,
    Run,
    RunStatus,
    Wait,
    WaitStatus,
)
from durable_agents.testing import WorkerProcess, drive, wait_for, wait_for_run
from durable_agents.testing.receiver import IdempotentReceiver
from tests.integration.test_resolve_effect import stopped_on_unknown_outcome
from tests.testapp.models import Execution

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextmanager
def chromium_page() -> Iterator:
    """A page of Debian's headless Chromium driven by Playwright's sync API.

    The sync API runs its own event loop and greenlets: ORM calls made inside this block would open a
    second connection in another context (leaked past teardown). So the test touches the database only
    before and after it — the live server's threads do the work in between.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield browser.new_page(viewport={"width": 1600, "height": 900})
        finally:
            browser.close()


def oncall_operator() -> User:
    user = User.objects.create_user("oncall", password="correct horse battery", is_staff=True)
    content_type = ContentType.objects.get_for_model(Run)
    for codename in ("view_run", "resume_run", "cancel_run", "retry_step"):
        permission, _ = Permission.objects.get_or_create(
            codename=codename, content_type=content_type, defaults={"name": codename.replace("_", " ")}
        )
        user.user_permissions.add(permission)
    return user


def stuck_run_with_history() -> Run:
    """A flaky run that retried once, committed its first step, then lost its worker mid-way."""
    run = api.start("flaky", {"failures": 1})
    deadline = time.monotonic() + 10
    while Run.objects.get(pk=run.pk).cursor < 1:
        assert time.monotonic() < deadline, "the flaky step did not commit after its retry"
        advance(run.id)
        time.sleep(0.05)
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING, lease_owner="worker-7@host-b", lease_expires_at=clock.now() - timedelta(minutes=3)
    )
    return Run.objects.get(pk=run.pk)


def test_operator_journey__login_filter_stuck_open_timeline_resume(live_server, artifacts, broker_url):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    oncall_operator()
    stuck = stuck_run_with_history()
    short = str(stuck.pk)[:8]
    healthy = [str(drive(api.start("noop", {"steps": 3}).id))[:8] for _ in range(3)]
    api.start("noop", {"steps": 2})
    drive(api.start("broken").id)

    with chromium_page() as page:
        page.goto(f"{live_server.url}/admin/")
        page.fill("#id_username", "oncall")
        page.fill("#id_password", "correct horse battery")
        page.click("input[type=submit]")
        page.wait_for_selector("#user-tools")

        page.goto(f"{live_server.url}/admin/durable_agents/run/")
        page.wait_for_selector("#durable-overview")
        assert page.locator("#result_list tbody tr").count() == 6
        page.screenshot(path=str(artifacts / "01-run-list.png"), full_page=True)

        page.click("#changelist-filter a:has-text('stuck now')")
        page.wait_for_url("**stuck=yes**")
        rows = page.locator("#result_list tbody tr")
        assert rows.count() == 1, "only the stuck run is listed"
        assert short in rows.first.inner_text() and "stuck" in rows.first.inner_text()
        assert not any(run in page.content() for run in healthy)
        page.screenshot(path=str(artifacts / "02-stuck-filter.png"), full_page=True)

        page.click(f"#result_list a:has-text('{short}')")
        timeline = page.locator("svg.durable-timeline")
        timeline.wait_for()
        assert timeline.locator("rect title").filter(has_text="flaky: done").count() == 1, "the committed step's bar"
        assert timeline.locator("g title").filter(has_text="retry after attempt 1").count() == 1, "the retry is marked"
        troubleshooting = page.locator("#troubleshooting").inner_text()
        assert "worker-7@host-b" in troubleshooting and "expired" in troubleshooting, "the dead lease is explained"
        page.screenshot(path=str(artifacts / "03-run-page.png"), full_page=True)

        page.click("#action-resume")
        page.wait_for_selector(".messagelist .success")
        assert "Resume: scheduled" in page.locator(".messagelist").inner_text()
        page.screenshot(path=str(artifacts / "04-resumed.png"), full_page=True)

    woken = Event.objects.filter(run=stuck, kind="woken")
    assert [e.actor for e in woken] == ["oncall"], "the resume is in the run's history with the operator's name"


def approver(username: str, *, may_decide: bool = True) -> User:
    user = User.objects.create_user(username, password="correct horse battery", is_staff=True)
    content_type = ContentType.objects.get_for_model(Run)
    for codename in ("view_run", "decide_wait") if may_decide else ("view_run",):
        permission, _ = Permission.objects.get_or_create(
            codename=codename, content_type=content_type, defaults={"name": codename.replace("_", " ")}
        )
        user.user_permissions.add(permission)
    return user


def in_own_thread(work: Callable[[], object]) -> None:
    """ORM work in the middle of a browser session, on a connection of its own that is closed afterwards
    (see `chromium_page`: the Playwright block must not touch the test's connection)."""

    def target() -> None:
        try:
            work()
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)


def sign_in(page: Any, base: str, username: str) -> None:
    page.context.clear_cookies()
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", "correct horse battery")
    page.click("input[type=submit]")
    page.wait_for_selector("#user-tools")


def test_approver_journey__stale_form_refused_spent_link_explained_bulk_approve_confirmed(live_server, artifacts):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    approver("manager-1")
    approver("dave", may_decide=False)
    run = drive(api.start("two_refunds", {}).id)
    small = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    charge = drive(api.start("approve_charge", {"order_id": "BR-1"}).id)
    charge_wait = Wait.objects.get(run=charge)
    small_link, charge_link = decision_path(small), decision_path(charge_wait)
    base = live_server.url

    with chromium_page() as page:
        sign_in(page, base, "manager-1")
        page.goto(f"{base}/admin/durable_agents/run/{run.pk}/actions/approve/")
        assert "Refund 5.00 to order TR-1?" in page.locator("#decided-wait").inner_text()
        page.fill("#id_comment", "ok, 5 euros")
        page.screenshot(path=str(artifacts / "05-decision-form.png"), full_page=True)

        # manager-2 decides the small refund elsewhere; the run moves on to the large one.
        in_own_thread(lambda: (api.decide(small.pk, True, by="manager-2", via="link"), drive(run.id)))
        page.click("#confirm")
        page.wait_for_selector(".messagelist .error")
        refused = page.locator(".messagelist").inner_text()
        assert "already approved by manager-2" in refused and "Refund 5000.00 to order TR-1?" in refused, refused
        page.screenshot(path=str(artifacts / "06-stale-form-refused.png"), full_page=True)

        page.goto(f"{base}{small_link}")
        assert "Refund 5000.00 to order TR-1?" in page.locator(".errornote").inner_text()
        page.screenshot(path=str(artifacts / "07-spent-link.png"), full_page=True)

        page.goto(f"{base}/admin/durable_agents/wait/")
        assert "Approvals and waits" in page.locator("#content h1").inner_text()
        page.screenshot(path=str(artifacts / "08a-approvals-queue.png"), full_page=True)
        page.goto(f"{base}/admin/durable_agents/wait/{charge_wait.pk}/change/")
        assert page.locator("input[value=Approve], button:has-text('Approve')").count() >= 1
        page.screenshot(path=str(artifacts / "08b-wait-page.png"), full_page=True)
        page.goto(f"{base}/admin/durable_agents/wait/")
        page.check("#action-toggle")
        page.select_option("select[name=action]", "approve_selected")
        page.click("button[name=index]")
        page.wait_for_selector("#bulk-waits")
        listed = page.locator("#bulk-waits tbody").inner_text()
        assert "Refund 5000.00 to order TR-1?" in listed and "Charge the customer 40.00?" in listed, listed
        page.fill("#id_comment", "both verified")
        page.screenshot(path=str(artifacts / "08-bulk-approve-confirmation.png"), full_page=True)
        page.click("#confirm")
        page.wait_for_selector(".messagelist .success")
        assert "Approved 2 waits" in page.locator(".messagelist").inner_text()
        page.screenshot(path=str(artifacts / "09-bulk-approved.png"), full_page=True)

        sign_in(page, base, "dave")
        page.goto(f"{base}{charge_link}")
        refusal = page.locator("#content-main").inner_text()
        assert "may not decide approvals" in refusal and "Charge" not in refusal, refusal
        page.screenshot(path=str(artifacts / "10-link-refused.png"), full_page=True)
        response = page.goto(f"{base}/admin/durable_agents/run/{charge.pk}/actions/approve/")
        assert response is not None and response.status == 403
        assert "durable_agents.decide_wait" in page.locator("#content").inner_text()
        page.screenshot(path=str(artifacts / "10a-styled-403.png"), full_page=True)

    decided = Wait.objects.filter(decided_by="manager-1").order_by("pk")
    assert [(w.status, w.decision["comment"]) for w in decided] == [("approved", "both verified")] * 2
    assert Wait.objects.get(pk=small.pk).decided_by == "manager-2", "the stale form decided nothing"


def test_operator_journey__record_the_outcome_nobody_knew_and_the_run_goes_on(live_server, artifacts):
    """A call was made twice and never answered: the run stopped. The on-call operator checks the carrier,
    records the shipment as applied from the run page, and the run resumes from there."""
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    user = oncall_operator()
    content_type = ContentType.objects.get_for_model(Run)
    permission, _ = Permission.objects.get_or_create(
        codename="resolve_effect", content_type=content_type, defaults={"name": "Can record the outcome of an effect"}
    )
    user.user_permissions.add(permission)
    with IdempotentReceiver() as carrier:
        run, effect = stopped_on_unknown_outcome(carrier)
    base = live_server.url

    with chromium_page() as page:
        sign_in(page, base, "oncall")
        page.goto(f"{base}/admin/durable_agents/run/{run.pk}/change/")
        page.screenshot(path=str(artifacts / "11-stopped-on-unknown-outcome.png"), full_page=True)
        page.click("#action-resolve")
        page.wait_for_selector("#confirm")
        assert effect.idempotency_key in page.content()
        page.check("input[name=outcome][value=applied]")
        page.fill("#id_result", '{"shipment": "SH-1"}')
        page.fill("#id_reason", "the carrier's portal shows shipment SH-1 for this key")
        page.screenshot(path=str(artifacts / "12-record-outcome-form.png"), full_page=True)
        page.click("#confirm")
        page.wait_for_selector(".messagelist .success")
        page.screenshot(path=str(artifacts / "13-outcome-recorded.png"), full_page=True)

    effect.refresh_from_db()
    assert effect.status == "applied" and effect.result == {"shipment": "SH-1"}
    assert Event.objects.filter(run=run, kind="effect_resolved", actor="oncall").exists()
    assert Run.objects.get(pk=run.pk).status == RunStatus.PENDING, "the run resumed from the recorded outcome"


# --- A really stuck run: beat down, its worker SIGKILLed mid-step ----------------------------------------

WIDTHS = (1280, 1920)
STALE_SWEEP = re.compile(r"the sweep has not run for \d+ min — is celery beat up\? \(1 run stuck\)")


def sweep_last_ran(ago: timedelta) -> None:
    """The sweep's heartbeat row as beat left it when it went down: its last pass `ago`, on the database's clock."""
    record_beat(SWEEP, ProcessHeartbeat.Kind.SWEEP)
    ProcessHeartbeat.objects.filter(name=SWEEP).update(started_at=DbNow(-ago), last_seen=DbNow(-ago))


def heartbeat_of(worker: WorkerProcess) -> ProcessHeartbeat:
    return wait_for(
        lambda: ProcessHeartbeat.objects.filter(hostname__startswith=f"{worker.name}@").first(),
        timeout=120,
        interval=0.2,
        what=f"worker {worker.name} to record its heartbeat",
    )


def claimed_mid_step(worker: WorkerProcess, run_id: Any, receiver: IdempotentReceiver, key: str) -> Run:
    """The run once `worker` holds its lease, the step's request reached the receiver and the step is in its
    pause (its marker recorded: killed before it, the next attempt would take the pause instead)."""

    def mid_step() -> Run | None:
        run = Run.objects.get(pk=run_id)
        held = run.lease_owner and worker.owns(run.lease_owner) and receiver.requests_for(key)
        pausing = Execution.objects.filter(run_id=run_id, step_id="notify:after_request").exists()
        return run if held and pausing else None

    return wait_for(mid_step, timeout=90, interval=0.1, what="the worker to claim the run and send its request")


def lease_expired(run_id: Any) -> Run:
    return wait_for(
        lambda: Run.objects.filter(pk=run_id, lease_expires_at__lt=DbNow()).first(),
        timeout=60,
        interval=0.1,
        what="the killed worker's lease to expire",
    )


def open_page(page: Any, url: str, width: int, ready: str) -> None:
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(url)
    page.wait_for_selector(ready)


def test_operator_journey__stuck_run_with_beat_down_and_its_worker_killed_mid_step(
    live_server, artifacts, start_worker
):
    """Beat is down (its last sweep 47 minutes ago) and the worker running a step is SIGKILLed while the step's
    request is out. The on-call operator sees why on the overview, finds the run among the stuck ones, reads
    its running step, its worker and the expired lease, and resumes it; another worker finishes it, and the
    receiver applied the step's effect once."""
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    oncall_operator()
    base = live_server.url
    with IdempotentReceiver() as receiver:
        victim = start_worker()
        run = api.start(
            "notify", {"order_id": "ST-1", "url": receiver.url + "/notify", "pause_at": "after_request", "pause_s": 600}
        )
        key = f"{run.id}:notify:notify:1"
        claimed = claimed_mid_step(victim, run.id, receiver, key)
        victim.kill()
        assert victim.process.returncode == -signal.SIGKILL, "the worker died mid-step, without a warm shutdown"
        survivor = start_worker()  # no beat: nothing sweeps, so nothing but the operator wakes the run
        survivor_host = heartbeat_of(survivor).hostname
        sweep_last_ran(timedelta(minutes=47))
        stuck = lease_expired(run.id)
        assert stuck.status == RunStatus.RUNNING and stuck.lease_owner == claimed.lease_owner
        owner, step_id, short = stuck.lease_owner, "notify", str(run.id)[:8]
        seen: dict[str, Any] = {}

        with chromium_page() as page:
            sign_in(page, base, "oncall")
            for width in WIDTHS:
                open_page(page, f"{base}/admin/durable_agents/run/", width, "#durable-health")
                health = page.locator("#durable-health").inner_text()
                assert STALE_SWEEP.search(health), f"the health panel names beat: {health}"
                assert re.search(r"last sweep 4[7-9] min ago", health), f"the last sweep's time is shown: {health}"
                assert survivor_host in health, f"the live worker is listed: {health}"
                page.screenshot(path=str(artifacts / f"20-stuck-overview-{width}.png"), full_page=True)

                page.click("#durable-overview a[href*='stuck=yes']")
                page.wait_for_url("**stuck=yes**")
                rows = page.locator("#result_list tbody tr")
                assert rows.count() == 1, "only the stuck run is listed"
                row = rows.first.inner_text()
                assert short in row and "stuck" in row, row
                seen[f"stuck row at {width}"] = row
                page.screenshot(path=str(artifacts / f"21-stuck-list-{width}.png"), full_page=True)

                page.click(f"#result_list a:has-text('{short}')")
                page.wait_for_selector("#troubleshooting")
                troubleshooting = page.locator("#troubleshooting").inner_text()
                assert owner in troubleshooting and "expired" in troubleshooting, troubleshooting
                seen[f"running step at {width}"] = running_step_text(page)
                seen[f"timeline at {width}"] = timeline_fit(page, width)
                page.screenshot(path=str(artifacts / f"22-stuck-run-page-{width}.png"), full_page=True)

            page.click("#action-resume")
            page.wait_for_selector(".messagelist .success")
            page.screenshot(path=str(artifacts / f"23-stuck-run-resumed-{WIDTHS[-1]}.png"), full_page=True)

        wait_for_run(run.id, "completed", timeout=120)
        assert [e.actor for e in Event.objects.filter(run=run, kind="woken")] == ["oncall"], "the operator woke it"
        assert not Event.objects.filter(run=run, kind="swept").exists(), "beat was down: no sweep touched the run"
        takeover = Event.objects.get(run=run, kind="lease_takeover")
        assert takeover.detail["previous_owner"] == owner, "the new worker took the dead worker's lease over"
        assert receiver.requests_for(key) == 2, "the killed attempt's call and the successor's, with one key"
        assert list(receiver.applied) == [key], "the receiver applied the step's effect once"
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.status == EffectStatus.APPLIED and effect.attempts == 2 and effect.result["replay"] is True
    assert Execution.objects.filter(run_id=run.id, step_id="notify:after_request").count() == 1, "paused once"
    after = Execution.objects.get(run_id=run.id, step_id="after")
    assert after.pid == survivor.pid, "the surviving worker finished the run"

    # What the list and the run page showed of the running step (issue 16): checked last, so the recovery above
    # is proven whatever they show, and every gap is named at once.
    gaps = console_gaps(seen, step_id=step_id, owner=owner)
    assert not gaps, "\n".join(gaps)


def console_gaps(seen: dict[str, Any], *, step_id: str, owner: str) -> list[str]:
    """What the console failed to tell the operator about the stuck run, at each width."""
    gaps = []
    for width in WIDTHS:
        row = seen[f"stuck row at {width}"]
        if "expired" not in row:
            gaps.append(f"the stuck list gives no reason at {width} px: {row!r}")
        running = seen[f"running step at {width}"]
        # The worker died whole (SIGKILL of its process group): its heartbeat stopped before the lease ran out.
        expected = (step_id, "running", "attempt", owner, "expired", "went silent too")
        lacking = [word for word in expected if word not in running]
        if lacking:
            gaps.append(f"#running-step at {width} px lacks {lacking}: {running!r}")
        fit = seen[f"timeline at {width}"]
        if fit is None:
            gaps.append(f"the run page draws no timeline at {width} px")
            continue
        svg, box = fit
        if svg > min(box, width):
            gaps.append(f"the timeline ({svg:.0f} px wide) overflows its box ({box:.0f} px) at {width} px")
    return gaps


def running_step_text(page: Any) -> str:
    """The run page's #running-step, or "" when it has none (read without waiting for it to appear)."""
    element = page.locator("#running-step")
    return element.inner_text() if element.count() else ""


def timeline_fit(page: Any, width: int) -> tuple[float, float] | None:
    """(the timeline SVG's rendered width, the width of the box that shows it) at this viewport width; None if
    the page draws no timeline."""
    svg = page.locator("svg.durable-timeline")
    if not svg.count():
        return None
    box = page.locator("#timeline .durable-timeline-box").bounding_box()
    return (svg.bounding_box()["width"], box["width"] if box else float(width))
