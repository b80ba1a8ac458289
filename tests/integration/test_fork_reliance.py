"""Reliance between a source run and its forks: a charge that a fork (or a fork of a fork) relies on is never
undone by another run's saga, whichever lets go first or runs its saga concurrently.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from durable_agents import api
from durable_agents.api import PlannedStep, call, workflow
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Effect, RunStatus
from durable_agents.testing import drive, wait_for
from tests.integration.interleavings import in_another_connection, joined, ledger, net, someone_waits_for_a_lock
from tests.integration.outside_carrier import CARRIER, _plain
from tests.testapp.workflows import _charge_step

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


# --- Reliance: who may undo an effect several runs stand on ----------------------------------------------------

workflow(
    "three_charges_relied_on",
    steps=[call("charge", _charge_step), call("after", _plain)],
    plan=lambda inp: [
        PlannedStep("c1", "charge", {"amount": "10.00"}),
        PlannedStep("c2", "charge", {"amount": "20.00"}),
        PlannedStep("c3", "charge", {"amount": "30.00"}),
        PlannedStep("after", "after"),
    ],
    replace=True,
)


def test_reliance__the_first_run_to_let_go_keeps_standing_so_the_last_one_never_undoes():
    """A source and its fork (shared scope) both stand on charge-a/-b, owned by the source. The source is cancelled
    with compensation first: its saga keeps both for the fork ("compensation_kept") — and, with nothing left to
    undo, compensate_txn plans 0 steps, so the source ends a plain `cancelled` with finish_as "". _standing()
    counts a run as standing unless finish_as is cancelled/failed: the source still stands. The fork is then
    cancelled with compensation: both charges are kept *for the source*. Two runs cancelled with compensation,
    30.00 charged, nobody left to undo it."""
    source = api.start("two_charges", {"order_id": "RL-1"})
    assert advance(source.id) is Outcome.COMMITTED and advance(source.id) is Outcome.COMMITTED
    fork = api.fork(source.id, "hold", actor="ops")  # relies on charge-a and charge-b
    api.cancel(source.id, "customer cancelled", compensate=True, actor="ops")  # the fork still stands: kept
    drive(source.id)
    api.cancel(fork.id, "customer cancelled", compensate=True, actor="ops")  # the last to let go
    source, fork = drive(source.id), drive(fork.id)
    assert net("RL-1") == 0, (
        "guarantee 9/2 (the last run to let go of an effect undoes it): the source and its fork were both cancelled "
        f"with compensation ({source.status}/{source.finish_as!r}, {fork.status}/{fork.finish_as!r}) and the "
        f"charges stay: {ledger('RL-1')}"
    )


def test_reliance__a_fork_of_a_fork_relies_on_effects_of_steps_after_its_fork_point():
    """A runs c1, c2 and waits at c3. B = fork(A, at c2), shared scope: B reuses A's c2 (a Reliance row) and applies
    c3 itself (owns it). C = fork(B, at c2) with new input: C copies only c1's checkpoint, so it relies on c1 —
    but _recorded_before adds *every* effect B relies on, whatever the step: C relies on A's c2 too, though C
    never copied that checkpoint (its own c2 charges C's order). B is cancelled with compensation (undoes c3),
    then A: A's saga keeps c2 for C, which never used it. A's 20.00 is never refunded."""
    a = api.start("three_charges_relied_on", {"order_id": "FF-1"})
    assert advance(a.id) is Outcome.COMMITTED and advance(a.id) is Outcome.COMMITTED  # c1, c2; A waits at c3
    b = api.fork(a.id, "c2", actor="ops")
    assert advance(b.id) is Outcome.COMMITTED  # B reuses A's c2
    assert advance(b.id) is Outcome.COMMITTED  # B applies c3 (A has not): B owns it
    c = drive(api.fork(b.id, "c2", input={"order_id": "FF-2"}, actor="ops").id)  # a new request on c1's result
    assert c.status == RunStatus.COMPLETED
    api.cancel(b.id, "abandoned", compensate=True, actor="ops")
    drive(b.id)
    api.cancel(a.id, "customer cancelled", compensate=True, actor="ops")
    drive(a.id)
    assert ("refund", -20) in ledger("FF-1"), (
        "guarantee 9/2 (a saga undoes an effect once no run that relies on it stands): A's c2 was kept for fork C, "
        f"which forked before c2 and charged its own order; ledger {ledger('FF-1')}, C's {ledger('FF-2')}"
    )


def test_reliance__a_fork_that_applies_the_sources_in_flight_effect_is_not_recorded_as_relying_on_it():
    """The source's shipment is in flight with an unknown outcome (its answer was lost: `pending`, invoked once,
    owned by the source, which backs off to retry). A fork with the same input shares the key, calls again (the
    carrier dedupes) and records it `applied` — on the source's row, without a Reliance row (only a key found
    already applied records one). The fork completes on that shipment. Cancelling the source with compensation
    then finds its own applied effect that nobody relies on, and calls the completed fork's shipment back."""
    CARRIER["mode:IF-1"] = "lost"
    source = api.start("carrier_send_hold", {"order_id": "IF-1"})
    assert advance(source.id) is Outcome.RETRY  # shipped, answer lost: pending, attempts 1
    CARRIER["mode:IF-1"] = "ok"
    fork = drive(api.fork(source.id, "send", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED, "the fork shipped (the carrier deduped) and completed"
    api.cancel(source.id, "source abandoned", compensate=True, actor="ops")
    drive(source.id)
    key = Effect.objects.get(tool="carrier_send").idempotency_key
    assert CARRIER[key] == "shipped" and f"{key}:compensate" not in CARRIER, (
        "guarantee 2/9 (a saga never undoes an effect another standing run relies on): the source's saga called "
        f"back the shipment the completed fork {fork.id} was built on: {CARRIER}"
    )


def test_reliance__concurrent_sagas_of_a_source_and_its_fork_each_keep_the_shared_charge_for_the_other():
    """Write skew: the source A owns c1 and c2; fork B (new input, at c2) relies on c1 and owns its own c2. Both
    are cancelled with compensation at once (two operators, a bulk cancel on two workers). Each saga locks only
    its own run and reads the other's finish_as before the other commits: each sees the other standing and
    keeps c1 for it. Both sagas end; c1's 10.00 stays with nobody left to undo it."""
    a = api.start("three_charges_relied_on", {"order_id": "WS-1"})
    assert advance(a.id) is Outcome.COMMITTED and advance(a.id) is Outcome.COMMITTED  # c1, c2
    b = api.fork(a.id, "c2", input={"order_id": "WS-2"}, actor="ops")
    assert advance(b.id) is Outcome.COMMITTED  # B's own c2 (its own order)
    with transaction.atomic():
        api.cancel(a.id, "customer cancelled", compensate=True, actor="ops-a")  # uncommitted yet
        other = in_another_connection(lambda: api.cancel(b.id, "customer cancelled", compensate=True, actor="ops-b"))
        # B's saga must be planned while A's is uncommitted: it either finished, or waits for A's locks.
        wait_for(lambda: not other[0].is_alive() or someone_waits_for_a_lock(), timeout=30, what="B's cancel")
    joined(*other)
    a, b = drive(a.id), drive(b.id)
    assert net("WS-1") == 0, (
        "guarantee 9/2 (the last run to let go of an effect undoes it): A and its fork were both cancelled with "
        f"compensation ({a.status}, {b.status}) and each kept c1 for the other: {ledger('WS-1')}"
    )


def test_reliance__a_fork_of_a_compensating_source_stands_on_charges_its_planned_saga_then_refunds():
    """The source is cancelled with compensation: compensate-1/-2 are planned for charge-b/charge-a. An operator
    then forks it at `hold` (the forward steps before are done, so fork_run accepts): the fork copies the charge
    checkpoints and records that it relies on both charges. But the source's saga was planned before that
    reliance existed and a compensation step never looks again: it refunds both. The fork completes on
    checkpoints that describe charges that no longer exist."""
    source = api.start("two_charges", {"order_id": "FK2-1"})
    assert advance(source.id) is Outcome.COMMITTED and advance(source.id) is Outcome.COMMITTED
    api.cancel(source.id, "customer cancelled", compensate=True, actor="ops")  # saga planned, not run
    try:
        fork = api.fork(source.id, "hold", actor="ops")
    except InvalidTransitionError:
        return  # refusing to fork a source whose saga will undo what the fork would stand on is a fix
    fork = drive(fork.id)
    source = drive(source.id)
    assert not (fork.status == RunStatus.COMPLETED and net("FK2-1") == 0), (
        "guarantee 9/2 (a saga never undoes an effect another standing run relies on): the source's saga refunded "
        f"the charges the completed fork {fork.id} copied as checkpoints: {ledger('FK2-1')}"
    )
