"""A saga, once started, finishes or stops visibly with what is left to undo (issue 13, items 3, 4, 11, 12)."""

from __future__ import annotations

import pytest

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.receiver import IdempotentReceiver
from durable_agents.testing.runs import take_lease
from tests.integration.interleavings import ledger
from tests.testapp.models import Execution
from tests.testapp.trust import HOOKS

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_hooks():
    HOOKS.clear()
    yield
    HOOKS.clear()


@pytest.fixture
def carrier():
    with IdempotentReceiver() as receiver:
        yield receiver


def _charged_twice(order_id: str) -> Run:
    """A two_charges run with both charges applied, paused before its last steps."""
    run = api.start("two_charges", {"order_id": order_id})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.COMMITTED
    assert ledger(order_id) == [("charge", 10), ("charge", 20)]
    return run


def test_saga__a_second_cancel_never_cuts_a_compensation_short():
    run = _charged_twice("S-1")
    api.cancel(run.id, "customer cancelled", compensate=True, actor="ops-1")
    for second in (
        lambda: api.cancel(run.id, "double submit", compensate=True, actor="ops-1"),
        lambda: api.cancel(run.id, "a colleague", actor="ops-2"),
    ):
        again = second()
        assert again.status != RunStatus.CANCELLED, "a second cancel ended the run with its compensation pending"
        assert again.finish_as == RunStatus.CANCELLED
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert ledger("S-1") == [("charge", 10), ("charge", 20), ("refund", -20), ("refund", -10)]
    assert Event.objects.filter(run=run, kind="cancel_ignored").count() == 2, "each ignored cancel is recorded"


def test_saga__a_second_cancel_while_a_worker_holds_the_run_does_not_cut_it_short():
    run = _charged_twice("S-2")
    api.cancel(run.id, "customer cancelled", compensate=True)
    take_lease(run.id)  # a worker is executing the first compensation step
    api.cancel(run.id, "bulk cancel")
    assert Run.objects.get(pk=run.id).cancel_requested_at is None, "a compensating run takes no cancel request"
    Run.objects.filter(pk=run.id).update(lease_expires_at=None, lease_owner="")  # that worker died
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert [kind for kind, _ in ledger("S-2")] == ["charge", "charge", "refund", "refund"]


def test_saga__compensation_learns_an_unknown_outcome_and_undoes_it(carrier):
    """The shipment landed but its answer was lost (the worker died mid-call): cancel with compensation must
    learn the outcome under the same key and call the shipment back — never end as if nothing happened."""

    def lost_answer(ctx):
        HOOKS.pop("after_ship")
        raise ConnectionResetError("the connection broke after the carrier accepted the shipment")

    HOOKS["after_ship"] = lost_answer
    run = api.start("ship_then_hold", {"order_id": "S-3", "url": carrier.url})
    assert advance(run.id) is Outcome.RETRY  # the outcome is unknown: the step will call again
    effect = Effect.objects.get(run=run, tool="ship")
    assert effect.status == EffectStatus.PENDING and effect.attempts == 1

    api.cancel(run.id, "customer cancelled", compensate=True)
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED, run.error
    assert [r.path for r in carrier.requests] == ["/ship", "/ship", "/unship"], "learn under the key, then undo"
    assert len([k for k in carrier.applied if k == effect.idempotency_key]) == 1, "shipped once"
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.COMPENSATED


def test_saga__on_failure_compensation_covers_an_unknown_outcome(carrier):
    def lost_answer(ctx):
        HOOKS.pop("after_ship")
        raise ValueError("the carrier's answer could not be parsed")  # a permanent error: the step fails

    HOOKS["after_ship"] = lost_answer
    run = drive(api.start("ship_then_break", {"order_id": "S-4", "url": carrier.url}).id)
    HOOKS.clear()
    assert run.status == RunStatus.FAILED
    paths = [r.path for r in carrier.requests]
    assert paths.count("/unship") == 1, f"the failed run left a shipment it never learned about: {paths}"
    assert Effect.objects.get(run=run, tool="ship").status == EffectStatus.COMPENSATED


