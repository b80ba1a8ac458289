"""Adversarial review: each test here is a hole in a guarantee of DESIGN.md §2, shown by a deterministic
interleaving (hooks, monkeypatched seams, threads joined before the next act; no sleeps for timing).

A test FAILS while the hole is open. Each assertion message names the broken guarantee. Where the obvious fix
is to refuse the operator's action, the test accepts that refusal (InvalidTransitionError) too.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connections
from django.test import override_settings
from django.utils import timezone

import durable_agents.waits as step_waits
from durable_agents import api, clock
from durable_agents.api import PlannedStep, StepContext, approval, call, tool, workflow
from durable_agents.engine import advance as advance_module
from durable_agents.engine import transitions
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.waits import sweep_waits
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Effect, EffectStatus, Run, RunStatus, Step, StepStatus, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.testing.receiver import IdempotentReceiver
from durable_agents.tools import tools
from durable_agents.workflows import registry
from tests.conftest import ROOT
from tests.testapp.models import LedgerEntry
from tests.testapp.trust import HOOKS, hook
from tests.testapp.workflows import _charge_step, charge

pytestmark = pytest.mark.django_db(transaction=True)

ATTACK = {"refuse": False}


@pytest.fixture(autouse=True)
def _clean():
    HOOKS.clear()
    ATTACK["refuse"] = False
    yield
    HOOKS.clear()
    ATTACK["refuse"] = False
    clock.reset()


@pytest.fixture
def carrier():
    with IdempotentReceiver() as receiver:
        yield receiver


# --- Workflows of the attacks -------------------------------------------------------------------------------


@tool(effectful=True, transactional=True, compensate="refund_charge", name="atk_refusable_charge")
def refusable_charge(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
    """A ledger charge (undone by refund_charge) that the ledger refuses while ATTACK["refuse"] is set."""
    if ATTACK["refuse"]:
        raise ValueError("the ledger refused the charge")
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=amount, kind="charge")
    return {"charged": str(amount)}


def _refusable(ctx: StepContext) -> dict[str, Any]:
    return ctx.call_tool(refusable_charge, {"order_id": ctx.input["order_id"], "amount": "15.00"})


def _hooked(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"atk:{ctx.step_id}")
    if ctx.args.get("fail"):
        raise ValueError("the order data is malformed")  # a permanent failure
    return {"step": ctx.step_id}


workflow(
    "atk_refusable_then_hold",
    steps=[call("charge", _refusable), call("hold", _hooked)],
    replace=True,
)
# Two versions: v2 replaces the tail step with another (a different step id).
V1 = workflow("atk_versions", version=1, steps=[call("charge", _charge_step), call("hold", _hooked)], replace=True)
workflow(
    "atk_versions",
    version=2,
    steps=[call("charge", _charge_step), call("ship_later", _hooked)],
    on_missing_version="replan",
    replace=True,
)
DEADLINE_SAGA_STEPS = [
    call("charge", _charge_step),
    approval("ok", question="Ship?", deadline=timedelta(hours=1), on_deadline="fail"),
]
ATK_DEADLINE_V1 = workflow(
    "atk_deadline_saga",
    version=1,
    steps=[
        call("charge", _charge_step),
        approval("ok", question="Ship?", deadline=timedelta(hours=1), on_deadline="fail"),
    ],
    on_failure="compensate",
    replace=True,
)
workflow(
    "atk_deadline_saga",
    version=2,
    steps=[
        call("charge", _charge_step),
        approval("ok", question="Ship?", deadline=timedelta(hours=1), on_deadline="fail"),
    ],
    on_failure="compensate",
    on_missing_version="continue",
    replace=True,
)
workflow(
    "atk_charge_then_break_compensating",
    steps=[call("charge", _charge_step), call("work", _hooked)],
    plan=lambda inp: [
        PlannedStep("charge", "charge", {"amount": "10.00"}),
        PlannedStep("work", "work", {"fail": True}),
    ],
    on_failure="compensate",
    replace=True,
)
workflow(
    "atk_charge_then_work",
    steps=[call("charge", _charge_step), call("work", _hooked)],
    plan=lambda inp: [
        PlannedStep("charge", "charge", {"amount": "10.00"}),
        PlannedStep("work", "work", {"fail": bool(inp.get("fail"))}),
        *([PlannedStep("tail", "work")] if inp.get("tail") else []),
    ],
    replace=True,
)


# --- Helpers ------------------------------------------------------------------------------------------------


def _ledger(order_id: str) -> list[tuple[str, int]]:
    return list(LedgerEntry.objects.filter(order_id=order_id).order_by("id").values_list("kind", "amount"))


def _net(order_id: str) -> Decimal:
    return sum((amount for _, amount in _ledger(order_id)), Decimal(0))


def _charged_once(order_id: str) -> Run:
    """A two_charges run whose first charge (10.00) is applied; its cursor on charge-b; no worker holds it."""
    run = api.start("two_charges", {"order_id": order_id})
    assert advance(run.id) is Outcome.COMMITTED
    assert _ledger(order_id) == [("charge", 10)]
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


def _expire_lease(run_id: Any) -> None:
    """The holder paused past its lease (SIGSTOP, a GC storm): its lease is expired, nobody took it yet."""
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))


# --- Operators racing a saga --------------------------------------------------------------------------------


def test_migrate__replan_of_a_compensating_run_throws_its_saga_away():
    """cancel(compensate) plans compensate-1; migrate(replan=True) to v2 supersedes every not-done step from the
    cursor — the compensation step — and plans v2's remaining forward step instead. The run executes forward
    work and still ends `cancelled` (finish_as), its charge never refunded.

    (With the same version the migration crashes instead: the skipped forward steps are not superseded, and
    the re-planned copies hit durable_step_run_step_id_uniq — an IntegrityError, not a domain error.)"""
    run = api.start("atk_versions", {"order_id": "MIG-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True, actor="ops-1")
    with contextlib.suppress(InvalidTransitionError):  # refusing to migrate a compensating run is a fix
        api.migrate(run.id, 2, replan=True, actor="ops-2")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert _net("MIG-1") == 0, (
        "guarantee 9 (a saga, once started, finishes or stops visibly): a migration dropped the compensation "
        f"step and the run ended cancelled with its charge in place: {_ledger('MIG-1')}"
    )
    forward = Step.objects.filter(run=run, step_id="ship_later", status=StepStatus.DONE)
    assert not forward.exists(), "a run cancelled with compensation executed a forward step after its saga started"


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
    assert ("charge", 20) not in _ledger("RR-1"), (
        "guarantee 9/2: a run cancelled with compensation applied a NEW charge (charge-b) after its saga was "
        f"planned: {_ledger('RR-1')}"
    )
    assert _net("RR-1") == 0, f"a compensated run ended cancelled with money still charged: {_ledger('RR-1')}"


def test_cancel__a_requested_compensation_is_dropped_when_the_held_step_fails():
    """cancel(compensate=True) while a worker holds the run answers `requested`; the held step then fails
    permanently and fail_txn ends the run `failed` without looking at cancel_compensate: the charge stays,
    nothing says the requested compensation never happened."""
    run = api.start("atk_charge_then_work", {"order_id": "CR-1", "fail": True})
    assert advance(run.id) is Outcome.COMMITTED
    HOOKS["atk:work"] = lambda ctx: api.cancel(ctx.run_id, "customer cancelled", compensate=True, actor="ops")
    assert advance(run.id) in (Outcome.FAILED, Outcome.COMPENSATING)
    run = drive(run.id)
    assert _net("CR-1") == 0, (
        "guarantee 9/8: an accepted cancel-with-compensation was silently dropped when the running step failed; "
        f"run {run.status}, ledger {_ledger('CR-1')}"
    )


def test_cancel__a_requested_compensation_is_dropped_when_the_held_step_is_the_last():
    """Same request while the last step runs: its commit completes the run (COMPLETE ignores
    cancel_requested_at); the run ends `completed` with the charge the operator asked to undo."""
    run = api.start("atk_charge_then_work", {"order_id": "CR-2"})
    assert advance(run.id) is Outcome.COMMITTED
    HOOKS["atk:work"] = lambda ctx: api.cancel(ctx.run_id, "customer cancelled", compensate=True, actor="ops")
    advance(run.id)
    run = drive(run.id)
    assert not (run.status == RunStatus.COMPLETED and _net("CR-2") != 0), (
        "guarantee 9/8: a cancel(compensate=True) accepted as 'requested' ended as a completed run with its "
        f"charge in place: {_ledger('CR-2')}"
    )


# --- Operators and effects of unknown outcome ---------------------------------------------------------------


def test_resolve_effect__not_applied_while_the_call_is_in_flight_hides_a_landed_shipment(carrier):
    """resolve_effect does not look at the run's lease: an operator records `failed` while the worker's call is
    in flight; the call lands, _applied_txn's APPLY (pending→applied) matches 0 rows and is ignored, the step
    commits on the landed result, and the effect stays `failed`. A later cancel(compensate) plans nothing for
    it: the shipment is never called back."""

    def operator_records_not_applied(ctx):
        HOOKS.pop("after_ship")
        key = Effect.objects.get(run_id=ctx.run_id, tool="ship").idempotency_key
        with contextlib.suppress(InvalidTransitionError):  # refusing while a worker holds the run is a fix
            api.resolve_effect(key, False, actor="ops", reason="carrier shows nothing yet", resume=False)

    HOOKS["after_ship"] = operator_records_not_applied  # the carrier accepted the shipment; its answer is coming
    run = api.start("ship_then_hold", {"order_id": "RE-1", "url": carrier.url})
    assert advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True)
    run = drive(run.id)
    paths = [r.path for r in carrier.requests]
    assert paths.count("/unship") == 1, (
        "guarantee 2/9: the shipment landed (the step committed on its answer) but the effect is recorded "
        f"{Effect.objects.get(run=run, tool='ship').status}; the saga never undid it: {paths}"
    )


def test_resolve_effect__applied_after_the_saga_finished_leaves_it_half_done(carrier, settings):
    """A saga stopped on an unknown outcome; the operator recorded `failed` and the saga finished (cancelled).
    The operator later learns it landed and records `applied` (RESOLVE allows failed→applied): accepted, the
    run stays `cancelled` and refuses resume (compensated), and nothing will ever call the shipment back."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "EFFECT_MAX_INVOCATIONS": 1}

    def lost_answer(ctx):
        HOOKS.pop("after_ship")
        raise ConnectionResetError("the connection broke after the carrier accepted the shipment")

    HOOKS["after_ship"] = lost_answer
    run = api.start("ship_then_hold", {"order_id": "RE-2", "url": carrier.url})
    assert advance(run.id) is Outcome.RETRY
    api.cancel(run.id, "customer cancelled", compensate=True)
    run = drive(run.id)
    assert run.status == RunStatus.FAILED, "the saga stops: the outcome cannot be learned in 1 invocation"
    key = Effect.objects.get(run=run, tool="ship").idempotency_key
    api.resolve_effect(key, False, actor="ops", reason="carrier portal shows nothing")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    try:
        api.resolve_effect(key, True, result={"shipped": True}, actor="ops", reason="carrier found it after all")
    except InvalidTransitionError:
        return  # refusing to change the record of a finished saga is a fix (with a pointer to what to do)
    run = drive(run.id)
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.status != EffectStatus.APPLIED or run.status not in (RunStatus.CANCELLED, RunStatus.COMPLETED), (
        "guarantee 9 (never silently half-done): an effect recorded applied on a run that ended cancelled by its "
        "saga; nothing will undo it and the run cannot be resumed"
    )


