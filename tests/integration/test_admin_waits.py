"""The console's decisions: approve / reject a waiting run, the pending approvals queue, re-plan from a step."""

from __future__ import annotations

import pytest
from django.urls import reverse

from durable_agents import api
from durable_agents.models import Event, RunStatus, Step, Wait, WaitStatus
from durable_agents.testing import drive
from tests.integration.test_admin import action_url, login, page_url
from tests.testapp.models import LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)
WAITS = reverse("admin:durable_agents_wait_changelist")


def waiting_run():
    run = drive(api.start("approve_charge", {"order_id": "AD-1"}).id)
    assert run.status == RunStatus.WAITING
    return run


def test_admin__approve_shows_the_brief_and_wakes_the_run():
    operator = login("operator", codenames=("decide_wait",))
    run = waiting_run()
    page = operator.get(action_url(run, "approve"))
    assert page.status_code == 200 and b"If you approve: the card is charged 40.00" in page.content
    done = operator.post(action_url(run, "approve"), {"comment": "verified"})
    assert done.status_code == 302
    wait = Wait.objects.get(run=run)
    assert (wait.status, wait.decided_by, wait.decision["via"]) == (WaitStatus.APPROVED, "operator", "admin")
    assert drive(run.id).output == {"charged": True} and LedgerEntry.objects.count() == 1


def test_admin__reject_needs_confirmation_and_the_permission():
    viewer = login("viewer")
    run = waiting_run()
    assert viewer.post(action_url(run, "reject"), {"comment": "no"}).status_code == 403
    assert Wait.objects.get(run=run).is_open, "a viewer cannot decide"
    operator = login("operator", codenames=("decide_wait",))
    confirm = operator.get(action_url(run, "reject"))
    assert confirm.status_code == 200 and b"Yes, reject" in confirm.content
    operator.post(action_url(run, "reject"), {"comment": "fraud"})
    assert Wait.objects.get(run=run).status == WaitStatus.REJECTED
    assert Event.objects.get(run=run, kind="wait_decided").actor == "operator"


def test_admin__pending_approvals_queue_sorted_by_deadline_and_decided_in_bulk():
    late = drive(api.start("deadline_reject", {}).id)
    plain = waiting_run()
    operator = login("operator", codenames=("decide_wait",))
    queue = operator.get(WAITS)
    assert queue.status_code == 200
    listed = [w.run_id for w in queue.context["cl"].result_list]
    assert listed == [late.id, plain.id], "waits with a deadline come first"
    response = operator.post(
        WAITS, {"action": "approve_selected", "_selected_action": [str(w.pk) for w in Wait.objects.all()]}
    )
    assert response.status_code == 302
    assert set(Wait.objects.values_list("status", flat=True)) == {WaitStatus.APPROVED}


def test_admin__replan_from_a_step_reruns_it_without_repeating_effects():
    operator = login("operator", codenames=("replan_run",))
    run = drive(api.start("charge", {"order_id": "AD-2"}).id)
    response = operator.post(action_url(run, "replan"), {"step_id": "charge"})
    assert response.status_code == 302
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED and LedgerEntry.objects.count() == 1
    assert Step.objects.filter(run=run, step_id="charge").count() == 2
    assert Event.objects.get(run=run, kind="rerun_from_step").actor == "operator"
    assert operator.get(page_url(run)).status_code == 200
