"""One statement commits an eager step and claims the next: a duplicate delivery right after it finds the next
step claimed and runs nothing, a cancel with compensation mid-step makes it claim nothing, and a plan or step changed
under a matching fencing token is neither committed nor claimed.

In-process tests use a recording WAKER; the races are made deterministic by the database itself (a second
connection blocked on the first's row lock, seen in pg_stat_activity) or by a `step_committed` receiver, which
runs right after a commit and before anything else the engine does.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.db.models import F
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance, advance_slice
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus
from durable_agents.signals import step_committed
from durable_agents.workflows import call, workflow

ON = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 50}
woken: list[str] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_wake", **changes})


def _ran(ctx) -> dict[str, Any]:
    ran.append(ctx.step.step_id)
    return {"step": ctx.step.step_id}


ran: list[str] = []


# --- one statement: commit N + claim N+1 ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_duplicate__a_delivery_right_after_the_commit_finds_the_next_step_claimed_and_runs_nothing():
    workflow("dup17", steps=[call(f"s{i}", _ran) for i in range(4)], replace=True)
    run = api.start("dup17")
    duplicates: list[Outcome] = []

    def deliver_again(run_id, **_: object) -> None:
        duplicates.append(advance(run_id))

    ran.clear()
    step_committed.connect(deliver_again, weak=False, dispatch_uid="eager-commit-deliver-again")
    try:
        with _in_process(**ON):
            assert advance_slice(run.id) == Outcome.COMPLETED
    finally:
        step_committed.disconnect(dispatch_uid="eager-commit-deliver-again")
    assert ran == ["s0", "s1", "s2", "s3"], "every step ran once, in order"
    # After s0..s2 the statement had already claimed the next step: the duplicate met a held lease.
    assert duplicates[:3] == [Outcome.SKIPPED] * 3
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED


def _cancels_with_compensation(ctx) -> dict[str, Any]:
    api.cancel(ctx.run.id, "undo it", compensate=True)
    return {"step": ctx.step.step_id}


def _must_not_run(ctx) -> dict[str, Any]:
    raise AssertionError("a step after a cancel request ran")


@pytest.mark.django_db(transaction=True)
def test_cancel_with_compensation_mid_step__the_statement_claims_nothing_and_the_cancel_is_settled():
    workflow("cancel17", steps=[call("a", _cancels_with_compensation), call("b", _must_not_run)], replace=True)
    run = api.start("cancel17")
    with _in_process(**ON):
        outcome = advance_slice(run.id)
    run.refresh_from_db()
    assert outcome in (Outcome.CANCELLED, Outcome.COMPENSATING)
    assert run.cursor >= 1 and not run.lease_owner and run.cancel_requested_at is None
    assert Step.objects.get(run=run, step_id="a").status == StepStatus.DONE
    assert Step.objects.get(run=run, step_id="b").status == StepStatus.PENDING


def _plan_grows_under_the_claim(ctx) -> dict[str, Any]:
    Run.objects.filter(pk=ctx.run.id).update(step_count=F("step_count") + 1)  # the token left as it was
    return {"step": ctx.step.step_id}


def _superseded_under_the_claim(ctx) -> dict[str, Any]:
    Step.objects.filter(pk=ctx.step.pk).update(status=StepStatus.SUPERSEDED)
    Step.objects.create(run_id=ctx.run.id, step_id="a2", name="b", kind=ctx.step.kind, position=ctx.step.position)
    return {"step": ctx.step.step_id}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("body", [_plan_grows_under_the_claim, _superseded_under_the_claim], ids=["plan", "step"])
def test_fence__a_plan_or_step_changed_under_a_matching_token_is_not_committed_or_claimed(body):
    workflow("fence17", steps=[call("a", body), call("b", _must_not_run), call("c", _must_not_run)], replace=True)
    run = api.start("fence17")
    token = Run.objects.get(pk=run.id).lease_token
    with _in_process(**ON):
        assert advance_slice(run.id) == Outcome.LEASE_LOST
    row = Run.objects.get(pk=run.id)
    assert row.cursor == 0 and row.lease_token == token + 1, "no checkpoint, no second claim"
    assert not Step.objects.filter(run_id=run.id, status=StepStatus.DONE).exists()
    assert Event.objects.filter(run_id=run.id, kind="zombie_commit_rejected").count() == 1
