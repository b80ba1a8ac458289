"""Child runs: fan-out steps that start child runs, park holding no worker, and are woken by their join."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db.models import Count
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from durable_agents import api, clock
from durable_agents.engine import family
from durable_agents.engine.sweep import sweep
from durable_agents.errors import InvalidTransitionError, PermanentError
from durable_agents.models import Event, Run, RunStatus, Step, Wait, WaitKind, WaitStatus
from durable_agents.signals import run_finished
from durable_agents.testing import drive, wait_for, wait_for_run
from tests.integration.test_admin import login
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def family_hooks_lost() -> Iterator[None]:
    """Runs that finish inside the block never tell their family (as if each process died right after its commit):
    what the family hook would have done is left to the sweep, or to a later hook."""
    uid = "durable_agents.engine.family"
    run_finished.disconnect(dispatch_uid=uid)
    try:
        yield
    finally:
        run_finished.connect(family._on_run_finished, dispatch_uid=uid)


def _children(run: Run) -> list[Run]:
    return list(Run.objects.filter(parent_id=run.id).order_by("child_index"))


def _drive_children(run: Run, *, only: list[int] | None = None) -> None:
    for child in _children(run):
        if only is None or child.child_index in only:
            drive(child.id)


def test_children__all_gathers_results_in_index_order_and_holds_no_worker():
    run = api.start("fan_all", {"items": [{"item": i} for i in range(4)]})
    parked = drive(run.id)
    assert parked.status == RunStatus.WAITING and parked.lease_owner == "", "the parent waits holding no lease"
    kids = _children(run)
    assert [k.child_index for k in kids] == [0, 1, 2, 3] and all(k.parent_step == "fan" for k in kids)
    wait = Wait.objects.get(run=run, kind=WaitKind.CHILDREN)
    assert wait.status == WaitStatus.OPEN
    # Finish them out of order: the parent is woken only once all are done.
    for index in (2, 0, 3):
        drive(kids[index].id)
        assert Run.objects.get(pk=run.id).status == RunStatus.WAITING, "woken before its join was met"
    drive(kids[1].id)
    assert Run.objects.get(pk=run.id).status == RunStatus.PENDING, "the last child's end wakes the parent"
    done = drive(run.id)
    assert done.status == RunStatus.COMPLETED
    result = Step.objects.get(run=run, step_id="fan").result
    assert [c["output"]["double"] for c in result["children"]] == [0, 2, 4, 6], "results in index order"
    assert result["completed"] == 4 and result["joined"] is True
    assert Event.objects.filter(run=run, kind="children_joined").count() == 1


def test_children__re_executed_step_never_starts_duplicates():
    run = api.start("fan_collect", {"items": [{"item": i} for i in range(3)]})
    drive(run.id)
    parent = Run.objects.get(pk=run.id)
    step = Step.objects.get(run=run, step_id="fan")
    # A re-execution (the step ran again after a crash) finds the children by their key.
    assert family.spawn(parent, step, "child_work", [{"item": i} for i in range(3)]) == 0
    assert family.spawn(parent, step, "child_work", [{"item": i} for i in range(4)]) == 0, "a list that grew"
    assert Run.objects.filter(parent_id=run.id).count() == 3


def test_children__a_list_that_changed_in_front_never_pairs_old_children_with_new_items():
    # A rerun from the step making the list saw [A, B] become [C, A, B]: found again by index, B's child would stand
    # for A and A's for C — B charged twice once C's child ran, C never. Refused, and nothing is started.
    run = api.start("fan_collect", {"items": [{"item": 1, "order_id": "A"}, {"item": 2, "order_id": "B"}]})
    drive(run.id)
    parent = Run.objects.get(pk=run.id)
    step = Step.objects.get(run=run, step_id="fan")
    changed = [{"item": 3, "order_id": "C"}, {"item": 1, "order_id": "A"}, {"item": 2, "order_id": "B"}]
    with pytest.raises(PermanentError, match="changed since its children started: child 0"):
        family.spawn(parent, step, "child_work", changed)
    with pytest.raises(PermanentError, match="shorter now"):
        family.spawn(parent, step, "child_work", [{"item": 1, "order_id": "A"}])
    assert Run.objects.filter(parent_id=run.id).count() == 2, "no child was started for the changed list"


def test_children__a_list_that_keeps_growing_is_taken_as_it_was_when_the_children_started():
    # `each` is a live query that has one more item every time it is read: woken by its children, the step reads it
    # again. Starting the newcomers each time, the parent would wait for ever; the list is the one its children
    # were started from, and what came later is recorded, not started.
    run = api.start("fan_growing", {})
    assert drive(run.id).status == RunStatus.WAITING
    _drive_children(run)
    assert drive(run.id).status == RunStatus.COMPLETED
    assert Run.objects.filter(parent_id=run.id).count() == 1
    assert Step.objects.get(run=run, step_id="fan").result["completed"] == 1
    (grew,) = Event.objects.filter(run=run, kind="children_list_grew")
    assert grew.detail["started"] == 1 and grew.detail["not_started"] == 1


def test_fork__at_the_fan_out_step_with_the_same_input_reuses_what_the_childrens_effects_applied():
    # The fork shares its source's effect keys (same input); its fan-out starts new child runs, which share the keys
    # of the source's children with the same index and input: no order is charged twice.
    run = api.start("fan_all", {"items": [{"item": i, "order_id": f"fork-{i}"} for i in range(2)]})
    drive(run.id)
    _drive_children(run)
    assert drive(run.id).status == RunStatus.COMPLETED
    fork = api.fork(run.id, "fan", actor="ops")
    drive(fork.id)
    _drive_children(fork)
    assert drive(fork.id).status == RunStatus.COMPLETED
    charges = LedgerEntry.objects.filter(kind="charge").values("order_id").annotate(n=Count("id"))
    assert {c["order_id"]: c["n"] for c in charges} == {"fork-0": 1, "fork-1": 1}, "a fork charged the orders again"
    assert Run.objects.filter(parent_id=fork.id).count() == 2, "the fork has children of its own"
    # With new input the fork is new work: its children apply their own effects.
    other = api.fork(run.id, "fan", input={"items": [{"item": 0, "order_id": "fork-new"}]})
    drive(other.id)
    _drive_children(other)
    assert LedgerEntry.objects.filter(kind="charge", order_id="fork-new").count() == 1


def test_fork__at_a_fan_out_whose_live_list_gained_an_item_in_front_charges_no_order_twice(isolated_registries):
    from durable_agents.api import children, workflow

    live = {"orders": ["A", "B"]}  # what a live query (a customer's open orders) returns now
    workflow(
        "fan_live",
        steps=[
            children(
                "fan",
                workflow="child_work",
                each=lambda ctx: [{"item": 0, "order_id": order} for order in live["orders"]],
            )
        ],
    )
    run = api.start("fan_live", {})
    drive(run.id)
    _drive_children(run)
    assert drive(run.id).status == RunStatus.COMPLETED
    live["orders"] = ["N", "A", "B"]
    fork = api.fork(run.id, "fan", actor="ops")  # the same input: it shares the source's effect keys
    drive(fork.id)
    _drive_children(fork)
    assert drive(fork.id).status == RunStatus.COMPLETED
    charges = LedgerEntry.objects.filter(kind="charge").values("order_id").annotate(n=Count("id"))
    assert {c["order_id"]: c["n"] for c in charges} == {"A": 1, "B": 1, "N": 1}


def test_children__fail_fast_cancels_the_rest_and_fails_the_step():
    items = [{"item": 0, "hold": True}, {"item": 1, "fail": True}, {"item": 2, "hold": True}]
    run = api.start("fan_all", {"items": items})
    drive(run.id)
    kids = _children(run)
    _drive_children(run)  # 0 and 2 wait for their signal; 1 fails
    assert Run.objects.get(pk=run.id).status == RunStatus.PENDING, "a failed child wakes a fail-fast parent"
    failed = drive(run.id)
    assert failed.status == RunStatus.FAILED
    assert failed.error["type"] == "ChildRunFailedError" and "child 1" in failed.error["message"]
    statuses = {k.child_index: Run.objects.get(pk=k.id).status for k in kids}
    assert statuses == {0: RunStatus.CANCELLED, 1: RunStatus.FAILED, 2: RunStatus.CANCELLED}


def test_children__collect_reports_every_outcome():
    items = [{"item": 0}, {"item": 1, "fail": True}, {"item": 2}]
    run = api.start("fan_collect", {"items": items})
    drive(run.id)
    _drive_children(run, only=[1])
    assert Run.objects.get(pk=run.id).status == RunStatus.WAITING, "collect waits for every child"
    _drive_children(run, only=[0, 2])
    assert drive(run.id).status == RunStatus.COMPLETED
    result = Step.objects.get(run=run, step_id="fan").result
    assert [c["status"] for c in result["children"]] == ["completed", "failed", "completed"]
    assert result["children"][1]["error"]["type"] == "PermanentError"
    assert (result["completed"], result["failed"], result["joined"]) == (2, 1, False), "not all completed"


def test_children__any_and_first_k_cancel_the_rest_once_met():
    run = api.start("fan_any", {"items": [{"item": 0, "hold": True}, {"item": 1}, {"item": 2, "hold": True}]})
    drive(run.id)
    _drive_children(run)
    assert drive(run.id).status == RunStatus.COMPLETED
    result = Step.objects.get(run=run, step_id="fan").result
    assert [c["status"] for c in result["children"]] == ["cancelled", "completed", "cancelled"]

    run = api.start("fan_two", {"items": [{"item": i, "hold": i == 0} for i in range(4)]})
    drive(run.id)
    kids = _children(run)
    drive(kids[1].id)
    assert Run.objects.get(pk=run.id).status == RunStatus.WAITING, "one of two is not enough"
    drive(kids[3].id)
    assert drive(run.id).status == RunStatus.COMPLETED
    result = Step.objects.get(run=run, step_id="fan").result
    assert result["completed"] == 2 and result["joined"] is True
    assert {Run.objects.get(pk=k.id).status for k in (kids[0], kids[2])} == {RunStatus.CANCELLED}


def test_children__collect_waits_for_every_outcome_when_k_cannot_be_met():
    run = api.start("fan_two", {"items": [{"item": 0, "fail": True}, {"item": 1, "fail": True}, {"item": 2}]})
    drive(run.id)
    _drive_children(run, only=[0, 1])
    assert Run.objects.get(pk=run.id).status == RunStatus.WAITING, "collecting, the last outcome is waited for"
    _drive_children(run, only=[2])
    assert drive(run.id).status == RunStatus.COMPLETED
    result = Step.objects.get(run=run, step_id="fan").result
    assert (result["completed"], result["failed"], result["joined"]) == (1, 2, False)


def test_children__single_child_and_empty_list():
    run = api.start("fan_one")
    drive(run.id)
    _drive_children(run)
    assert drive(run.id).status == RunStatus.COMPLETED
    assert Step.objects.get(run=run, step_id="fan").result["children"][0]["output"] == {"item": 7, "double": 14}
    empty = api.start("fan_all", {"items": []})
    assert drive(empty.id).status == RunStatus.COMPLETED, "nothing to wait for"


def test_children__bad_child_input_fails_the_step_clearly():
    run = api.start("fan_bad")
    failed = drive(run.id)
    assert failed.status == RunStatus.FAILED and "child 1" in failed.error["message"]
    assert not Run.objects.filter(parent_id=run.id).exists(), "no child of a bad list is started"


def test_cancel__parent_cancels_its_children_with_compensation():
    items = [{"item": i, "order_id": f"child-{i}", "hold": True} for i in range(3)]
    run = api.start("fan_all", {"items": items})
    drive(run.id)
    _drive_children(run)  # each charged, then waits for its signal
    assert LedgerEntry.objects.filter(kind="charge").count() == 3
    api.cancel(run.id, "no longer needed", compensate=True, actor="ops")
    for kid in _children(run):
        kid = drive(kid.id)  # its compensation step runs
        assert kid.status == RunStatus.CANCELLED, f"child {kid.child_index} is {kid.status}"
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert LedgerEntry.objects.filter(kind="refund").count() == 3, "each child's charge was undone once"


def _charged_children_of_a_parent_without_effects() -> Run:
    items = [{"item": i, "order_id": f"child-{i}", "hold": True} for i in range(2)]
    run = api.start("fan_all", {"items": items})
    drive(run.id)
    _drive_children(run)  # each charged, then waits for its signal; the parent itself applied nothing
    assert LedgerEntry.objects.filter(kind="charge").count() == 2
    return run


def test_cancel__a_compensating_cancel_whose_operator_died_is_finished_by_the_sweep_with_compensation():
    # The parent's cancel commits, then the operator's process dies before it reaches the children (its
    # `run_finished` receiver never runs): the sweep's orphan pass must cancel them as asked - undoing their charges.
    from durable_agents.engine.runs import cancel_run

    run = _charged_children_of_a_parent_without_effects()
    with family_hooks_lost():
        cancel_run(run.id, reason="no longer needed", actor="ops", compensate=True)
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert sweep().orphans_cancelled == 2
    for kid in _children(run):
        assert drive(kid.id).status == RunStatus.CANCELLED
    assert LedgerEntry.objects.filter(kind="refund").count() == 2, "each child's charge undone, as the cancel asked"


def test_cancel__the_finished_run_cascade_compensates_children_of_a_parent_with_nothing_of_its_own_to_undo():
    from durable_agents.engine.runs import cancel_run

    run = _charged_children_of_a_parent_without_effects()
    cancel_run(run.id, reason="no longer needed", actor="ops", compensate=True)  # the cascade, not cancel_family
    for kid in _children(run):
        assert drive(kid.id).status == RunStatus.CANCELLED
    assert LedgerEntry.objects.filter(kind="refund").count() == 2, "the cascade kept the compensation asked for"
    with pytest.raises(Exception, match="compensat"):
        api.resume(run.id)  # the family's effects were undone: no resume into that world (fork instead)


# --- A family's saga: children that had already ended undo what they did too ----------------------------------


def _refunds_per_charge() -> dict[str, int]:
    charged = set(LedgerEntry.objects.filter(kind="charge").values_list("order_id", flat=True))
    refunds = LedgerEntry.objects.filter(kind="refund").values("order_id").annotate(n=Count("id"))
    return {order: next((r["n"] for r in refunds if r["order_id"] == order), 0) for order in charged}


def _drive_family(run: Run) -> None:
    for kid in _children(run):
        if Run.objects.get(pk=kid.id).status in (RunStatus.PENDING, RunStatus.RUNNING):
            drive(kid.id)


def test_cancel__compensating_a_parent_undoes_its_finished_childrens_effects_too():
    items = [{"item": 0, "order_id": "done-0"}, {"item": 1, "order_id": "done-1"}, {"item": 2, "order_id": "live-2"}]
    items[2]["hold"] = True
    run = api.start("fan_all", {"items": items})
    drive(run.id)
    _drive_children(run)  # 0 and 1 complete; 2 is charged and waits for its signal
    assert [k.status for k in _children(run)] == [RunStatus.COMPLETED, RunStatus.COMPLETED, RunStatus.WAITING]
    api.cancel(run.id, "the whole batch was a mistake", compensate=True, actor="ops")
    _drive_family(run)
    assert _refunds_per_charge() == {"done-0": 1, "done-1": 1, "live-2": 1}, "every charge of the family undone once"
    assert {(k.status, k.finish_as) for k in _children(run)} == {(RunStatus.CANCELLED, RunStatus.CANCELLED)}
    assert Event.objects.filter(run__parent_id=run.id, kind="family_compensation").count() == 2
    with override_settings(DURABLE_AGENTS={"IDLE_RESWEEP_SECONDS": 0.001}):
        sweep()
    assert _refunds_per_charge() == {"done-0": 1, "done-1": 1, "live-2": 1}, "a sweep undoes nothing twice"
    assert not Run.objects.get(pk=run.id).family_undo, "the family's saga is over: the sweep lets go of the parent"
    with pytest.raises(InvalidTransitionError, match="compensated"):
        api.resume(run.id)  # nor its family: their effects were undone (fork it to do the work anew)


def test_cancel__a_child_completing_after_its_parents_compensating_cancel_undoes_what_it_did():
    from durable_agents.engine.runs import cancel_run

    run = api.start("fan_all", {"items": [{"item": 0, "order_id": "late-0", "hold": True}]})
    drive(run.id)
    _drive_children(run)
    (kid,) = _children(run)
    # The parent's cancel commits; the operator's process dies before it reaches the child, which completes.
    with family_hooks_lost():
        cancel_run(run.id, reason="stop", compensate=True)
    api.send_signal(kid.id, "go", {})
    drive(kid.id)  # it completes: its end finds its family's saga and undoes its charge
    assert drive(kid.id).status == RunStatus.CANCELLED
    assert _refunds_per_charge() == {"late-0": 1}


def test_sweep__undoes_a_finished_childs_effects_when_every_hook_was_lost():
    from durable_agents.engine.runs import cancel_run

    run = api.start("fan_all", {"items": [{"item": 0, "order_id": "lost-0", "hold": True}]})
    drive(run.id)
    _drive_children(run)
    (kid,) = _children(run)
    with family_hooks_lost():
        cancel_run(run.id, reason="stop", compensate=True)
        api.send_signal(kid.id, "go", {})
        assert drive(kid.id).status == RunStatus.COMPLETED  # and its hook is lost too
    assert _refunds_per_charge() == {"lost-0": 0}
    with override_settings(DURABLE_AGENTS={"IDLE_RESWEEP_SECONDS": 0.001}):
        assert sweep().family_undone == 1
    assert drive(kid.id).status == RunStatus.CANCELLED
    assert _refunds_per_charge() == {"lost-0": 1}
    with override_settings(DURABLE_AGENTS={"IDLE_RESWEEP_SECONDS": 0.001}):
        sweep()
    assert not Run.objects.get(pk=run.id).family_undo


def test_on_failure__a_compensating_parent_that_fails_undoes_its_completed_childrens_effects():
    items = [{"item": 0, "order_id": "ok-0"}, {"item": 1, "fail": True}]
    run = api.start("fan_all_compensating", {"items": items})
    drive(run.id)
    _drive_children(run)  # 0 charges and completes; 1 fails: the fail-fast parent is woken
    failed = drive(run.id)
    assert failed.status == RunStatus.FAILED and failed.error["type"] == "ChildRunFailedError"
    _drive_family(run)
    assert _refunds_per_charge() == {"ok-0": 1}, "the failed family's completed charge was undone"


def test_resume__a_childs_undo_that_stopped_finishes_under_its_cancelled_parent(monkeypatch):
    # A completed child's undo stops on a refund the provider refuses today. Its own saga must be finishable once the
    # provider is back, although its parent is cancelled (only a child resumed forward would escape that cancel).
    run = api.start("fan_all", {"items": [{"item": 0, "order_id": "stuck-0"}, {"item": 1, "hold": True}]})
    drive(run.id)
    _drive_children(run)
    first = _children(run)[0]
    real = LedgerEntry.objects.create
    refusing = {"now": True}

    def create(**row):
        if row.get("kind") == "refund" and refusing["now"]:
            raise PermanentError("the payment provider refuses refunds today")
        return real(**row)

    monkeypatch.setattr(LedgerEntry.objects, "create", create)
    api.cancel(run.id, "undo the batch", compensate=True)
    stopped = drive(first.id)
    assert (stopped.status, stopped.finish_as) == (RunStatus.FAILED, RunStatus.CANCELLED), "the saga stopped visibly"
    refusing["now"] = False
    api.resume(first.id, actor="ops")
    assert drive(first.id).status == RunStatus.CANCELLED
    assert _refunds_per_charge() == {"stuck-0": 1}


def test_children__a_worker_paused_past_its_lease_starts_no_child():
    # The fan-out's worker proved its lease, then stalled past it; the parent was cancelled with compensation (and
    # swept). Started now, its children would escape that cancel and keep their charges: nothing is started.
    from durable_agents.errors import LeaseLostError
    from durable_agents.testing.runs import take_lease

    items = [{"item": 0, "order_id": "z-0"}]
    run = api.start("fan_all", {"items": items})
    claim = take_lease(run.id)
    Run.objects.filter(pk=run.id).update(lease_expires_at=clock.now() - timedelta(seconds=1))
    api.cancel(run.id, "undo it all", compensate=True, actor="ops")
    sweep()
    step = Step.objects.live().get(run_id=run.id, step_id="fan")
    with pytest.raises(LeaseLostError):
        family.spawn(Run.objects.get(pk=run.id), step, "child_work", items, lease_token=claim.token)
    assert not Run.objects.filter(parent_id=run.id).exists()


def test_fork__after_the_fan_out_keeps_the_childrens_charges_its_sources_family_saga_would_undo(monkeypatch):
    # The fork copies the fan-out's checkpoint (two children charged) and goes on; the source is then cancelled with
    # compensation. The fork stands on those charges: the source's family keeps them for it.
    from durable_agents.engine.advance import advance
    from durable_agents.errors import RetryableError
    from tests.testapp.models import Execution

    real = Execution.objects.create
    failed = {"after": 0}

    def create(**row):
        if row.get("step_id") == "after" and not failed["after"]:
            failed["after"] += 1
            raise RetryableError("the ledger is busy, try again")
        return real(**row)

    monkeypatch.setattr(Execution.objects, "create", create)
    run = api.start("fan_all", {"items": [{"item": 0, "order_id": "f-0"}, {"item": 1, "order_id": "f-1"}]})
    drive(run.id)
    _drive_children(run)
    while not failed["after"]:
        advance(run.id)  # the source is woken, gathers, and its "after" step fails once: it is still live
    fork = api.fork(run.id, "after", actor="ops")
    api.cancel(run.id, "undo the source", compensate=True, actor="ops")
    _drive_family(run)
    assert drive(fork.id).status == RunStatus.COMPLETED
    assert _refunds_per_charge() == {"f-0": 0, "f-1": 0}, "the fork's copied checkpoint stands on both charges"


def test_sweep__a_family_that_cannot_let_go_yet_never_holds_up_the_others():
    # Two owed families whose children cannot end yet (held), then one whose child's end hook was lost: with a batch
    # of two, each pass re-checks the oldest; a family checked goes to the back, so the third is reached.
    from durable_agents.engine.runs import cancel_run

    waiting = []
    for n in range(2):
        stuck = api.start("fan_all", {"items": [{"item": 0, "order_id": f"s-{n}", "hold": True}]})
        drive(stuck.id)
        _drive_children(stuck)
        api.cancel(stuck.id, "undo", compensate=True)  # its child is cancelled with compensation: it must run
        waiting.append(stuck)
    victim = api.start("fan_all", {"items": [{"item": 0, "order_id": "v-0", "hold": True}]})
    drive(victim.id)
    _drive_children(victim)
    (kid,) = _children(victim)
    with family_hooks_lost():
        cancel_run(victim.id, reason="undo", compensate=True)
        api.send_signal(kid.id, "go", {})
        assert drive(kid.id).status == RunStatus.COMPLETED
    with override_settings(DURABLE_AGENTS={"IDLE_RESWEEP_SECONDS": 0.001, "SWEEP_BATCH": 2}):
        for _ in range(3):
            sweep()
    assert drive(kid.id).status == RunStatus.CANCELLED
    assert _refunds_per_charge()["v-0"] == 1


def test_cancel__plain_cancel_of_a_parent_cancels_grandchildren_too():
    inner = [{"item": 0, "hold": True}]
    run = api.start("fan_nested", {"items": [{"items": inner}, {"items": inner}]})
    drive(run.id)
    _drive_children(run)  # each child fans out in turn, and waits
    grandchildren = Run.objects.filter(parent__parent_id=run.id)
    assert grandchildren.count() == 2
    api.cancel(run.id, "stop")
    statuses = set(
        Run.objects.filter(
            pk__in=[run.id, *Run.objects.filter(parent_id=run.id).values_list("id", flat=True)]
        ).values_list("status", flat=True)
    )
    assert statuses == {RunStatus.CANCELLED}
    assert set(grandchildren.values_list("status", flat=True)) == {RunStatus.CANCELLED}
    assert Event.objects.filter(run__parent_id=run.id, kind="cancelled", actor=f"parent:{run.id}").count() == 2


def test_resume__a_cancelled_parent_resumes_the_children_cancelled_with_it_and_the_sweep_leaves_them():
    items = [{"item": i, "hold": True} for i in range(2)]
    run = api.start("fan_all", {"items": items})
    drive(run.id)
    _drive_children(run)  # both wait for their signal
    api.cancel(run.id, "by mistake")
    assert {k.status for k in _children(run)} == {RunStatus.CANCELLED}
    resumed = api.resume(run.id, actor="ops")
    assert resumed.status == RunStatus.PENDING
    assert {k.status for k in _children(run)} == {RunStatus.PENDING}, "its children were resumed with it"
    assert sweep().orphans_cancelled == 0
    assert drive(run.id).status == RunStatus.WAITING, "the fan-out waits for its resumed children again"
    for kid in _children(run):
        drive(kid.id)
        api.send_signal(kid.id, "go", {})
        assert drive(kid.id).status == RunStatus.COMPLETED
    assert drive(run.id).status == RunStatus.COMPLETED
    assert Step.objects.get(run=run, step_id="fan").result["completed"] == 2


def test_resume__a_childs_cancel_still_requested_is_withdrawn_so_the_family_comes_back_whole():
    # A worker is running child 0's step when the parent is cancelled: the child's cancel is only requested. The
    # operator resumes the parent at once. Settled later, that request would cancel child 0 under a live parent,
    # and the parent's fail-fast join would fail: the resume takes the request back.
    from durable_agents.engine.runs import settle_cancellation
    from durable_agents.testing.runs import take_lease

    run = api.start("fan_all", {"items": [{"item": 0}, {"item": 1, "hold": True}]})
    drive(run.id)
    first, second = _children(run)
    assert take_lease(first.id) is not None  # a worker mid-step
    api.cancel(run.id, "by mistake")
    assert Run.objects.get(pk=first.id).cancel_requested_at is not None
    api.resume(run.id, actor="ops")
    first = Run.objects.get(pk=first.id)
    assert (first.status, first.cancel_requested_at) == (RunStatus.RUNNING, None), "the request was taken back"
    assert Event.objects.filter(run_id=first.id, kind="cancel_withdrawn", actor="ops").count() == 1
    clock.advance(timedelta(minutes=10))  # that worker's lease lapses (it died); another takes the child over
    assert settle_cancellation(first.id).value == "", "nothing is left to settle"
    assert drive(first.id).status == RunStatus.COMPLETED
    drive(second.id)
    api.send_signal(second.id, "go", {})
    assert drive(second.id).status == RunStatus.COMPLETED
    assert drive(run.id).status == RunStatus.COMPLETED


def test_resume__a_resume_in_the_gap_of_a_cancel_keeps_its_children(monkeypatch):
    # Operator A's cancel commits the parent's; operator B resumes the parent before A reaches the children. A must
    # not then cancel the children of a parent that is live again.
    run = api.start("fan_all", {"items": [{"item": i, "hold": True} for i in range(2)]})
    drive(run.id)
    _drive_children(run)
    real = family.cancel_run

    def cancel_then_another_operator_resumes(run_id, **kwargs):
        cancelled = real(run_id, **kwargs)
        if str(run_id) == str(run.id):
            api.resume(run.id, actor="operator-b")
        return cancelled

    monkeypatch.setattr(family, "cancel_run", cancel_then_another_operator_resumes)
    api.cancel(run.id, "operator a")
    assert Run.objects.get(pk=run.id).status == RunStatus.PENDING
    assert {k.status for k in _children(run)} == {RunStatus.WAITING}, "the resumed parent's children were cancelled"


def test_rerun__a_cancelled_parent_rerun_from_its_fan_out_brings_its_children_back():
    run = api.start("fan_all", {"items": [{"item": i, "hold": True} for i in range(2)]})
    drive(run.id)
    _drive_children(run)
    api.cancel(run.id, "stop")
    api.resume(run.id, from_step="fan", actor="ops")
    assert {k.status for k in _children(run)} == {RunStatus.PENDING}
    assert drive(run.id).status == RunStatus.WAITING, "the fan-out waits for its children again"


def test_resolve_effect__a_child_under_a_cancelled_parent_is_recorded_not_resumed():
    from durable_agents.models import Effect

    run = api.start("fan_collect", {"items": [{"item": 0, "fail": True}, {"item": 1, "hold": True}]})
    drive(run.id)
    failed, _held = _children(run)
    assert drive(failed.id).status == RunStatus.FAILED
    api.cancel(run.id, "stop")
    key = f"{failed.id}:ext"
    Effect.objects.create(run_id=failed.id, idempotency_key=key, tool="ship", args_hash="h", needs_attention="unknown")
    effect = api.resolve_effect(key, False, actor="ops", reason="not shipped")
    assert effect.status == "failed", "the outcome is recorded"
    assert Run.objects.get(pk=failed.id).status == RunStatus.FAILED, "resumed under its cancelled parent"


def test_resume__a_child_under_a_cancelled_parent_is_refused_with_what_to_do_instead():
    run = api.start("fan_all", {"items": [{"item": 0, "hold": True}]})
    drive(run.id)
    api.cancel(run.id, "stop")
    (kid,) = _children(run)
    with pytest.raises(InvalidTransitionError, match=f"its parent run {run.id} is cancelled: resume the parent"):
        api.resume(kid.id)
    assert Run.objects.get(pk=kid.id).status == RunStatus.CANCELLED, "nothing the orphan pass would undo"


def test_resume__children_cancelled_otherwise_stay_as_they_are():
    # A child an operator cancelled on its own (before its parent was) is not the parent's to bring back.
    run = api.start("fan_collect", {"items": [{"item": 0, "hold": True}, {"item": 1, "hold": True}]})
    drive(run.id)
    first, second = _children(run)
    api.cancel(first.id, "this one is not wanted")
    api.cancel(run.id, "stop")
    api.resume(run.id)
    assert Run.objects.get(pk=first.id).status == RunStatus.CANCELLED
    assert Run.objects.get(pk=second.id).status == RunStatus.PENDING


def test_sweep__finds_a_lost_wake_up_and_cancels_orphans():
    run = api.start("fan_all", {"items": [{"item": 0}]})
    drive(run.id)
    with family_hooks_lost():
        _drive_children(run)  # the child's wake-up is lost (as if its worker died right after its commit)
    assert Run.objects.get(pk=run.id).status == RunStatus.WAITING
    with override_settings(DURABLE_AGENTS={"IDLE_RESWEEP_SECONDS": 0}):
        report = sweep()
    assert report.joined == 1 and Run.objects.get(pk=run.id).status == RunStatus.PENDING
    assert drive(run.id).status == RunStatus.COMPLETED


def test_sweep__an_open_join_not_met_is_rechecked_once_per_idle_period():
    run = api.start("fan_all", {"items": [{"item": 0, "hold": True}]})
    drive(run.id)
    wait = Wait.objects.get(run=run, kind=WaitKind.CHILDREN)
    Wait.objects.filter(pk=wait.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    assert sweep().joined == 0
    checked = Wait.objects.get(pk=wait.pk).updated_at
    assert checked > timezone.now() - timedelta(minutes=1), "a checked join is not checked again at once"
    assert Wait.objects.get(pk=wait.pk).status == WaitStatus.OPEN


# --- The admin and the CLI ----------------------------------------------------------------------------


def test_admin__run_page_links_parent_and_children():
    run = api.start("fan_collect", {"items": [{"item": 0}, {"item": 1, "fail": True}]})
    drive(run.id)
    kids = _children(run)
    _drive_children(run)
    operator = login("operator")
    parent_page = operator.get(reverse("admin:durable_agents_run_change", args=[run.pk])).content.decode()
    assert "2 child runs: completed 1, failed 1" in " ".join(parent_page.split())
    assert ">joined</span>" in parent_page and ">approved</span>" not in parent_page, "a join is no approval"
    for kid in kids:
        assert reverse("admin:durable_agents_run_change", args=[kid.pk]) in parent_page, "each child is linked"
    child_page = operator.get(reverse("admin:durable_agents_run_change", args=[kids[1].pk])).content.decode()
    assert 'id="parent-run"' in child_page and reverse("admin:durable_agents_run_change", args=[run.pk]) in child_page


def test_cli__show_prints_parent_and_children_and_runs_lists_children(capsys):
    run = api.start("fan_all", {"items": [{"item": 0}, {"item": 1}]})
    drive(run.id)
    kids = _children(run)
    call_command("durable_show", str(run.id))
    shown = capsys.readouterr().out
    assert "children: 2 (pending 2)" in shown and all(str(k.id) in shown for k in kids)
    call_command("durable_show", str(kids[0].id))
    assert f"parent: run {run.id} (step fan, child 0)" in capsys.readouterr().out
    call_command("durable_runs", "--parent", str(run.id)[:8], "--json")
    listed = json.loads(capsys.readouterr().out)
    assert sorted(row["id"] for row in listed) == sorted(str(k.id) for k in kids)


# --- Real workers ----------------------------------------------------------------------------------------


def test_sigkill__during_fan_out_no_duplicate_child_no_duplicate_effect(start_worker):
    """SIGKILL the parent's worker after it started its children and before it parked, then again after it
    gathered their results and before its checkpoint: no child is started twice, no charge lands twice."""
    count = 20
    workers = [start_worker(beat=True), start_worker()]
    items = [{"item": i, "order_id": f"child-{i}"} for i in range(count)]
    run = api.start("fan_all", {"items": items, "pauses": {"after_spawn": 30, "after_gather": 30}})
    for point in ("after_spawn", "after_gather"):
        wait_for(
            lambda p=point: Execution.objects.filter(run_id=run.id, step_id=f"fan:{p}").exists(),
            timeout=120,
            what=f"the fan-out to reach {point}",
        )
        holder = Run.objects.get(pk=run.id).lease_owner
        victim = next((w for w in workers if holder and w.owns(holder)), None)
        assert victim is not None, f"a test worker holds the parent at {point} (lease owner {holder!r})"
        victim.kill()
        workers[workers.index(victim)] = start_worker(beat="--beat" in victim.args)
    done = wait_for_run(run.id, "completed", timeout=180)
    assert Run.objects.filter(parent_id=done.id).count() == count, "each child started once"
    evaluations = Execution.objects.filter(run_id=run.id, step_id="fan:each").count()
    assert evaluations >= 3, f"the fan-out step re-executed after each kill ({evaluations} executions)"
    charges = LedgerEntry.objects.filter(kind="charge").values("order_id").annotate(n=Count("id"))
    assert {c["order_id"]: c["n"] for c in charges} == {f"child-{i}": 1 for i in range(count)}, "one charge each"
    result = Step.objects.get(run=done, step_id="fan").result
    assert [c["output"]["item"] for c in result["children"]] == list(range(count))
    assert Event.objects.filter(run=done, kind="children_started").count() == 1


def test_race__children_finishing_together_wake_the_parent_once(start_worker):
    for _ in range(3):
        start_worker(concurrency=1)
    run = api.start("fan_all", {"items": [{"item": i, "hold": True} for i in range(6)]})
    wait_for(lambda: Run.objects.get(pk=run.id).status == RunStatus.WAITING, timeout=60, what="the parent to park")
    kids = _children(run)
    wait_for(
        lambda: all(Run.objects.get(pk=k.id).status == RunStatus.WAITING for k in kids),
        timeout=60,
        what="the children to wait for their signal",
    )
    for kid in kids:
        api.send_signal(kid.id, "go")
    done = wait_for_run(run.id, "completed", timeout=120)
    assert Event.objects.filter(run=done, kind="children_joined").count() == 1, "woken once"
    assert Execution.objects.filter(run_id=run.id, step_id="fan:each").count() == 2, "parked once, joined once"


def test_race__children_finishing_while_the_parent_parks_are_seen_by_the_park(start_worker):
    # No beat: only the park itself can see children that finished before its wait existed.
    start_worker()
    start_worker()
    run = api.start("fan_all", {"items": [{"item": i} for i in range(3)], "pauses": {"after_spawn": 5}})
    wait_for(
        lambda: Execution.objects.filter(run_id=run.id, step_id="fan:after_spawn").exists(),
        timeout=60,
        what="the parent to pause before parking",
    )
    done = wait_for_run(run.id, "completed", timeout=120)
    assert Event.objects.filter(run=done, kind="children_joined").count() == 1