def test_saga__an_outcome_nobody_can_learn_stops_the_saga_visibly_and_resumes_once_recorded(carrier, settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "EFFECT_MAX_INVOCATIONS": 2}

    def carrier_down(ctx):
        raise ConnectionResetError("connection reset")

    HOOKS["after_ship"] = carrier_down
    run = api.start("ship_then_hold", {"order_id": "S-5", "url": carrier.url})
    assert advance(run.id) is Outcome.RETRY
    api.cancel(run.id, "customer cancelled", compensate=True)
    run = drive(run.id)

    assert run.status == RunStatus.FAILED, "a saga that cannot learn an outcome must stop, not finish"
    key = Effect.objects.get(run=run, tool="ship").idempotency_key
    assert run.error["left_to_undo"] == [key] and "left to undo" in run.error["message"], run.error
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.status == EffectStatus.PENDING and "durable_effect" in effect.needs_attention
    assert not [r for r in carrier.requests if r.path == "/unship"]

    HOOKS.clear()
    api.resolve_effect(key, True, result={"shipment": "checked by phone"}, actor="ops", reason="carrier confirmed")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED, "once the outcome is recorded the saga finishes"
    assert [r.path for r in carrier.requests].count("/unship") == 1
    assert Event.objects.filter(run=run, kind="effect_resolved", actor="ops").exists()


def test_saga__a_compensated_run_does_not_resume_or_rerun_it_forks():
    run = _charged_twice("S-6")
    api.cancel(run.id, "cancelled", compensate=True)
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED and run.finish_as == RunStatus.CANCELLED
    for attempt in (lambda: api.resume(run.id), lambda: api.resume(run.id, from_step="charge-a")):
        with pytest.raises(api.InvalidTransitionError, match="durable_fork"):
            attempt()
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED

    fork = drive(api.fork(run.id, "charge-a", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED
    charges = [amount for kind, amount in ledger("S-6") if kind == "charge"]
    assert charges == [10, 20, 10, 20], "the fork charges anew: the source's charges were undone"


def test_saga__a_compensated_failed_run_is_refused_not_ended_again_without_an_error():
    run = drive(api.start("charge_then_break", {"order_id": "S-7"}).id)
    assert run.status == RunStatus.FAILED and run.finish_as == RunStatus.FAILED
    with pytest.raises(api.InvalidTransitionError, match="compensated"):
        api.resume(run.id)
    assert Run.objects.get(pk=run.id).error == run.error


def test_saga__a_compensated_effect_is_never_returned_as_if_applied():
    run = _charged_twice("S-8")
    api.cancel(run.id, "cancelled", compensate=True)
    drive(run.id)
    step = Step.objects.live().get(run=run, step_id="charge-a")
    Run.objects.filter(pk=run.id).update(status=RunStatus.FAILED, finish_as="", cursor=step.position)
    Step.objects.filter(pk=step.pk).update(status=StepStatus.FAILED)
    run = drive(api.resume(run.id).id)  # were the refusal bypassed, the step must still not report a charge
    assert run.status == RunStatus.FAILED and "compensated" in run.error["message"]
    assert [kind for kind, _ in ledger("S-8")].count("charge") == 2


@pytest.mark.parametrize("pause_at", ["after_ship"])
def test_saga__an_external_call_in_flight_at_sigkill_is_compensated(start_worker, carrier, pause_at):
    worker = start_worker()
    run = api.start("ship_then_hold", {"order_id": "S-9", "url": carrier.url, "pause_at": pause_at, "pause_s": 60})
    wait_for(
        lambda: Execution.objects.filter(run_id=run.id, step_id=f"ship:{pause_at}").exists(),
        timeout=60,
        what="the shipment to be sent",
    )
    worker.kill()  # the carrier has the shipment; the worker never recorded it
    api.cancel(run.id, "customer cancelled", compensate=True)
    start_worker(beat=True)
    run = wait_for_run(run.id, RunStatus.CANCELLED, timeout=120)
    paths = [r.path for r in carrier.requests]
    assert paths.count("/unship") == 1, f"the shipment in flight at the SIGKILL stayed: {paths}"
    assert len(carrier.applied) == 2, "one shipment and one call-back, each applied once"
