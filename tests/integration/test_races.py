"""Regressions for races found in review: each test pins a sequence that once broke a guarantee."""

from __future__ import annotations

from datetime import timedelta

import pytest

from durable_agents import api, clock
from durable_agents import waits as public_waits
from durable_agents.agents.participants import participants, text, tool_use
from durable_agents.api import agent, call, tool, wait_for_signal, workflow
from durable_agents.engine.advance import advance
from durable_agents.engine.lease import renew_lease
from durable_agents.engine.sweep import sweep
from durable_agents.models import Effect, Run, RunStatus, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease as claim_run
from durable_agents.workflows import registry

pytestmark = pytest.mark.django_db(transaction=True)
KEYS: list[str] = []


@tool(name="race_refund", effectful=True)
def race_refund(order_id: str, idempotency_key: str) -> dict:
    """Refund at an external provider whose first answer times out after applying it."""
    KEYS.append(idempotency_key)
    if len(KEYS) == 1:
        raise TimeoutError("read timed out (the provider may have applied it)")
    return {"ok": True}


def _script(request):
    if request.turn == 0:
        return [tool_use("race_refund", {"order_id": "A1"}, id="toolu_1")]
    if request.tool_results and request.tool_results[0].get("is_error"):
        return [tool_use("race_refund", {"order_id": "A1"}, id="toolu_2")]
    return [text("done")]


participants.register("race-script", api.ScriptedParticipant(_script, name="race-script"))
workflow("race_agent", steps=[agent("a", instructions="refund", tools=[race_refund], participant="race-script")])
workflow("race_signal", steps=[wait_for_signal("s", signal="go"), call("after", lambda ctx: {"ok": True})])


@pytest.fixture(autouse=True)
def _reset():
    KEYS.clear()
    yield
    clock.reset()


def test_agent__an_external_tool_with_an_unknown_outcome_is_retried_under_its_own_key():
    run = drive(api.start("race_agent", {}).id)
    assert run.status == RunStatus.COMPLETED
    assert len(set(KEYS)) == 1 and len(KEYS) == 2, f"one refund, one key, asked twice: {KEYS}"
    assert Effect.objects.get().status == "applied"


def test_signal__arriving_while_the_step_parks_is_not_lost(monkeypatch):
    run = api.start("race_signal", {})
    original = public_waits.take_buffered_signal

    def racing(step, name, **fence):
        found = original(step, name, **fence)
        api.send_signal(run.id, "go", {"x": 1}, by="racer")  # arrives before the park commits
        return found

    monkeypatch.setattr(public_waits, "take_buffered_signal", racing)
    advance(run.id)
    monkeypatch.setattr(public_waits, "take_buffered_signal", original)
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, "the signal arrived; the run must not wait for it forever"


def test_migrate__refuses_while_a_worker_holds_the_run():
    workflow("race_mig", version=1, steps=[call("first", lambda ctx: 1)], replace=True)
    workflow("race_mig", version=2, steps=[call("first", lambda ctx: 1)], replace=True)
    try:
        run = api.start("race_mig", {}, version=1)
        claim_run(run.id)  # a worker is mid-step
        with pytest.raises(api.InvalidTransitionError, match="being advanced by"):
            api.migrate(run.id, 2, replan=True)
        assert Run.objects.get(pk=run.id).workflow_version == 1
    finally:
        registry.unregister("race_mig")


def test_lease__a_renewal_after_the_release_does_not_re_arm_it():
    run = api.start("noop", {"steps": 2})
    claim = claim_run(run.id)
    Run.objects.filter(pk=run.id).update(lease_owner="", lease_expires_at=None)  # the commit released it
    assert renew_lease(claim) is False
    assert Run.objects.get(pk=run.id).lease_expires_at is None


def test_deadline__fail_policy_compensates_when_the_workflow_says_so():
    from durable_agents.waits import approval
    from tests.testapp.models import LedgerEntry
    from tests.testapp.workflows import _charge_step

    workflow(
        "race_deadline",
        steps=[
            call("charge", _charge_step),
            approval("ok", question="?", deadline=timedelta(hours=1), on_deadline="fail"),
        ],
        on_failure="compensate",
        replace=True,
    )
    try:
        run = drive(api.start("race_deadline", {"order_id": "D-1"}).id)
        assert run.status == RunStatus.WAITING
        clock.advance(timedelta(hours=2))
        sweep()
        run = drive(run.id)
    finally:
        registry.unregister("race_deadline")
    assert run.status == RunStatus.FAILED and run.error["type"] == "WaitExpiredError"
    assert sorted(LedgerEntry.objects.values_list("kind", flat=True)) == ["charge", "refund"]
    assert Wait.objects.get(run=run).status == WaitStatus.EXPIRED
