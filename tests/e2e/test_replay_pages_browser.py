"""The replay lab's pages in a real browser at a laptop's 1,280 px: a replay's report, one case side by side, the run
list showing replay runs, a replay run's page, and the candidate form of "Replay selected runs…".

Each must say what it is for (lanes, verdict, divergence, "replay · candidate", the banner) without scrolling sideways
and without a table spilling out of its box, however long the model's text; full-page screenshots are artifacts
(DURABLE_TEST_ARTIFACTS), `replay-<page>-1280.png`.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from durable_agents import api
from durable_agents.agents.messages import ModelRequest, text, tool_use
from durable_agents.agents.participants import ScriptedParticipant, participants
from durable_agents.engine.starts import start_run
from durable_agents.models import ReplayRun, RunStatus
from durable_agents.testing import drive
from tests.e2e.test_admin_browser import CHROMIUM, chromium_page, sign_in
from tests.e2e.test_console_walkthrough import SPILL

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WIDTH = 1280
RAMBLE = (
    "I looked the order up and everything is in order, so I am going ahead with the charge as agreed. " * 12
    + "reference:"
    + "x" * 300
)


def billing(amount: str, said: str) -> Any:
    def play(request: ModelRequest) -> list[dict[str, Any]]:
        if request.turn_number == 0:
            return [text("Looking the order up."), tool_use("lookup_order", {"order_id": "A-1"})]
        if request.turn_number == 1:
            return [text(said), tool_use("charge", {"order_id": "A-1", "amount": amount})]
        return [text(f"Order A-1 is charged {amount}.")]

    return play


def test_replay_pages__report_and_side_by_side_fit_1280_px(live_server, artifacts):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `apt-get install -y chromium` (scripts/test installs it)")
    User.objects.create_superuser("oncall", password="correct horse battery")
    with participants.isolated():
        participants.register("billing", ScriptedParticipant(billing("30.00", "Charging now."), name="billing"))
        participants.register("rambler", ScriptedParticipant(billing("31.00", RAMBLE), name="rambler"))
        started = [start_run("agent_charge", {"message": f"Charge A-{i}"}, participant="billing") for i in (1, 2)]
        runs = [drive(run.id) for run in started]
        assert all(r.status == RunStatus.COMPLETED for r in runs)
        made = api.replay(runs=[r.id for r in runs], candidate={"participant": "rambler"}, actor="oncall")
        api.replay_here(made.id)
    link = ReplayRun.objects.filter(replay=made, lane="candidate").first()
    pages = {
        "report": reverse("admin:durable_agents_replay_change", args=[made.pk]),
        "case": reverse("admin:durable_agents_replay_case", args=[made.pk, link.recording_id]),
        "runs": reverse("admin:durable_agents_run_changelist") + "?replay=all",
        "run": reverse("admin:durable_agents_run_change", args=[link.run_id]),
    }
    wanted = {
        "report": ("Lanes against the observed one", "CI verdict", "fails", "Runs that changed most", "All cases"),
        "case": ("observed", "candidate", "baseline", "first divergence", "a call the recording never made"),
        "runs": ("replay · candidate", "replay · baseline", "Real and replay runs"),
        "run": ("Replay run (candidate lane) of replay", "nothing was applied"),
    }
    problems: dict[str, Any] = {}

    with chromium_page() as page:
        sign_in(page, live_server.url, "oncall")
        page.set_viewport_size({"width": WIDTH, "height": 900})
        for name, path in pages.items():
            label = f"replay-{name}-{WIDTH}"
            response = page.goto(f"{live_server.url}{path}")
            page.screenshot(path=str(artifacts / f"{label}.png"), full_page=True)
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

        # The candidate form: two recorded runs chosen in the run list, then "Replay selected runs…".
        page.goto(f"{live_server.url}{reverse('admin:durable_agents_run_changelist')}")
        for run in runs:
            page.check(f"input.action-select[value='{run.pk}']")
        page.select_option("select[name=action]", "replay_selected")
        page.click("button[name=index]")
        page.wait_for_selector("#replay-form")
        label = f"replay-form-{WIDTH}"
        page.screenshot(path=str(artifacts / f"{label}.png"), full_page=True)
        if missing := [
            w
            for w in ("Replay 2 runs", "Nothing is applied", "Participant", "Stubs")
            if w not in page.inner_text("body")
        ]:
            problems[label] = f"does not say {missing}"
        if (
            overflow := page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        ) > 0:
            problems[label] = f"scrolls sideways by {overflow} px"

    assert not problems, f"replay pages that do not fit or do not say what they are for: {problems}"
