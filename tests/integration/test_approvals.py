"""A decision means what the decider saw: an approval authorises exactly the call it showed (issue 13, items 1, 14)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from durable_agents import api, clock
from durable_agents.models import Run, RunStatus, Wait, WaitKind, WaitStatus
from durable_agents.testing import drive
from tests.testapp.models import LedgerEntry
from tests.testapp.trust import AMOUNTS

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _amounts():
    AMOUNTS.clear()
    yield
    AMOUNTS.clear()
    clock.reset()


def _open_wait(run_id) -> Wait:
    return Wait.objects.get(run_id=run_id, status=WaitStatus.OPEN)


def test_approval__a_replan_that_changes_the_amount_asks_again():
    """A manager approves a 60.00 refund; the observation goes stale, the run re-plans and re-reads 5000.00:
    the old approval must not authorise the new call."""
    AMOUNTS["R-9"] = "60.00"
    run = drive(api.start("approval_replan", {"order_id": "R-9"}).id)
    assert run.status == RunStatus.WAITING
    first = _open_wait(run.id)
    assert "60.00" in first.question
    api.decide(first.pk, True, by="manager-1", comment="ok, 60 euros")

    AMOUNTS["R-9"] = "5000.00"
    clock.advance(timedelta(minutes=11))  # the observation is past its 10-minute budget: the run re-plans
    run = drive(run.id)

    assert not LedgerEntry.objects.filter(order_id="R-9").exists(), (
        "the approval of 60.00 authorised a 5000.00 refund: an approval must bind to the arguments it showed"
    )
    assert run.status == RunStatus.WAITING, f"the changed call must ask again, run is {run.status}"
    second = _open_wait(run.id)
    assert second.pk != first.pk and "5000.00" in second.question
    api.decide(second.pk, True, by="manager-1")
    assert drive(run.id).status == RunStatus.COMPLETED
    assert list(LedgerEntry.objects.filter(order_id="R-9").values_list("amount", flat=True)) == [-5000]


def test_approval__the_same_step_calling_with_other_arguments_asks_again():
    """No re-plan: the step re-executes after the approval and computes another amount under the same key."""
    AMOUNTS["R-8"] = "60.00"
    run = drive(api.start("approval_args", {"order_id": "R-8"}).id)
    api.decide(_open_wait(run.id).pk, True, by="manager-1")
    AMOUNTS["R-8"] = "5000.00"
    run = drive(run.id)
    assert not LedgerEntry.objects.filter(order_id="R-8").exists(), "approved 60.00, refunded 5000.00"
    assert run.status == RunStatus.WAITING and "5000.00" in _open_wait(run.id).question


def test_approval__the_approved_call_runs_once_with_exactly_its_arguments():
    AMOUNTS["R-7"] = "60.00"
    run = drive(api.start("approval_args", {"order_id": "R-7"}).id)
    api.decide(_open_wait(run.id).pk, True, by="manager-1")
    assert drive(run.id).status == RunStatus.COMPLETED
    assert list(LedgerEntry.objects.filter(order_id="R-7").values_list("amount", flat=True)) == [-60]


def test_approval__a_rejection_does_not_block_a_replanned_call_for_ever():
    AMOUNTS["R-6"] = "60.00"
    run = drive(api.start("approval_replan", {"order_id": "R-6"}).id)
    api.decide(_open_wait(run.id).pk, False, by="manager-1", comment="not this one")
    run = drive(run.id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ApprovalRejectedError"

    api.resume(run.id, from_step="observe", actor="ops")  # re-plan: observe again, then the refund again
    run = drive(run.id)
    assert run.status == RunStatus.WAITING, "a re-planned call must ask again, not fail on the old rejection"
    assert Wait.objects.filter(run=run, kind=WaitKind.APPROVAL).count() == 2


def test_approval__a_resumed_step_asks_again_after_a_rejection():
    AMOUNTS["R-5"] = "60.00"
    run = drive(api.start("approval_args", {"order_id": "R-5"}).id)
    api.decide(_open_wait(run.id).pk, False, by="manager-1")
    assert drive(run.id).status == RunStatus.FAILED

    api.resume(run.id, actor="ops")
    run = drive(run.id)
    assert run.status == RunStatus.WAITING, "a resumed step must ask again, not fail on the rejection it resumed from"
    rejected = Wait.objects.get(run=run, status=WaitStatus.REJECTED)
    assert rejected.retired, "the rejection stays as history, retired from governing the step"


def test_decide__only_approvals_are_decided_by_people():
    signal_run = drive(api.start("signal_flow", {}).id)
    timer_run = drive(api.start("timer_flow", {}).id)
    for run, hint in ((signal_run, "durable_signal"), (timer_run, "only approvals")):
        wait = _open_wait(run.id)
        with pytest.raises(api.InvalidTransitionError, match=hint):
            api.decide(wait.pk, True, by="approver")
        assert Wait.objects.get(pk=wait.pk).status == WaitStatus.OPEN, f"a {wait.kind} wait was decided by a person"
        assert Run.objects.get(pk=run.id).status == RunStatus.WAITING


def test_decide__a_wait_of_another_run_is_refused():
    first = drive(api.start("approve_charge", {"order_id": "D-1"}).id)
    other = drive(api.start("approve_charge", {"order_id": "D-2"}).id)
    with pytest.raises(api.InvalidTransitionError, match="belongs to run"):
        api.decide(_open_wait(first.id).pk, True, by="approver", run_id=other.id)
    assert _open_wait(first.id).status == WaitStatus.OPEN
