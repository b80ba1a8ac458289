"""Effects exactly once on real workers: transactional and external tools under SIGKILL, keys, sagas."""

from __future__ import annotations

import threading
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine.advance import advance
from durable_agents.engine.effects import invoke_tool
from durable_agents.models import Effect, EffectStatus, Event, RunStatus, Step, StepStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.receiver import IdempotentReceiver
from tests.testapp.models import Execution, LedgerEntry
from tests.testapp.workflows import charge

pytestmark = pytest.mark.django_db(transaction=True)


def reached(run_id, marker: str) -> bool:
    return Execution.objects.filter(run_id=run_id, step_id=marker).exists()


@pytest.mark.parametrize("kill_point", ["before_call", "inside_charge", "after_effect", "after_commit"])
def test_effects__transactional_tool_applies_once_across_sigkill(start_worker, kill_point):
    worker = start_worker()
    pause_at = None if kill_point == "after_commit" else kill_point
    run = api.start("charge", {"order_id": "A-1", "pause_at": pause_at, "pause_s": 30})

    if kill_point == "after_commit":
        wait_for(
            lambda: Step.objects.filter(run=run, step_id="charge", status="done").exists(),
            timeout=30,
            what="the charge checkpoint",
        )
    else:
        wait_for(lambda: reached(run.id, f"charge:{kill_point}"), timeout=30, what=f"the worker to reach {kill_point}")
    worker.kill()
    start_worker(beat=True)

    wait_for_run(run.id, "completed", timeout=60)
    key = f"{run.id}:charge:charge:1"
    assert LedgerEntry.objects.filter(order_id="A-1").count() == 1, f"killed at {kill_point}: the charge landed twice"
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.status == EffectStatus.APPLIED and LedgerEntry.objects.get().idempotency_key == key


def test_effects__external_tool_passes_the_key_on_and_the_receiver_applies_once(start_worker):
    with IdempotentReceiver() as receiver:
        worker = start_worker()
        run = api.start("notify", {"order_id": "A-2", "url": receiver.url + "/notify", "pause_at": "after_request"})
        wait_for(lambda: reached(run.id, "notify:after_request"), timeout=30, what="the request to be sent")
        worker.kill()  # the receiver has applied it; the worker never recorded that
        start_worker(beat=True)
        wait_for_run(run.id, "completed", timeout=60)

        key = f"{run.id}:notify:notify:1"
        assert receiver.requests_for(key) == 2, "the re-executed step must call again with the same key"
        assert list(receiver.applied) == [key], "the receiver applied the effect exactly once"
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.status == EffectStatus.APPLIED and effect.attempts == 2 and effect.result["replay"] is True


def test_effects__key_reused_with_other_arguments_is_refused_and_nothing_applied():
    run = api.start("noop")
    invoke_tool(charge, {"order_id": "A-3", "amount": "5.00"}, key="k-1", run_id=run.id, step_pk=None)
    with pytest.raises(api.IdempotencyKeyReusedError, match="reused for charge"):
        invoke_tool(charge, {"order_id": "A-3", "amount": "6.00"}, key="k-1", run_id=run.id, step_pk=None)
    assert list(LedgerEntry.objects.values_list("amount", flat=True)) == [5]


def test_effects__applied_key_returns_the_stored_result_without_calling():
    run = api.start("noop")
    first = invoke_tool(charge, {"order_id": "A-4", "amount": "5.00"}, key="k-2", run_id=run.id, step_pk=None)
    again = invoke_tool(charge, {"amount": "5.00", "order_id": "A-4"}, key="k-2", run_id=run.id, step_pk=None)
    assert again == first and LedgerEntry.objects.count() == 1


