"""Plans that stay true: stale observations re-plan, judges snapshot verdicts, versions drift, forks."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.engine.advance import advance
from durable_agents.engine.plans import version_drift
from durable_agents.models import Event, Run, RunStatus, Step, Turn, Wait, WaitStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.workflows import registry
from tests.integration.test_admin import login
from tests.testapp.models import Execution, LedgerEntry
from tests.testapp.workflows import _record_step

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


def executions(run_id, step_id: str) -> int:
    return Execution.objects.filter(run_id=run_id, step_id=step_id).count()


def test_freshness__a_stale_observation_re_plans_instead_of_acting():
    run = api.start("fresh_refund")
    advance(run.id)  # observe
    clock.advance(timedelta(minutes=11))  # the run was paused past the observation's 10-minute budget
    assert advance(run.id) == "replanned"

    event = Event.objects.get(run=run, kind="replanned")
    assert event.step_id == "refund" and "over its 600s budget" in event.detail["reason"]
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED and executions(run.id, "observe") == 2, "the world was re-observed"
    assert LedgerEntry.objects.count() == 1


def test_freshness__an_applied_refund_proposed_again_is_not_applied_twice():
    run = api.start("fresh_refund")
    advance(run.id)  # observe
    advance(run.id)  # refund: applied
    clock.advance(timedelta(minutes=11))
    assert advance(run.id) == "replanned"  # notify found the observation stale: back to observe
    run = drive(run.id)

    assert run.status == RunStatus.COMPLETED
    assert LedgerEntry.objects.count() == 1, "the re-planned refund reused the applied effect"
    assert Event.objects.get(run=run, kind="replanned").detail["superseded"] == ["observe", "refund", "notify"]
    assert list(Step.objects.filter(run=run, step_id="refund").values_list("status", flat=True)) == [
        "superseded",
        "done",
    ]


def test_judge__redo_sends_feedback_back_and_passes_the_second_time():
    run = drive(api.start("judged_redo").id)
    assert run.status == RunStatus.COMPLETED
    drafts = list(Step.objects.filter(run=run, step_id="draft").order_by("id").values_list("status", "result"))
    assert [status for status, _ in drafts] == ["superseded", "done"]
    assert drafts[1][1]["feedback"] == "The customer waited a week: apologise."
    assert Turn.objects.filter(run=run, purpose="judge").count() == 2, "one verdict per review, each journaled"
    assert Event.objects.get(run=run, kind="redo_from_step").detail["target"] == "draft"


def test_judge__fail_route_fails_the_run_with_the_reasons():
    run = drive(api.start("judged_fail").id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "JudgeFailedError"
    assert "apologise" in run.error["message"]


def test_judge__verdict_survives_a_sigkill_and_is_not_asked_again(start_worker):
    worker = start_worker()
    run = api.start("judged_ask_human")
    wait_for(lambda: Run.objects.get(pk=run.id).status == RunStatus.WAITING, timeout=30, what="the human ask")
    worker.kill()  # the failing verdict is journaled; the worker that asked is gone
    wait = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    assert "apologise" in wait.question

    api.decide(wait.pk, True, by="lead", comment="fine as is")
    start_worker(beat=True)
    run = wait_for_run(run.id, "completed", timeout=60)
    assert Turn.objects.filter(run=run, purpose="judge").count() == 1, "the verdict was replayed, not re-asked"
    assert Step.objects.get(run=run, step_id="review").result["overridden_by"] == "lead"


# --- Versions ---------------------------------------------------------------------------------------------


@pytest.fixture
def versioned():
    from durable_agents.api import call, workflow

    def define(version: int, names: list[str], policy: str = "park") -> None:
        workflow(
            "versioned",
            version=version,
            steps=[call(n, _record_step) for n in names],
            on_missing_version=policy,
            replace=True,
        )

    yield define
    registry.unregister("versioned")


def _started_on_v1(versioned) -> Run:
    versioned(1, ["a", "b"])
    run = api.start("versioned", {})
    advance(run.id)  # a
    registry.unregister("versioned", 1)
    return run


def test_versions__continue_on_the_newer_version(versioned):
    run = _started_on_v1(versioned)
    versioned(2, ["a", "b"], "continue")
    run = drive(run.id)
    assert (run.status, run.workflow_version) == (RunStatus.COMPLETED, 2)
    assert Event.objects.get(run=run, kind="version_migrated").detail == {"previous": 1, "to": 2, "replanned": False}


def test_versions__replan_takes_the_new_versions_plan_for_what_is_left(versioned):
    run = _started_on_v1(versioned)
    versioned(2, ["a", "b2", "c"], "replan")
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED
    live = list(Step.objects.live().filter(run=run).order_by("position").values_list("step_id", "status"))
    assert live == [("a", "done"), ("b2", "done"), ("c", "done")]
    assert executions(run.id, "a") == 1, "done steps are kept, not repeated"


def test_versions__park_for_an_operator_who_migrates_the_run(versioned):
    run = _started_on_v1(versioned)
    versioned(2, ["a", "b"], "park")
    run = drive(run.id)
    assert run.status == RunStatus.WAITING
    assert list(version_drift().values_list("id", flat=True)) == [run.id]
    console = login("ops", codenames=("replan_run",)).get(reverse("admin:durable_agents_run_changelist") + "?drift=yes")
    assert [r.pk for r in console.context["cl"].result_list] == [run.id], "the console lists version drift"
    listed = StringIO()
    call_command("durable_runs", "--version-drift", "--json", stdout=listed)
    assert [row["id"] for row in json.loads(listed.getvalue())] == [str(run.id)]
    call_command("durable_migrate", str(run.id), "--version", "2", "--as", "ops", stdout=StringIO())
    run = drive(run.id)
    assert (run.status, run.workflow_version) == (RunStatus.COMPLETED, 2)
    assert Event.objects.get(run=run, kind="version_migrated").actor == "ops"


def test_versions__a_gone_workflow_parks_instead_of_crash_looping(versioned):
    run = _started_on_v1(versioned)
    run = drive(run.id)
    assert run.status == RunStatus.WAITING and "no longer registered" in Wait.objects.get(run=run).question


# --- Rerun and fork ---------------------------------------------------------------------------------------


def test_rerun_from_step__keeps_history_and_never_repeats_an_applied_effect():
    run = drive(api.start("charge", {"order_id": "P-1"}).id)
    api.resume(run.id, from_step="charge")
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED and LedgerEntry.objects.count() == 1
    assert Step.objects.filter(run=run, step_id="charge").count() == 2, "the first checkpoint stays as history"


def test_fork__copies_checkpoints_and_shares_effects_with_the_same_input():
    source = drive(api.start("charge", {"order_id": "P-2"}).id)
    fork = drive(api.fork(source.id, "charge", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED and fork.forked_from_id == source.id
    assert LedgerEntry.objects.count() == 1, "the fork recognised the source's applied charge"

    later = drive(api.fork(source.id, "after").id)
    assert executions(later.id, "charge") == 0 and Step.objects.get(run=later, step_id="charge").status == "done"

    out = StringIO()
    call_command("durable_fork", str(source.id), "--at-step", "charge", "--input", '{"order_id": "P-3"}', stdout=out)
    new_request = drive(out.getvalue().strip())
    assert new_request.status == RunStatus.COMPLETED
    assert sorted(LedgerEntry.objects.values_list("order_id", flat=True)) == ["P-2", "P-3"]
    assert Event.objects.filter(run=source, kind="fork_started").count() == 3


# --- Planner ----------------------------------------------------------------------------------------------


def test_planner__invalid_plans_are_refused_and_re_asked_then_the_plan_runs_step_by_step():
    run = drive(api.start("planned").id)
    assert run.status == RunStatus.COMPLETED, run.error
    live = list(Step.objects.live().filter(run=run).order_by("position").values_list("step_id", flat=True))
    assert live == ["observe", "plan", "plan.1.lookup_order", "plan.2.charge", "after"]
    attempts = list(Turn.objects.filter(run=run, purpose="planner").order_by("index"))
    assert len(attempts) == 3, "two refused plans, then the valid one"
    assert LedgerEntry.objects.count() == 1
    assert Step.objects.get(run=run, step_id="plan.1.lookup_order").fresh_for == timedelta(seconds=600)


def test_planner__a_plan_that_never_validates_fails_clearly():
    run = drive(api.start("badly_planned").id)
    assert run.status == RunStatus.FAILED and "no valid plan in 3 attempts" in run.error["message"]
    assert not Step.objects.filter(run=run, step_id__startswith="plan.").exists(), "no invalid plan reached the table"


def test_planner__a_stale_re_plan_reuses_the_applied_charge():
    run = api.start("planned")
    for _ in range(4):  # observe, plan, lookup, charge
        advance(run.id)
    assert LedgerEntry.objects.count() == 1
    clock.advance(timedelta(minutes=11))
    assert advance(run.id) == "replanned"  # "after" depends on the observation, now stale
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED
    assert LedgerEntry.objects.count() == 1, "the re-planned charge has the same tool and arguments: reused"
    assert Turn.objects.filter(run=run, purpose="planner").count() == 6, "the planner ran again after re-observing"


def test_planner__two_identical_calls_in_one_plan_are_two_effects():
    run = drive(api.start("double_planned").id)
    assert run.status == RunStatus.COMPLETED
    assert LedgerEntry.objects.filter(order_id="DB-1").count() == 2, "the second identical charge is its own effect"
