"""Regressions found by the state machine (test_state_machine.py), each replayed as a fixed sequence.

Every test is one shrunk failing example, without Hypothesis: the same `machine_*` workflows, paused
workers and receivers (tests/testapp/machine.py), in a fixed order. Each names the guarantee it defends.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import IntegrityError

from durable_agents import api, clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.sweep import sweep
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Effect, Run, RunStatus, Step, StepKind, StepStatus, Wait, WaitKind, WaitStatus
from durable_agents.testing import drive
from tests.testapp.machine import (
    DEADLINE,
    FRESH_FOR,
    LEASE_SECONDS,
    PausedWorker,
    control,
    machine_settings,
    skewed_clock,
)
from tests.testapp.models import MachineOrder, ReceiverCall

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _machine() -> Iterator[None]:
    with machine_settings():
        yield
    control.reset()
    clock.reset()


def start(workflow: str, amount: str = "60.00") -> Run:
    order_id = f"R-{MachineOrder.objects.count()}"
    MachineOrder.objects.create(order_id=order_id, amount=Decimal(amount))
    return api.start(workflow, {"order_id": order_id})


def open_wait(run: Run) -> Wait:
    return Wait.objects.open().get(run=run)


def landed(run: Run, receiver: str, kind: str = "apply") -> list[ReceiverCall]:
    """The calls that changed `receiver` for this run's keys (the receiver's dedupes left out)."""
    scope = f"{run.effect_scope or run.id}:"
    return list(
        ReceiverCall.objects.filter(receiver=receiver, kind=kind, deduped=False).filter(
            **({"undoes__startswith": scope} if kind == "undo" else {"idempotency_key__startswith": scope})
        )
    )


def pending_compensation(run: Run) -> list[Any]:
    return list(
        Step.objects.live()
        .filter(run=run, kind=StepKind.COMPENSATE, status=StepStatus.PENDING)
        .values_list("step_id", "args")
    )


def unfinished_steps(run: Run) -> list[tuple[str, str]]:
    return list(
        Step.objects.live()
        .filter(run=run)
        .exclude(status__in=[StepStatus.DONE, StepStatus.SKIPPED])
        .values_list("step_id", "status")
    )


# --- 4. One writer per run ---------------------------------------------------------------------------------


def test_lease__a_worker_with_a_skewed_clock_does_not_take_over_a_live_lease():
    """Shrunk: start_first(machine_order); pause_worker(charge:body); skewed_advance."""
    run = start("machine_order")
    worker = PausedWorker(run.id, "charge:body")
    assert worker.start(), "the worker pauses inside the charge step, holding the run's lease"
    try:
        with skewed_clock(LEASE_SECONDS + 20):
            outcome = advance(run.id)
        token = Run.objects.get(pk=run.id).lease_token
    finally:
        worker.release(die=True)
    assert outcome is Outcome.SKIPPED and token == worker.token, (
        f"a worker whose clock runs {LEASE_SECONDS + 20:.0f}s ahead took the live lease of token {worker.token} "
        f"(outcome {outcome}, token now {token}): leases must be judged on the database's clock (guarantee 4)"
    )


def test_lease__a_zombie_does_not_call_an_external_tool_after_losing_its_lease():
    """Shrunk: advance_once (charged); pause_worker(ship:body); advance_time(301); cancel; release_worker."""
    run = start("machine_order")
    assert advance(run.id) is Outcome.COMMITTED, "the charge step commits"
    worker = PausedWorker(run.id, "ship:body")
    assert worker.start(), "the worker pauses inside the ship step, before it calls the shipping service"
    clock.advance(timedelta(seconds=LEASE_SECONDS + 1))
    assert api.cancel(run.id, actor="operator").status == RunStatus.CANCELLED, "the expired lease lets the cancel in"
    worker.release()
    zombie_calls = [(c.idempotency_key, c.token) for c in ReceiverCall.objects.filter(run_id=run.id, held=False)]
    assert not zombie_calls, (
        f"a worker that had lost its lease called the shipping service {zombie_calls} for a cancelled run: "
        "a zombie proves its lease right before an external call and never applies an effect (guarantee 4)"
    )
    assert worker.outcome is Outcome.LEASE_LOST


# --- 9. A saga finishes or stops visibly ----------------------------------------------------------------------


def test_cancel__a_second_cancel_does_not_cut_a_running_compensation_short():
    """Shrunk: drive (charged, waiting); cancel(compensate=True); cancel(compensate=True) (a double submit)."""
    run = drive(start("machine_saga").id)
    assert run.status == RunStatus.WAITING and landed(run, "ledger"), "charged, waiting for the approval"
    api.cancel(run.id, compensate=True, actor="operator")
    api.cancel(run.id, compensate=True, actor="operator")  # the same form, submitted twice
    run = drive(run.id)
    assert not pending_compensation(run), (
        f"run is {run.status} while its compensation {pending_compensation(run)} never ran: a second cancel cut "
        "the saga short; a started saga finishes, or stops visibly with what is left to undo (guarantee 9)"
    )
    assert landed(run, "ledger", "undo"), "the charge was never given back"


def test_cancel__a_plain_cancel_does_not_drop_a_pending_compensating_cancel():
    """Shrunk: pause_worker(charge:body); cancel(compensate=True); release_worker; cancel(compensate=False)."""
    run = start("machine_order")
    worker = PausedWorker(run.id, "charge:body")
    assert worker.start()
    api.cancel(run.id, compensate=True, actor="alice")  # a worker holds the run: the cancel is requested
    worker.release()
    assert worker.outcome is Outcome.COMMITTED and landed(run, "ledger"), "the charge committed before the cancel"
    api.cancel(run.id, actor="bob")  # a second operator, without compensation, before the request settled
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert landed(run, "ledger", "undo"), (
        "the compensating cancel requested first was silently dropped by a later plain cancel (while a later "
        "compensating request after a plain one is ignored): an undo an operator asked for must happen or "
        "be refused visibly (guarantee 9)"
    )


def test_saga__compensation_does_not_skip_an_external_effect_of_unknown_outcome():
    """Shrunk: pause_worker(ship:after_land); expire_waits; cancel(compensate=True); take_over (here: a lost answer)."""
    run = start("machine_order")
    assert advance(run.id) is Outcome.COMMITTED, "charged"
    control.fault_next_ship(run.id, "after")
    assert advance(run.id) is Outcome.RETRY, "the parcel left, but the answer timed out: outcome unknown"
    shipped = Effect.objects.get(run=run, tool="machine_ship")
    assert shipped.status == "pending" and landed(run, "shipping")
    api.cancel(run.id, compensate=True, actor="operator")
    run = drive(run.id)
    shipped.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert landed(run, "shipping", "undo") or shipped.needs_attention, (
        f"the saga ended {run.status} with the shipment (outbox {shipped.status}) neither called back nor flagged "
        "for an operator: compensation skipped an effect whose outcome it did not know (guarantee 9)"
    )


def test_rerun__during_compensation_does_not_abandon_the_saga():
    """Shrunk: advance; rerun(refund); advance (fails, compensating); rerun(refund); advance (here: a rejection)."""
    run = drive(start("machine_saga").id)
    api.decide(open_wait(run).pk, False, by="alice")
    assert advance(run.id) is Outcome.COMPENSATING, "the rejection fails the run, which first undoes its charge"
    with pytest.raises(api.InvalidTransitionError, match="compensat"):
        api.resume(run.id, from_step="approve", actor="operator")  # refused mid-compensation: the fix
    run = drive(run.id)
    assert not (run.is_finished and pending_compensation(run)), (
        f"run ended {run.status} with compensation {pending_compensation(run)} never run: a rerun accepted in the "
        "middle of a saga abandoned it (guarantee 9)"
    )
    assert landed(run, "ledger", "undo"), "the charge was never given back"


def test_sweep__a_deadline_after_a_rerun_mid_compensation_does_not_crash_it():
    """Shrunk: advance; expire_waits x2 (the deadline fails the run: compensating); rerun(charge); advance x2;
    expire_waits."""
    run = drive(start("machine_saga").id)
    clock.advance(DEADLINE + timedelta(seconds=1))
    sweep()
    assert Run.objects.get(pk=run.id).finish_as == RunStatus.FAILED, "the deadline failed the run: it compensates"
    with pytest.raises(api.InvalidTransitionError, match="compensat"):
        api.resume(run.id, from_step="charge", actor="operator")  # refused mid-compensation: the fix
    run = drive(run.id)
    assert run.status == RunStatus.FAILED and landed(run, "ledger", "undo"), "the saga finished"
    clock.advance(DEADLINE + timedelta(seconds=1))
    try:
        sweep()
    except IntegrityError as exc:
        raise AssertionError(
            f"the sweep crashed on this run's deadline ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
            "it would crash on every pass from now on. The rerun copied the run's pending compensation step, "
            "and the deadline's compensation planned it again under the same step id"
        ) from exc


def test_fork__of_a_compensating_run_does_not_copy_its_compensation_steps():
    """Shrunk: advance_once; cancel(compensate=True); fork(at charge); drive(fork); cancel(fork, compensate=True)."""
    source = start("machine_order")
    assert advance(source.id) is Outcome.COMMITTED, "charged"
    api.cancel(source.id, compensate=True, actor="operator")
    with pytest.raises(api.InvalidTransitionError, match="compensating"):
        api.fork(source.id, "charge", actor="operator")  # the fix: refused while its saga is under way
    source = drive(source.id)
    fork = api.fork(source.id, "charge", actor="operator")  # once the saga finished: a fresh start
    copied = list(Step.objects.live().filter(run=fork, kind=StepKind.COMPENSATE).values_list("step_id", "args"))
    assert not copied, (
        f"the fork's plan carries its source's compensation steps {copied}: it would undo the source's effects as "
        "ordinary steps, and its own compensation later collides with them"
    )
    fork = drive(fork.id)
    api.cancel(fork.id, compensate=True, actor="operator")


def test_rerun__after_a_compensated_cancel_does_not_take_the_undone_charge_as_applied():
    """Shrunk: drive; expire_waits (fails, compensates); advance_once; rerun(charge); drive; expire_waits."""
    run = drive(start("machine_saga").id)
    api.cancel(run.id, compensate=True, actor="operator")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED and landed(run, "ledger", "undo"), "the charge was given back"
    with pytest.raises(api.InvalidTransitionError, match="durable_fork"):
        api.resume(run.id, from_step="charge", actor="operator")  # refused: the work starts again as a fork
    run = drive(api.fork(run.id, "charge", actor="operator").id)
    api.decide(open_wait(run).pk, True, by="alice")
    run = drive(run.id)
    charges, refunds = len(landed(run, "ledger")), len(landed(run, "ledger", "undo"))
    assert not (landed(run, "shipping") and charges <= refunds), (
        f"the rerun shipped the order with no charge in force ({charges} charge(s), {refunds} given back): the "
        "compensated charge was taken as applied when its step ran again"
    )
    assert run.status == RunStatus.COMPLETED and not pending_compensation(run), (
        f"the rerun ran every step yet ended {run.status} with compensation {pending_compensation(run)} left over: "
        "a rerun kept the old saga's plan and outcome"
    )


def test_fork__with_the_same_input_does_not_ship_on_a_charge_its_source_undid():
    """Shrunk: advance_once x2 (charged, waiting); decide_from_form(reject); fork(at charge); advance both; approve."""
    source = start("machine_saga")
    assert advance(source.id) is Outcome.COMMITTED and advance(source.id) is Outcome.WAITING
    fork = api.fork(source.id, "charge", actor="operator")  # same input: the fork shares the source's charge
    api.decide(open_wait(source).pk, False, by="alice")
    source = drive(source.id)
    assert source.status == RunStatus.FAILED and landed(source, "ledger", "undo"), "the source gave its charge back"
    fork = drive(fork.id)
    if fork.status == RunStatus.FAILED and "compensated" in fork.error["message"]:
        return  # the fix: the fork stops on the undone charge, saying so, and ships nothing
    api.decide(open_wait(fork).pk, True, by="bob")
    fork = drive(fork.id)
    charges, refunds = len(landed(fork, "ledger")), len(landed(fork, "ledger", "undo"))
    assert not (landed(fork, "shipping") and charges <= refunds), (
        f"the fork {fork.status} and shipped on its source's charge, which the source's saga had given back "
        f"({charges} charge(s), {refunds} given back): a shared effect was undone under the run relying on it"
    )


# --- 9. A decision means what the decider saw ---------------------------------------------------------------


def test_approval__a_re_plan_does_not_reuse_an_approval_for_other_arguments():
    """Shrunk: drive; approve; expire_waits (the observation goes stale); change_order(80.00); drive."""
    run = drive(start("machine_order", amount="60.00").id)
    wait = open_wait(run)
    assert wait.kind == WaitKind.APPROVAL and '"60.00"' in wait.question, "the approval shows a refund of 60.00"
    api.decide(wait.pk, True, by="alice")
    MachineOrder.objects.filter(order_id=run.input["order_id"]).update(amount=Decimal("80.00"))
    clock.advance(FRESH_FOR + timedelta(seconds=1))  # the observation went stale: the refund step re-plans
    run = drive(run.id)
    refunds = [c.args["amount"] for c in landed(run, "ledger") if c.idempotency_key.endswith(":machine_refund:1")]
    approved = [w.question for w in Wait.objects.filter(run=run, kind=WaitKind.APPROVAL, status=WaitStatus.APPROVED)]
    assert all(any(f'"{amount}"' in q for q in approved) for amount in refunds), (
        f"refunded {refunds} under approvals that showed {approved}: an approval authorises exactly the call it "
        "showed; a changed call asks again (guarantee 9)"
    )


def test_fork__past_an_undecided_approval_does_not_skip_it():
    """Shrunk: pause_worker (charged); drive (waiting for approval); fork(at ship); drive(fork)."""
    source = drive(start("machine_saga").id)
    assert source.status == RunStatus.WAITING, "the source waits for its approval"
    try:
        fork = api.fork(source.id, "ship", actor="operator")
    except InvalidTransitionError:
        return  # refusing the fork is a fix too
    fork = drive(fork.id)
    assert not landed(fork, "shipping"), (
        f"the fork shipped (ended {fork.status}, steps not done: {unfinished_steps(fork)}) although nobody approved: "
        "a fork past a step its source never finished skips it (guarantee 9)"
    )


def test_rerun__from_a_step_after_a_rejected_approval_does_not_bypass_it():
    """Shrunk: drive; expire_waits (the deadline fails the run); advance_once (compensated); rerun(ship); drive."""
    run = drive(start("machine_saga").id)
    api.decide(open_wait(run).pk, False, by="alice")
    run = drive(run.id)
    assert run.status == RunStatus.FAILED, "rejected: the run fails and gives the charge back"
    try:
        api.resume(run.id, from_step="ship", actor="operator")
    except InvalidTransitionError:
        return  # refusing the rerun is a fix too
    run = drive(run.id)
    assert not landed(run, "shipping"), (
        f"a rerun from 'ship' shipped an order whose approval was rejected (ended {run.status}): a rerun from a "
        "step after one that never succeeded jumps over it (guarantee 9)"
    )


def test_rerun__from_a_step_the_run_never_reached_does_not_skip_the_steps_before_it():
    """Shrunk: start; rerun(done); advance."""
    run = start("machine_order")
    try:
        api.resume(run.id, from_step="done", actor="operator")
    except InvalidTransitionError:
        return  # refusing the rerun is a fix too
    run = drive(run.id)
    assert not (run.status == RunStatus.COMPLETED and unfinished_steps(run)), (
        f"the run completed without ever running {unfinished_steps(run)}: a rerun from a step the run never "
        "reached jumped over the steps before it"
    )