# --- Forks sharing the source's effect scope ----------------------------------------------------------------


def test_fork__its_saga_does_not_undo_a_charge_it_applied_under_the_sources_failed_row():
    """A fork with the source's input shares its keys. The source's charge failed (effect `failed`, run_id =
    source); the fork retries it under the same key: the row flips failed→pending→applied but keeps
    run_id = source. Cancelling the fork with compensation lists effects by run_id, so the fork's own charge
    is never refunded."""
    ATTACK["refuse"] = True
    source = drive(api.start("atk_refusable_then_hold", {"order_id": "FK-1"}).id)
    assert source.status == RunStatus.FAILED
    ATTACK["refuse"] = False
    fork = api.fork(source.id, "charge", actor="ops")
    assert advance(fork.id) is Outcome.COMMITTED
    assert _ledger("FK-1") == [("charge", 15)], "the fork charged"
    api.cancel(fork.id, "customer cancelled", compensate=True)
    fork = drive(fork.id)
    assert fork.status == RunStatus.CANCELLED
    assert _net("FK-1") == 0, (
        "guarantee 9/2: the fork applied a charge and its cancel-with-compensation did not refund it "
        f"(the effect row belongs to the source run): {_ledger('FK-1')}"
    )


# --- Approvals and waits around operator actions --------------------------------------------------------------


