"""A worker that lost its step (a zombie thawed after its lease, a step re-run under it) changes nothing:
its checkpoint does not move the run, it does not ship after the saga decided, it does not consume a re-run step's
signal.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone

import durable_agents.waits as step_waits
from durable_agents import api, clock
from durable_agents.engine import advance as advance_module
from durable_agents.engine import effects
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.waits import sweep_waits
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Effect, Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive
from durable_agents.testing.receiver import IdempotentReceiver

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


@pytest.fixture
def carrier():
    with IdempotentReceiver() as receiver:
        yield receiver


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
    """A worker pauses after its lease was proven and its call counted, right before it sends the call (as it gives
    its pooled connection back: engine/effects.py _call_external); its lease runs out and the run is cancelled with
    compensation. The saga must take the counted invocation for one of unknown outcome and undo it: the zombie
    thaws and ships (the receiver has never seen the key, so it lands). Were the proof and the count two
    statements, a pause between them would leave `pending, attempts=0`, which the saga takes for never invoked: a
    cancelled run with an applied shipment nobody undoes or flags."""
    original = effects.release_connection
    state = {"paused": False}
    run = api.start("ship_then_hold", {"order_id": "ZS-1", "url": carrier.url})

    def pauses_before_the_call(**kwargs):
        if not state["paused"]:
            state["paused"] = True
            _expire_lease(run.id)  # paused right after the proof: the lease runs out
            _in_another_connection(lambda: (api.cancel(run.id, "customer cancelled", compensate=True), drive(run.id)))
        original(**kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(effects, "release_connection", pauses_before_the_call)
        advance(run.id)
    assert state["paused"], "the worker never reached its call"
    run = Run.objects.get(pk=run.id)
    effect = Effect.objects.get(run=run, tool="ship")
    paths = [r.path for r in carrier.requests]
    assert run.status == RunStatus.CANCELLED
    assert not ("/ship" in paths and "/unship" not in paths and not effect.needs_attention), (
        "guarantee 4/9 (a zombie never applies an effect; a saga is never silently half-done): the zombie shipped "
        f"after the run was cancelled with compensation; effect {effect.status}, carrier saw {paths}"
    )
