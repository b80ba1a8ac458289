"""The on-call walk-through: eight situations an engineer meets, in one database, read in a real browser.

For each, the console pages that explain it are opened at a laptop's 1,280 px and a desktop's 1,920 px, and must say
in words what the engineer needs to understand and fix it, without scrolling sideways
(`document.documentElement.scrollWidth` no wider than the window). The landing page is the example project's
(project/templates/admin/index.html: the admin index opens on the overview). Full-page screenshots are artifacts
(DURABLE_TEST_ARTIFACTS), named `<situation>-<page>-<width>.png`.

The states are built as the integration tests build them: the public API and `drive`; the engine's clock moved on
(`clock.advance`) for a stale observation and runs nobody picked up; heartbeat rows for beat's last pass, the workers
and the sweep's measurements of the queues (tests/integration/test_health_load.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.heartbeats import record_beat, record_sweep, worker_beat_name
from durable_agents.models import ProcessHeartbeat, Run, RunStatus, Wait, WaitKind, WaitStatus
from durable_agents.testing import drive
from tests.e2e.test_admin_browser import CHROMIUM, chromium_page, in_own_thread, sign_in
from tests.integration.test_sagas import _charged_twice
from tests.testapp.trust import AMOUNTS

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTHS = (1280, 1920)
PROJECT_TEMPLATES = Path(__file__).resolve().parents[2] / "project" / "templates"
MODEL_QUEUE = "model"
SHOP_WORKER = ("shop@host-a", 41)
MODEL_WORKER = ("model@host-m", 77)


# --- The world ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    stuck: Run
    replanned: Run
    reasked: Wait
    saga: Run
    parent: Run
    failed_child: Run
    holder: Run
    queued: Run
    signal: Run


def live_workers(*, model_load: dict[str, Any] | None = None) -> None:
    """The shop's worker on the default queue and the model worker on MODEL_QUEUE, both heard from just now."""
    for (hostname, pid), queues, load in (
        (SHOP_WORKER, ["celery"], {"slots_busy": 1, "slots": 4}),
        (MODEL_WORKER, [MODEL_QUEUE], model_load or {"slots_busy": 2, "slots": 8}),
    ):
        record_beat(
            worker_beat_name(hostname, pid),
            ProcessHeartbeat.Kind.WORKER,
            hostname=hostname,
            pid=pid,
            queues=queues,
            load=load,
        )


def model_worker_overloaded() -> None:
    """Beat is back; its last two passes found the model queue deeper each time, and the model worker has every
    slot busy with tasks waiting for a database connection."""
    now = clock.now()
    record_sweep({MODEL_QUEUE: 3100, "celery": 2}, measured_at=now)
    record_sweep({MODEL_QUEUE: 4549, "celery": 2}, measured_at=now)
    live_workers(
        model_load={
            "slots_busy": 8,
            "slots": 8,
            "pool": {"size": 8, "max": 8, "available": 0, "waiting": 40, "errors": 0},
        }
    )


def build_world() -> World:
    # Before the engine's clock moves on: a run whose wake-up no worker took, beat's last sweep, and an approval of
    # a 60.00 refund that a manager granted on a fresh observation.
    stuck = api.start("noop", {"steps": 2})
    record_sweep({"celery": 1}, measured_at=clock.now())
    AMOUNTS["WALK-3"] = "60.00"
    replanned = drive(api.start("approval_replan", {"order_id": "WALK-3"}).id)
    api.decide(Wait.objects.get(run=replanned, status=WaitStatus.OPEN).pk, True, by="manager-1", comment="ok, 60")

    # Eleven minutes on: the observation is past its 10-minute budget, and nothing swept since (beat is down).
    clock.advance(timedelta(minutes=11))
    AMOUNTS["WALK-3"] = "5000.00"
    replanned = drive(replanned.id)
    reasked = Wait.objects.get(run=replanned, status=WaitStatus.OPEN)

    saga = _charged_twice("WALK-4")
    api.cancel(saga.id, "customer cancelled", compensate=True, actor="ops-1")
    assert advance(saga.id) is Outcome.COMMITTED, "the first refund of the compensation"

    items = [{"item": 0, "hold": True}, {"item": 1, "fail": True}, {"item": 2, "hold": True}]
    parent = drive(api.start("fan_all", {"items": items}).id)
    for child in Run.objects.filter(parent_id=parent.id).order_by("child_index"):
        drive(child.id)
    parent = drive(parent.id)
    failed_child = Run.objects.get(parent_id=parent.id, status=RunStatus.FAILED)

    holder, _, queued = (api.start("keyed", {"customer": "c-7"}) for _ in range(3))

    api.schedule("nightly-refunds-report", "record", cron="0 3 * * *", input={"steps": 1}, timezone="Europe/Paris")
    api.pause_schedule("nightly-refunds-report")

    signal = drive(api.start("signal_flow", {"order_id": "WALK-8"}).id)
    return World(stuck, replanned, reasked, saga, parent, failed_child, holder, queued, signal)