def test_effects__schema_invalid_arguments_fail_before_any_call():
    run = drive(api.start("bad_tool_args", {"order_id": "A-5"}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ToolArgumentsError"
    assert "amount" in run.error["message"]
    assert not Effect.objects.exists() and not LedgerEntry.objects.exists()


@override_settings(DURABLE_AGENTS={"EFFECT_MAX_INVOCATIONS": 2, "RETRY_BACKOFF_SECONDS": 0.01})
def test_effects__external_outcome_that_cannot_be_known_goes_to_an_operator():
    run = drive(api.start("notify", {"order_id": "A-6", "url": "http://127.0.0.1:9/unreachable"}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "EffectOutcomeUnknownError"
    effect = Effect.objects.get()
    assert effect.attempts == 2 and f"durable_effect {effect.idempotency_key} --applied" in effect.needs_attention


def test_saga__cancel_with_compensation_undoes_effects_newest_first_once(start_worker, tmp_path):
    start_worker()
    gate = tmp_path / "go-on"  # the run holds until the cancel is in
    run = api.start("two_charges", {"order_id": "B-1", "pause_at": "hold", "pause_s": str(gate)})
    wait_for(lambda: reached(run.id, "hold:hold"), timeout=30, what="both charges to apply")

    api.cancel(run.id, "customer cancelled", compensate=True, actor="ops")
    gate.touch()
    run = wait_for_run(run.id, "cancelled", timeout=60)

    ledger = list(LedgerEntry.objects.order_by("at", "id").values_list("kind", "amount"))
    assert ledger == [("charge", 10), ("charge", 20), ("refund", -20), ("refund", -10)], ledger
    assert set(Effect.objects.filter(kind="effect").values_list("status", flat=True)) == {"compensated"}
    assert Step.objects.get(run=run, step_id="after").status == StepStatus.SKIPPED
    assert Event.objects.filter(run=run, kind="cancel_compensating").exists()
    assert run.output is None


def test_saga__compensation_survives_sigkill_mid_compensation(start_worker, tmp_path):
    worker = start_worker()
    gate = tmp_path / "go-on"  # the run holds until the cancel is in
    run = api.start("two_charges", {"order_id": "B-2", "pauses": {"hold": str(gate), "inside_refund": 30}})
    wait_for(lambda: reached(run.id, "hold:hold"), timeout=30, what="both charges to apply")
    api.cancel(run.id, "fraud", compensate=True)
    gate.touch()
    wait_for(lambda: reached(run.id, "compensate-1:inside_refund"), timeout=30, what="the first compensation")
    worker.kill()  # inside the compensating transaction: it rolls back
    start_worker(beat=True)

    run = wait_for_run(run.id, "cancelled", timeout=60)
    refunds = list(LedgerEntry.objects.filter(kind="refund").order_by("id").values_list("amount", flat=True))
    assert refunds == [-20, -10], f"each charge is refunded exactly once, newest first: {refunds}"


def test_saga__workflow_policy_compensates_on_failure():
    run = drive(api.start("charge_then_break", {"order_id": "C-1"}).id)
    assert run.status == RunStatus.FAILED
    assert {k: run.error[k] for k in ("type", "message", "step")} == {
        "type": "ValueError",
        "message": "the order data is malformed",
        "step": "broken",
    }
    assert "in _permanent" in run.error["traceback"], "an unexpected error keeps its traceback"
    assert list(LedgerEntry.objects.order_by("id").values_list("kind", flat=True)) == ["charge", "refund"]
    assert Effect.objects.get(kind="effect").status == EffectStatus.COMPENSATED


def test_effects__show_lists_effects_and_their_state():
    from durable_agents.operations import describe_run

    run = drive(api.start("charge_then_break", {"order_id": "C-2"}).id)
    effects = describe_run(run.id)["effects"]
    assert [(e["tool"], e["kind"], e["status"]) for e in effects] == [
        ("charge", "effect", "compensated"),
        ("refund_charge", "compensation", "applied"),
    ]
    assert effects[1]["compensates"] == effects[0]["key"]


def test_saga__cancel_command_with_compensate_flag():
    run = api.start("two_charges", {"order_id": "B-3"})
    advance(run.id)  # both charges apply in-process; the run stops before "hold"
    advance(run.id)
    out = StringIO()
    call_command("durable_cancel", str(run.id), "--compensate", "--reason", "fraud", stdout=out)
    assert "compensating, then cancelled" in out.getvalue()
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert sorted(LedgerEntry.objects.values_list("amount", flat=True)) == [-20, -10, 10, 20]


def test_effects__a_concurrent_in_flight_duplicate_waits_and_reuses_the_result():
    from tests.testapp.plans import slow_charge

    run = api.start("noop")
    results: list[dict] = []

    def invoke() -> None:
        try:
            results.append(
                invoke_tool(
                    slow_charge, {"order_id": "CC-1", "amount": "9.00"}, key="cc-1", run_id=run.id, step_pk=None
                )
            )
        finally:
            connections.close_all()

    threads = [threading.Thread(target=invoke) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [{"charged": "9.00"}] * 2, "the duplicate waited for the first and got its result"
    assert LedgerEntry.objects.filter(order_id="CC-1").count() == 1
