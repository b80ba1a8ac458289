"""An approval asked again because its run re-planned says why, wherever its approver sees it: the queue, the
wait's page, the run page and the Approve confirmation name the earlier answer and the observation that went
stale; the earlier approval names the request that replaced it, and approving never promises the approve path
when the run is bound to re-read first."""

from __future__ import annotations

import io
import re
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.display import when_text
from durable_agents.models import Event, Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import drive
from tests.integration.test_admin import login
from tests.testapp.trust import AMOUNTS

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _amounts():
    AMOUNTS.clear()
    yield
    AMOUNTS.clear()
    clock.reset()


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def _asked_again() -> tuple[Run, Wait, Wait]:
    """approval_replan: alice approves the refund, the 10-minute observation goes stale before the refund runs,
    and the run re-reads it and asks the same question again."""
    AMOUNTS["Q-1"] = "60.00"
    run = drive(api.start("approval_replan", {"order_id": "Q-1"}).id)
    first = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    api.decide(first.pk, True, by="alice")
    clock.advance(timedelta(minutes=11))
    run = drive(run.id)
    assert run.status == RunStatus.WAITING
    second = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    assert second.pk != first.pk and second.question == first.question, "the same request is asked again"
    return run, Wait.objects.get(pk=first.pk), second


def test_approval_asked_again__the_queue_wait_page_run_page_and_confirmation_say_why():
    run, first, second = _asked_again()
    approver = login("approver", codenames=("decide_wait",))
    why = (
        f"Asked again: approved by alice at {when_text(first.decided_at)}, but observe (fresh for 10 min) went "
        "stale before refund ran; the run re-read it and asks again."
    )
    earlier = reverse("admin:durable_agents_wait_change", args=[first.pk])
    pages = {
        "the approvals queue": reverse("admin:durable_agents_wait_changelist"),
        "the wait's page": reverse("admin:durable_agents_wait_change", args=[second.pk]),
        "the run page": reverse("admin:durable_agents_run_change", args=[run.pk]),
        "the Approve confirmation": reverse("admin:durable_agents_run_action", args=[run.pk, "approve"]),
    }
    for where, url in pages.items():
        html = approver.get(url).content.decode()
        assert why in _text(html), f"{where} does not tell the approver why the request is asked again"
        assert f'href="{earlier}"' in html, f"{where} links no earlier answer to compare with"

    replaced = _text(approver.get(earlier).content.decode())
    assert f"the run re-read it and asked again as wait {second.pk}" in replaced, replaced


def test_approval_asked_again__approving_when_the_observation_is_already_stale_does_not_promise_the_approve_path():
    AMOUNTS["Q-2"] = "60.00"
    run = drive(api.start("approval_replan", {"order_id": "Q-2"}).id)
    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    clock.advance(timedelta(minutes=11))  # the approver answers after the observation went stale
    approver = login("approver", codenames=("decide_wait",))

    confirm = _text(approver.get(reverse("admin:durable_agents_run_action", args=[run.pk, "approve"])).content.decode())
    assert "takes the approve path" not in confirm, confirm
    assert "observe (fresh for 10 min) has gone stale" in confirm, confirm

    page = reverse("admin:durable_agents_wait_change", args=[wait.pk])
    response = approver.post(
        reverse("admin:durable_agents_wait_decide", args=[wait.pk]),
        {"decision": "approve", "args_hash": wait.args_hash, "comment": ""},
        follow=True,
    )
    said = " ".join(str(m) for m in response.context["messages"])
    assert f"Approved wait {wait.pk}" in said and "take the approve path" not in said, said
    assert "observe (fresh for 10 min) has gone stale: the run re-reads it and asks again" in said, said
    assert response.redirect_chain[-1][0] == page


@pytest.mark.parametrize("superseded", [5, "no-such-step-xrefundx", {"refund": True}, None])
def test_asked_again__a_garbled_replan_event_is_no_500_and_no_false_claim(superseded):
    # Events outlive code: a re-plan event whose detail is not a list of step ids (hand-edited, or from another
    # release) must neither break the approvals queue for every approver nor be read as superseding `refund`.
    run, _, _ = _asked_again()
    Event.objects.filter(run=run, kind="replanned").update(detail={"superseded": superseded}, step_id="other")
    approver = login("approver", codenames=("decide_wait",))

    queue = approver.get(reverse("admin:durable_agents_wait_changelist"))
    page = approver.get(reverse("admin:durable_agents_run_change", args=[run.pk]))

    assert queue.status_code == 200 and page.status_code == 200
    assert "Asked again" not in _text(queue.content.decode()), "a re-plan of another step read as this one's"


def test_durable_show__says_which_approval_was_asked_again_and_why():
    run, earlier, later = _asked_again()
    out = io.StringIO()

    call_command("durable_show", str(run.pk), stdout=out)
    shown = {line.split(":", 1)[0]: line for line in out.getvalue().splitlines() if line.startswith("wait ")}

    assert "Asked again: approved by alice" in shown[f"wait {later.pk}"], shown
    assert "went stale before refund ran" in shown[f"wait {later.pk}"], shown
    assert f"asked again as wait {later.pk}" in shown[f"wait {earlier.pk}"], shown


def test_asked_again__an_observation_named_by_no_string_reads_as_an_observation():
    run, earlier, later = _asked_again()
    Event.objects.filter(run=run, kind="replanned").update(detail={"superseded": ["refund"], "observation": ["x"]})
    out = io.StringIO()

    call_command("durable_show", str(run.pk), stdout=out)

    waits = [line for line in out.getvalue().splitlines() if line.startswith("wait ")]
    assert any("but an observation went stale before refund ran" in line for line in waits), waits
    assert not any("['x']" in line for line in waits), waits