# --- What each page must say ----------------------------------------------------------------------------------


def short(run: Run) -> str:
    return str(run.pk)[:8]


def run_url(run: Run) -> str:
    return reverse("admin:durable_agents_run_change", args=[run.pk])


@dataclass(frozen=True)
class Visit:
    situation: str
    name: str
    path: str
    check: Callable[[Any, str], list[str]]  # (page, the body's text) -> what is missing or wrong
    # Heartbeats written just before the visit, on a connection of its own (the browser is open).
    before: Callable[[], None] | None = None


def says(text: str, *wanted: str) -> list[str]:
    return [f"does not say {w!r}" for w in wanted if w not in text]


def matches(text: str, *patterns: str) -> list[str]:
    return [f"does not match {p!r}" for p in patterns if not re.search(p, text)]


def never_says(text: str, *unwanted: str) -> list[str]:
    return [f"says {u!r}" for u in unwanted if u in text]


def links(page: Any, text: str, href: str) -> list[str]:
    found = page.locator(f"#content a:has-text('{text}')")
    hrefs = [found.nth(i).get_attribute("href") for i in range(found.count())]
    return [] if href in hrefs else [f"no link {text!r} to {href} (links named so: {hrefs})"]


def says_why_it_asked_again(text: str) -> list[str]:
    """Why the approval was asked again: it was approved, then the observation it rested on went stale before the
    approved step ran, and the run re-read it (an identical-looking request would otherwise puzzle the approver)."""
    return matches(
        " ".join(text.split()),
        r"Asked again: approved by manager-1 at [^,]+, but \S+ \(fresh for [^)]+\) went stale before \S+ ran; "
        r"the run re-read it and asks again\.",
    )


# The modules (by their heading) whose table reaches past the module's right edge.
SPILL = """
[...document.querySelectorAll('#content .module')].flatMap(module => {
    const edge = module.getBoundingClientRect().right + 1;
    const spills = [...module.querySelectorAll('table')].some(t => t.getBoundingClientRect().right > edge);
    return spills ? [(module.querySelector('h2') || module).innerText.trim().slice(0, 30)] : [];
})
"""