def test_migrate__an_undecided_approval_counts_as_a_rejection():
    """migrate_run wakes a run parked on *any* wait (wake_txn) but closes only version-drift waits: the approval
    stays `open`, the step re-executes, sees a wait that is neither None nor cancelled and treats it as not
    approved. The run goes on as rejected that nobody rejected; the wait stays open and a later approve
    'succeeds' with no effect."""
    run = api.start("approve_charge", {"order_id": "MA-1"})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.WAITING
    with contextlib.suppress(InvalidTransitionError):
        api.migrate(run.id, 1, actor="ops")
    run = drive(run.id)
    wait = Wait.objects.get(run=run, kind="approval")
    approve = Step.objects.live().get(run=run, step_id="approve")
    assert not (approve.status == StepStatus.DONE and wait.status == WaitStatus.OPEN), (
        "guarantee 9 (a decision means what the decider saw): the approval step completed with "
        f"{approve.result} while its wait is still open — nobody decided"
    )


def test_signal__a_zombie_consumes_a_buffered_signal_of_a_re_run_step():
    """A buffered signal is bound to a step row by an unfenced UPDATE. A worker paused past its lease; an
    operator re-ran the run from the signal step (new row); the thawed zombie binds the buffered signal to the
    superseded row, then its park is rejected. The fresh step finds no signal: the run waits forever for a
    signal that was delivered."""
    run = api.start("signal_flow", {})
    api.send_signal(run.id, "payment.confirmed", {"amount": "10.00"}, by="bank")
    original = step_waits.take_buffered_signal

    def paused_then_thawed(step, name, **fence):
        _expire_lease(step.run_id)
        api.resume(step.run_id, from_step="paid", actor="ops")  # the operator re-runs from the signal step
        return original(step, name, **fence)

    step_waits.take_buffered_signal = paused_then_thawed
    try:
        assert advance(run.id) is Outcome.LEASE_LOST
    finally:
        step_waits.take_buffered_signal = original
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, (
        "guarantee 4 (a zombie never applies an effect): a zombie consumed the delivered signal; the live step "
        f"waits for it forever (run {run.status})"
    )


