"""Cancelling or rerunning a run while its saga is asked for: a requested compensation is not dropped, not
cut short, and a rerun racing a cancel does not charge twice.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections

from durable_agents import api
from durable_agents.api import PlannedStep, StepContext, call, workflow
from durable_agents.engine import transitions
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive
from tests.integration.interleavings import ledger, net
from tests.testapp.trust import HOOKS, hook
from tests.testapp.workflows import _charge_step

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


def _hooked(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"atk:{ctx.step_id}")
    if ctx.args.get("fail"):
        raise ValueError("the order data is malformed")  # a permanent failure
    return {"step": ctx.step_id}


workflow(
    "charge_then_break_compensating",
    steps=[call("charge", _charge_step), call("work", _hooked)],
    plan=lambda inp: [
        PlannedStep("charge", "charge", {"amount": "10.00"}),
        PlannedStep("work", "work", {"fail": True}),
    ],
    on_failure="compensate",
    replace=True,
)
workflow(
    "charge_then_work",
    steps=[call("charge", _charge_step), call("work", _hooked)],
    plan=lambda inp: [
        PlannedStep("charge", "charge", {"amount": "10.00"}),
        PlannedStep("work", "work", {"fail": bool(inp.get("fail"))}),
        *([PlannedStep("tail", "work")] if inp.get("tail") else []),
    ],
    replace=True,
)


# --- Helpers ------------------------------------------------------------------------------------------------


def _charged_once(order_id: str) -> Run:
    """A two_charges run whose first charge (10.00) is applied; its cursor on charge-b; no worker holds it."""
    run = api.start("two_charges", {"order_id": order_id})
    assert advance(run.id) is Outcome.COMMITTED
    assert ledger(order_id) == [("charge", 10)]
    return run


def _in_another_connection(action) -> Any:
    """Run `action` in a thread with its own connection (its own transaction) and wait for it to finish."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = action()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_rerun__racing_a_cancel_with_compensation_re_runs_skipped_steps_and_charges_again():
    """rerun_from_step checks `finish_as` on a read taken before its transaction; a cancel(compensate) that
    commits in between makes the rerun supersede the compensation *and* the skipped forward steps, so the
    cancelled run charges charge-b (a new effect) and then ends `cancelled` having refunded only charge-a."""
    run = _charged_once("RR-1")
    original = transitions.rerun_txn

    def operators_collide(run_id, position):
        # Operator B's cancel (with compensation) commits while operator A's rerun is between read and write.
        _in_another_connection(lambda: api.cancel(run_id, "customer cancelled", compensate=True, actor="ops-b"))
        return original(run_id, position)

    transitions.rerun_txn = operators_collide
    try:
        api.resume(run.id, from_step="charge-a", actor="ops-a")
    except InvalidTransitionError:
        pass  # refusing the rerun of a compensating run is a fix
    finally:
        transitions.rerun_txn = original
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert ("charge", 20) not in ledger("RR-1"), (
        "guarantee 9/2: a run cancelled with compensation applied a NEW charge (charge-b) after its saga was "
        f"planned: {ledger('RR-1')}"
    )
    assert net("RR-1") == 0, f"a compensated run ended cancelled with money still charged: {ledger('RR-1')}"


def test_cancel__a_requested_compensation_is_dropped_when_the_held_step_fails():
    """cancel(compensate=True) while a worker holds the run answers `requested`; the held step then fails
    permanently and fail_txn ends the run `failed` without looking at cancel_compensate: the charge stays,
    nothing says the requested compensation never happened."""
    run = api.start("charge_then_work", {"order_id": "CR-1", "fail": True})
    assert advance(run.id) is Outcome.COMMITTED
    HOOKS["atk:work"] = lambda ctx: api.cancel(ctx.run_id, "customer cancelled", compensate=True, actor="ops")
    assert advance(run.id) in (Outcome.FAILED, Outcome.COMPENSATING)
    run = drive(run.id)
    assert net("CR-1") == 0, (
        "guarantee 9/8: an accepted cancel-with-compensation was silently dropped when the running step failed; "
        f"run {run.status}, ledger {ledger('CR-1')}"
    )


def test_cancel__a_requested_compensation_is_dropped_when_the_held_step_is_the_last():
    """Same request while the last step runs: its commit completes the run (COMPLETE ignores
    cancel_requested_at); the run ends `completed` with the charge the operator asked to undo."""
    run = api.start("charge_then_work", {"order_id": "CR-2"})
    assert advance(run.id) is Outcome.COMMITTED
    HOOKS["atk:work"] = lambda ctx: api.cancel(ctx.run_id, "customer cancelled", compensate=True, actor="ops")
    advance(run.id)
    run = drive(run.id)
    assert not (run.status == RunStatus.COMPLETED and net("CR-2") != 0), (
        "guarantee 9/8: a cancel(compensate=True) accepted as 'requested' ended as a completed run with its "
        f"charge in place: {ledger('CR-2')}"
    )


# --- Sagas cut short by the engine itself -------------------------------------------------------------------


def test_cancel__a_request_recorded_before_an_on_failure_saga_cuts_that_saga_short():
    """A bulk cancel hits a run while its step runs: `requested` (cancel_requested_at set). The step then fails
    and the workflow compensates on failure: fail_txn plans the saga but leaves cancel_requested_at set. The
    claim refuses runs with a pending cancel, so the next advance *settles* it: take_txn(CANCEL) has no
    finish_as fence and ends the run `cancelled` with its compensation step still pending."""
    run = api.start("charge_then_break_compensating", {"order_id": "CS-1"})
    assert advance(run.id) is Outcome.COMMITTED
    HOOKS["atk:work"] = lambda ctx: api.cancel(ctx.run_id, "bulk cancel", actor="ops")
    assert advance(run.id) is Outcome.COMPENSATING
    run = drive(run.id)
    pending = list(
        Step.objects.live()
        .filter(run=run, kind="compensate")
        .exclude(status=StepStatus.DONE)
        .values_list("step_id", "status")
    )
    assert not pending, (
        f"guarantee 9 (a saga is never cut short): the run ended {run.status} with compensation steps {pending} "
        f"not done; ledger {ledger('CS-1')}"
    )
    assert net("CS-1") == 0, f"the charge was never refunded: {ledger('CS-1')}"