def visits(world: World) -> list[Visit]:
    reasked_url = reverse("admin:durable_agents_wait_change", args=[world.reasked.pk])

    def stuck_overview(page: Any, text: str) -> list[str]:
        return matches(
            text,
            r"System health: the sweep has not run for 1[12] min — is celery beat up\? \(\d+ runs? stuck\)",
            r"last sweep 1[12] min ago",
            r"queued wake-ups: unknown \(the sweep's last measurement is 1[12] min old\)",
        )

    def stuck_run(page: Any, text: str) -> list[str]:
        return says(page.locator("#run-status").inner_text(), "pending") + matches(
            page.locator("#stuck-reason").inner_text(),
            r"^runnable but not picked up for 1[12] min\n"
            r"likely cause: the sweep has not run for 1[12] min — is celery beat up\? "
            r"Resume sends its wake-up again\.$",
        )

    def overloaded_overview(page: Any, text: str) -> list[str]:
        return (
            says(
                text,
                f"the worker {MODEL_WORKER[0]} ({MODEL_QUEUE}) is saturated: 8 of 8 slots busy, 40 tasks waiting for a "
                "database connection (pool of 8)",
                f"backlog growing: 4,549 wake-ups on '{MODEL_QUEUE}', up from 3,100 a pass ago",
            )
            + matches(text, r"workers are behind: a runnable run has waited 1[12] min for a worker")
            + never_says(text, "System health: OK")
        )

    def approvals_queue(page: Any, text: str) -> list[str]:
        rows = page.locator("#result_list > tbody > tr")
        if rows.count() != 1:
            return [f"{rows.count()} open waits listed, not the one re-asked approval"]
        row = rows.first.inner_text()
        return says(row, "big_refund", "5000.00", "WALK-3", short(world.replanned), "open") + says_why_it_asked_again(
            row
        )

    def reasked_wait(page: Any, text: str) -> list[str]:
        return says(text, "5000.00", "Approve", "Reject", short(world.replanned)) + says_why_it_asked_again(text)

    def compensating(page: Any, text: str) -> list[str]:
        return says(text, "compensating, will end cancelled")

    def failed_child(page: Any, text: str) -> list[str]:
        row = page.locator("#children tbody tr").filter(has_text=str(world.failed_child.pk))
        status = row.first.inner_text() if row.count() else ""
        return (
            says(text, "ChildRunFailedError", f"child 1 (run {world.failed_child.pk}) failed")
            + says(page.locator("#run-error").inner_text(), f"failed child: {short(world.failed_child)}")
            + links(page, short(world.failed_child), run_url(world.failed_child))
            + (says(status, "failed") if status else ["the failed child is not listed"])
            + links(page, str(world.failed_child.pk), run_url(world.failed_child))
        )

    def queued_behind(page: Any, text: str) -> list[str]:
        return says(text, "its turn on concurrency key 'c-7', held by run", f"{short(world.holder)} (keyed,") + links(
            page, short(world.holder), run_url(world.holder)
        )

    def paused_schedule(page: Any, text: str) -> list[str]:
        row = page.locator("#result_list > tbody > tr").filter(has_text="nightly-refunds-report")
        shown = row.first.inner_text() if row.count() == 1 else ""
        return (says(shown, "paused", "Europe/Paris") + never_says(shown, "✓")) if shown else ["not listed"]

    def deliver_signal(page: Any, text: str) -> list[str]:
        actions = page.locator("#run-actions").inner_text()
        return says(actions, "Deliver signal") + never_says(actions, "Approve") + says(text, "payment.confirmed")

    def signal_form(page: Any, text: str) -> list[str]:
        return says(text, "payment.confirmed") + ([] if page.locator("#confirm").count() else ["no button to deliver"])

    return [
        Visit("1-stuck-beat-down", "overview", "/admin/", stuck_overview, before=live_workers),
        Visit("1-stuck-beat-down", "run", run_url(world.stuck), stuck_run),
        Visit("2-model-worker-overloaded", "overview", "/admin/", overloaded_overview, before=model_worker_overloaded),
        Visit("3-approval-after-stale-observation", "queue", "/admin/durable_agents/wait/", approvals_queue),
        Visit("3-approval-after-stale-observation", "wait", reasked_url, reasked_wait),
        Visit("4-saga-compensating", "run", run_url(world.saga), compensating),
        Visit("5-fan-out-failed-child", "parent", run_url(world.parent), failed_child),
        Visit("6-key-queue", "queued-run", run_url(world.queued), queued_behind),
        Visit("7-paused-schedule", "schedules", "/admin/durable_agents/schedule/", paused_schedule),
        Visit("8-signal-wait", "run", run_url(world.signal), deliver_signal),
        Visit(
            "8-signal-wait",
            "signal-form",
            reverse("admin:durable_agents_run_action", args=[world.signal.pk, "signal"]),
            signal_form,
        ),
    ]


# --- The walk -------------------------------------------------------------------------------------------------


@pytest.fixture
def example_landing_page(settings):
    """The example project's templates (its admin index opens on the overview) and a model worker's queue; the
    amounts the approval read are forgotten afterwards."""
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [PROJECT_TEMPLATES]}]
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "MODEL_QUEUE": MODEL_QUEUE}
    yield
    AMOUNTS.clear()


def test_console_walkthrough__each_situation_says_what_to_fix_without_scrolling_sideways(
    live_server, artifacts, example_landing_page
):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    User.objects.create_superuser("oncall", password="correct horse battery")
    world = build_world()
    assert world.replanned.status == RunStatus.WAITING and "5000.00" in world.reasked.question
    assert Wait.objects.filter(run=world.replanned, kind=WaitKind.APPROVAL).count() == 2, "asked, then asked again"
    assert world.parent.status == RunStatus.FAILED and world.queued.is_queued
    problems: dict[str, list[str]] = {}
    overflowing: dict[str, int] = {}
    base = live_server.url

    with chromium_page() as page:
        sign_in(page, base, "oncall")
        for visit in visits(world):
            if visit.before is not None:
                in_own_thread(visit.before)
            for width in WIDTHS:
                label = f"{visit.situation}-{visit.name}-{width}"
                page.set_viewport_size({"width": width, "height": 900})
                response = page.goto(f"{base}{visit.path}")
                page.screenshot(path=str(artifacts / f"{label}.png"), full_page=True)
                if response is None or response.status != 200 or not response.url.endswith(visit.path):
                    problems[label] = [f"not opened: {response.status if response else None} at {page.url}"]
                    continue
                if wrong := visit.check(page, page.inner_text("body")):
                    problems[label] = wrong
                overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
                if overflow > 0:
                    overflowing[label] = overflow
                # A table wider than its box spills past the box's header without the page scrolling: measured too.
                spill = page.evaluate(SPILL)
                if spill:
                    overflowing[f"{label} ({', '.join(spill)})"] = 1

    assert not problems, "pages that do not say what on-call needs:\n" + "\n".join(
        f"{label}: {'; '.join(wrong)}" for label, wrong in problems.items()
    )
    assert not overflowing, f"pages that scroll sideways (px): {overflowing}"
