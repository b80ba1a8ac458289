"""Resolving an effect reopens its run's saga: a stopped saga's failed compensation step can run again, a
finished keyed run is admitted on its key, and a running saga's worker is not fenced on its last step.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from durable_agents import api, clock
from durable_agents.api import PlannedStep, call, workflow
from durable_agents.engine import advance as advance_module
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Effect, Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive
from tests.integration.interleavings import in_another_connection, joined
from tests.integration.outside_carrier import CARRIER, _send

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


def _in_another_connection(action) -> Any:
    """Run `action` in a thread with its own connection and wait for it to finish."""
    thread, out = in_another_connection(action)
    return joined(thread, out)


def _expire_lease(run_id: Any) -> None:
    """The holder paused past its lease (SIGSTOP, a GC storm): its lease is expired, nobody took it yet."""
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))


def _pending_compensation(run: Run) -> list[tuple[str, str]]:
    return list(
        Step.objects.live()
        .filter(run=run, kind="compensate")
        .exclude(status=StepStatus.DONE)
        .values_list("step_id", "status")
    )


# --- resolve_effect reopening a saga ----------------------------------------------------------------------------

workflow(
    "carrier_send_two",
    steps=[call("send", _send)],
    plan=lambda inp: [
        PlannedStep("send-a", "send", {"order": f"{inp['order_id']}-A"}),
        PlannedStep("send-b", "send", {"order": f"{inp['order_id']}-B"}),
    ],
    on_failure="compensate",
    replace=True,
)


def _key(run: Run, order: str) -> str:
    return Effect.objects.get(tool="carrier_send", args__order_id=order, kind="effect").idempotency_key


def _drive_through_lease_expiries(run_id: Any, rounds: int = 40) -> Run:
    """drive(), waiting out (on the test clock) any lease a rejected step left held."""
    for _ in range(rounds):
        try:
            return drive(run_id)
        except AssertionError:
            clock.advance(timedelta(minutes=1))
    return Run.objects.get(pk=run_id)


def test_resolve_effect__reopening_a_stopped_saga_leaves_its_failed_compensation_step_unrunnable():
    """A saga stopped on a failed compensation step (the run is `failed`, its cursor on compensate-1). The
    operator then learns that send-b, which the carrier had refused, shipped after all, and records it
    applied. reopen_saga_txn plans compensate-2 and moves the run failed→pending with RunOp.RESUME — but,
    unlike resume_txn, it never resets the failed step under the cursor. The claim loads compensate-1
    (`failed`), runs its call-back (which lands), and its checkpoint is refused (a failed step is not live):
    `lease_lost`, again on every lease expiry, until the crash-loop guard fails the run with compensate-2
    never run: the shipment the operator just reported stays shipped."""
    CARRIER["mode:RO-1-B"] = "refuse"
    CARRIER["unsend"] = "broken"  # and the carrier's call-back desk is down
    run = drive(api.start("carrier_send_two", {"order_id": "RO-1"}).id)  # send-b refused: the saga starts, stops
    assert run.status == RunStatus.FAILED and run.finish_as == RunStatus.FAILED, "the saga stopped visibly"
    assert _pending_compensation(run) == [("compensate-1", "failed")]
    CARRIER.pop("unsend")  # the desk is back
    key_b = _key(run, "RO-1-B")
    api.resolve_effect(key_b, True, result={"shipped": "RO-1-B"}, actor="ops", reason="the carrier shipped it")
    run = _drive_through_lease_expiries(run.id)
    assert CARRIER.get(f"{key_b}:compensate") == "unshipped" and not _pending_compensation(run), (
        "guarantee 9 (a saga finishes or stops visibly with what is left to undo): after resolve_effect reopened "
        f"the saga the run ended {run.status} ({(run.error or {}).get('type')}) with compensation "
        f"{_pending_compensation(run)} not done; the reported shipment was not called back: {CARRIER}"
    )


def test_resolve_effect__reopening_a_finished_keyed_runs_saga_admits_it_on_its_key():
    """A keyed run's saga ended (send-b refused, send-a called back). The operator learns send-b shipped after all:
    the reopened saga takes the run back from `failed`, so it queues for its key again — and is admitted at once
    when the key is free (it was left queued until some sweep), or waits its turn behind the key's holder."""
    from durable_agents.engine.admission import holders

    CARRIER["mode:RK-1-B"] = "refuse"
    run = drive(api.start("carrier_send_two", {"order_id": "RK-1"}, concurrency_key="rk-customer").id)
    assert run.status == RunStatus.FAILED and run.finish_as == RunStatus.FAILED
    api.resolve_effect(_key(run, "RK-1-B"), True, result={"shipped": "RK-1-B"}, actor="ops")
    assert holders("rk-customer") == [run.id], "the reopened saga was left queued on a free key"
    run = drive(run.id)
    assert CARRIER.get(f"{_key(run, 'RK-1-B')}:compensate") == "unshipped" and not _pending_compensation(run)


def test_resolve_effect__reopening_a_running_saga_does_not_fence_the_worker_on_its_last_step():
    """The saga runs its last compensation step (compensate-1). Its worker pauses after the call-back, past its
    lease (a GC pause, SIGSTOP). The lease is expired, so resolve_effect does not refuse: the operator records
    send-b (refused by the carrier) as shipped after all, and reopen_saga_txn appends compensate-2 with
    RunOp.TAKE through move_run — no token bump, unlike take_txn. The thawed worker still holds the token; its
    claim says compensate-1 is the last step, so its checkpoint ends the run `failed` as the saga said, with
    compensate-2 pending forever and the reported shipment never called back."""
    CARRIER["mode:RZ-1-B"] = "refuse"
    run = api.start("carrier_send_two", {"order_id": "RZ-1"})
    assert advance(run.id) is Outcome.COMMITTED  # send-a shipped
    assert advance(run.id) is Outcome.COMPENSATING  # send-b refused: compensate-1 (send-a) planned
    key_b = _key(run, "RZ-1-B")
    original = advance_module.store_result

    def paused_past_the_lease_then_the_operator_acts(*args, **kwargs):
        advance_module.store_result = original
        _expire_lease(run.id)
        _in_another_connection(
            lambda: api.resolve_effect(key_b, True, result={"shipped": "RZ-1-B"}, actor="ops", resume=False)
        )
        return original(*args, **kwargs)

    advance_module.store_result = paused_past_the_lease_then_the_operator_acts
    try:
        outcome = advance(run.id)
    except InvalidTransitionError:
        outcome = None  # resolve_effect refusing while the worker's step is unfinished is a fix
    finally:
        advance_module.store_result = original
    run = Run.objects.get(pk=run.id)
    assert not (run.is_finished and _pending_compensation(run)), (
        "guarantee 4/9 (an operator's change fences any holder; a saga is never cut short): the paused worker's "
        f"checkpoint (outcome {outcome}) ended the run {run.status} with compensation "
        f"{_pending_compensation(run)} planned by resolve_effect never run: {CARRIER}"
    )