# --- Sagas cut short by the engine itself -------------------------------------------------------------------


def test_cancel__a_request_recorded_before_an_on_failure_saga_cuts_that_saga_short():
    """A bulk cancel hits a run while its step runs: `requested` (cancel_requested_at set). The step then fails
    and the workflow compensates on failure: fail_txn plans the saga but leaves cancel_requested_at set. The
    claim refuses runs with a pending cancel, so the next advance *settles* it: take_txn(CANCEL) has no
    finish_as fence and ends the run `cancelled` with its compensation step still pending."""
    run = api.start("atk_charge_then_break_compensating", {"order_id": "CS-1"})
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
        f"not done; ledger {_ledger('CS-1')}"
    )
    assert _net("CS-1") == 0, f"the charge was never refunded: {_ledger('CS-1')}"


def test_version_gone__the_replan_policy_throws_a_running_saga_away():
    """A deploy drops v1 while a v1 run compensates; v2 says on_missing_version="replan". The compensation
    step's claim finds no v1, _version_gone adopts v2 *with replan*: the compensation step is superseded and
    v2's remaining forward step planned. The run executes forward work and ends `cancelled`, charge intact."""
    run = api.start("atk_versions", {"order_id": "VG-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True)
    registry.unregister("atk_versions", 1)  # the deploy removed v1
    try:
        run = drive(run.id)
    finally:
        registry.register(V1, replace=True)
    assert _net("VG-1") == 0, (
        f"guarantee 9 (a saga, once started, finishes or stops visibly): the run ended {run.status} after a "
        f"version re-plan replaced its compensation with forward steps: {_ledger('VG-1')}"
    )


# --- Forks and shared effect scopes -------------------------------------------------------------------------


def test_fork__of_a_compensating_source_copies_its_compensation_steps_and_completes_having_refunded():
    """fork_run copies the source's live plan. Forking a source whose saga is planned (no effect compensated
    yet, so the scope is shared) copies the compensation steps as pending steps of a forward run (finish_as is
    not copied): the fork runs hold/after, then refunds both charges, and ends `completed`."""
    run = api.start("two_charges", {"order_id": "FC-1"})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True)
    try:
        fork = api.fork(run.id, "hold", actor="ops")
    except InvalidTransitionError:
        return  # refusing to fork a compensating run is a fix
    fork = drive(fork.id)
    kinds = list(Step.objects.live().filter(run=fork, kind="compensate").values_list("step_id", "status"))
    assert not (fork.status == RunStatus.COMPLETED and kinds), (
        "guarantee 9/2: a forked forward run executed the source's compensation steps "
        f"{kinds} and ended completed; ledger {_ledger('FC-1')}"
    )


def test_fork__its_saga_undoes_a_charge_the_completed_source_reused():
    """A fork of an active source (same input: shared scope) runs charge-b first; its Effect row has run_id =
    fork. The source then reaches charge-b, finds the key applied and reuses it, and completes. Cancelling the
    fork with compensation refunds charge-b: the completed source's charge is undone by another run's saga."""
    source = _charged_once("FS-1")
    fork = api.fork(source.id, "charge-b", actor="ops")
    assert advance(fork.id) is Outcome.COMMITTED  # the fork charges 20.00 under the shared key
    source = drive(source.id)
    assert source.status == RunStatus.COMPLETED
    assert _ledger("FS-1") == [("charge", 10), ("charge", 20)], "the source reused the fork's charge"
    api.cancel(fork.id, "fork abandoned", compensate=True)
    drive(fork.id)
    assert _net("FS-1") == 30, (
        f"guarantee 2/9: the fork's saga refunded a charge the completed source run relies on: {_ledger('FS-1')}"
    )


def test_fork__the_sources_saga_undoes_charges_a_completed_fork_relies_on():
    """The reverse order of the fork check: fork_run refuses to share the scope of a source that compensated,
    but nothing stops the source compensating after the fork. The fork copies charge-a/-b as checkpoints and
    completes; then the source is cancelled with compensation and refunds both: the completed fork's
    checkpoints now describe charges that no longer exist."""
    run = api.start("two_charges", {"order_id": "FR-1"})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.COMMITTED
    fork = drive(api.fork(run.id, "hold", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED
    api.cancel(run.id, "source abandoned", compensate=True)
    drive(run.id)
    assert _net("FR-1") == 30, (
        f"guarantee 2/9: the source's saga refunded the charges the completed fork was built on: {_ledger('FR-1')}"
    )


# --- The fenced checkpoint ----------------------------------------------------------------------------------


def test_checkpoint__moves_the_run_past_a_step_it_did_not_write():
    """Two defects chained (reached through the migrate hole above, which leaves an approval open on a running
    run):
    1. the "fail" deadline policy (fail_txn with claim=None) marks the step FAILED *before* its fence on the
       run (status=waiting) fails, and keeps that write (returns False, the transaction commits);
    2. hotpath.commit_checkpoint's run UPDATE is a data-modifying CTE: it moves the cursor and releases the
       lease even when the step UPDATE matches 0 rows (the step is no longer live). The worker is told
       LEASE_LOST ("nothing was written") though it held the lease, and the run then completes past a FAILED
       step whose deadline policy said to fail the run."""
    run = api.start("deadline_fail", {})
    assert advance(run.id) is Outcome.WAITING
    try:
        api.migrate(run.id, 1, actor="ops")
    except InvalidTransitionError:
        return  # the precondition (an open wait on a running run) is gone
    original = advance_module.store_result

    def deadline_passes_meanwhile(*args, **kwargs):
        clock.advance(timedelta(hours=2))
        _in_another_connection(sweep_waits)  # the sweep applies the "fail" policy while the step runs
        return original(*args, **kwargs)

    advance_module.store_result = deadline_passes_meanwhile
    try:
        outcome = advance(run.id)
    finally:
        advance_module.store_result = original
    run = Run.objects.get(pk=run.id)
    approve = Step.objects.live().get(run=run, step_id="approve")
    assert not (run.cursor == 1 and approve.status != StepStatus.DONE), (
        f"guarantee 1/4: the fenced checkpoint (outcome {outcome}) moved the cursor past step 'approve' and "
        f"released the lease without writing its checkpoint (step {approve.status})"
    )
    run = drive(run.id)
    assert run.status != RunStatus.COMPLETED, "a run completed past a FAILED step whose deadline policy was 'fail'"


# --- Zombies and the saga's view of an effect ----------------------------------------------------------------


def test_effects__a_zombie_thawed_after_its_lease_proof_ships_after_the_saga_decided_there_was_nothing_to_undo(
    carrier,
):
    """_apply_external proves the lease, *then* counts the invocation (attempts+1) in a separate statement. A
    worker paused between the two leaves attempts=0; cancel(compensate) treats `pending, attempts=0` as never
    invoked and plans nothing; the run ends cancelled. The zombie thaws, counts, ships (the receiver has never
    seen the key, so it lands), records `applied`: a cancelled run with an applied shipment nobody undoes or
    flags. Counting the invocation in the same statement as the lease proof would let the saga see it."""
    original = StepContext.ensure_lease
    state = {"paused": False}

    def proves_then_pauses(self):
        original(self)
        if not state["paused"]:
            state["paused"] = True
            _expire_lease(self.run_id)  # paused right after the proof: the lease runs out
            _in_another_connection(
                lambda: (api.cancel(self.run_id, "customer cancelled", compensate=True), drive(self.run_id))
            )

    StepContext.ensure_lease = proves_then_pauses
    try:
        run = api.start("ship_then_hold", {"order_id": "ZS-1", "url": carrier.url})
        advance(run.id)
    finally:
        StepContext.ensure_lease = original
    run = Run.objects.get(pk=run.id)
    effect = Effect.objects.get(run=run, tool="ship")
    paths = [r.path for r in carrier.requests]
    assert run.status == RunStatus.CANCELLED
    assert not ("/ship" in paths and "/unship" not in paths and not effect.needs_attention), (
        "guarantee 4/9 (a zombie never applies an effect; a saga is never silently half-done): the zombie shipped "
        f"after the run was cancelled with compensation; effect {effect.status}, carrier saw {paths}"
    )


def test_saga__an_effect_whose_tool_was_renamed_is_silently_left_undone():
    """compensable_effect_keys drops effects whose tool is no longer registered (compensator_name → None). After
    a deploy that renamed the tool, cancel(compensate) finds nothing to undo and ends `cancelled` as if the
    saga had run; nothing in the run says the charges were left in place."""
    run = api.start("two_charges", {"order_id": "TR-9"})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.COMMITTED
    tools.unregister("charge")  # the deploy renamed it
    try:
        run = api.cancel(run.id, "customer cancelled", compensate=True)
        run = drive(run.id)
    finally:
        tools.register(charge)
    left = (run.error or {}).get("left_to_undo") or []
    assert _net("TR-9") == 0 or (run.status == RunStatus.FAILED and left), (
        "guarantee 9 (a saga finishes or stops visibly with what is left to undo): the run ended "
        f"{run.status} with its charges in place and nothing left to undo on record: {_ledger('TR-9')}"
    )


# --- Hostile input to durable_effect -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        ["--applied", "--result", "NaN"],
        ["--applied", "--result", '"\\u0000"'],
        ["--applied", "--as", "x" * 300],
    ],
    ids=["nan-result", "nul-in-result", "long-actor"],
)
def test_durable_effect__hostile_input_is_a_one_line_error_not_a_traceback(worker_env, carrier, extra):
    """The command's domain errors are one line and exit 2. Values Postgres refuses (NaN or \\u0000 in jsonb, an
    actor longer than the column) escape as a DataError traceback instead."""

    def broken(ctx):
        raise ConnectionResetError("connection reset")

    HOOKS["before_post"] = broken
    with override_settings(DURABLE_AGENTS={"EFFECT_MAX_INVOCATIONS": 1}):
        run = drive(api.start("ship_then_hold", {"order_id": "HI-1", "url": carrier.url}).id)
    HOOKS.clear()
    effect = Effect.objects.get(run=run)
    done = subprocess.run(
        [sys.executable, "-m", "django", "durable_effect", effect.idempotency_key, *extra],
        cwd=ROOT,
        env={**worker_env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, (
        "guarantee 8 (nothing fails silently; errors with a hint): durable_effect crashed on hostile input "
        f"(exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    )
    assert Effect.objects.get(pk=effect.pk).status == EffectStatus.PENDING


# --- Deadlines ---------------------------------------------------------------------------------------------


def test_deadline__fail_policy_skips_the_saga_once_the_runs_version_is_gone():
    """The sweep's "fail" policy asks `_compensates_on_failure(run)`, which reads the run's *pinned* version
    and answers False when that version is no longer registered. After a deploy that dropped v1 (v2 says
    "continue", and compensates on failure too), the deadline fails the run without undoing its charge, and
    nothing says what was left."""
    run = api.start("atk_deadline_saga", {"order_id": "DS-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.WAITING
    registry.unregister("atk_deadline_saga", 1)
    try:
        clock.advance(timedelta(hours=2))
        sweep_waits()
        run = drive(run.id)
    finally:
        registry.register(ATK_DEADLINE_V1, replace=True)
    assert run.status == RunStatus.FAILED
    left = (run.error or {}).get("left_to_undo") or []
    assert _net("DS-1") == 0 or left, (
        "guarantee 9 (a saga finishes or stops visibly): the deadline failed a compensate-on-failure run "
        f"without compensating because its version was unregistered: {_ledger('DS-1')}"
    )


def test_decide__an_approval_after_its_deadline_passed_is_accepted_if_the_sweep_is_late():
    """decide_wait checks only that the wait is open, never its deadline (on the database clock). Until the
    sweep gets to it, an approval past a "fail" deadline is accepted and the run goes on: the declared
    deadline policy depends on the sweep's timing."""
    run = api.start("deadline_fail", {})
    assert advance(run.id) is Outcome.WAITING
    wait = Wait.objects.get(run=run)
    clock.advance(timedelta(hours=2))  # an hour past the deadline; the sweep has not run yet
    with contextlib.suppress(InvalidTransitionError):  # refusing a decision past the deadline is a fix
        api.decide(wait.pk, True, by="late-approver")
    run = drive(run.id)
    assert run.status != RunStatus.COMPLETED, (
        "guarantee 4/9 (deadlines on the database's clock; a deadline applies its declared policy): an approval "
        "an hour past a 'fail' deadline was accepted and the run completed"
    )


# --- Forks past the source's cursor ---------------------------------------------------------------------------


def test_fork__at_a_step_past_the_sources_cursor_completes_without_running_the_steps_in_between():
    """fork_run copies every step before `at_step` *with its status* and puts the cursor on `at_step`. Forking at
    a step beyond the source's cursor copies charge-b as `pending` behind the cursor: the fork never executes
    it and ends `completed` with a plan step that never ran (the order is never charged 20.00)."""
    source = _charged_once("FP-1")  # cursor on charge-b
    with pytest.raises(InvalidTransitionError, match="'charge-b' .* has no checkpoint"):
        api.fork(source.id, "hold", actor="ops")  # guarantee 1/8: a fork never skips a step that never ran
    fork = drive(api.fork(source.id, "charge-b", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED
    assert sorted(amount for kind, amount in _ledger("FP-1") if kind == "charge") == [10, 20]
