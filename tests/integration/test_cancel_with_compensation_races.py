"""A cancel with compensation racing a claim, or followed by a plain cancel: the run ends cancelled with its
saga run, never silently without it.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from durable_agents import api
from durable_agents.api import call, workflow
from durable_agents.engine.advance import Outcome, advance
from durable_agents.models import Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive
from tests.integration.interleavings import in_another_connection, joined, ledger, net, until_blocked_on_a_lock
from tests.integration.outside_carrier import _plain
from tests.testapp.trust import HOOKS
from tests.testapp.workflows import _charge_step

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


# --- Helpers ------------------------------------------------------------------------------------------------


def _pending_compensation(run: Run) -> list[tuple[str, str]]:
    return list(
        Step.objects.live()
        .filter(run=run, kind="compensate")
        .exclude(status=StepStatus.DONE)
        .values_list("step_id", "status")
    )


# --- The claim's snapshot vs a transaction that changes the plan -----------------------------------------------


def test_claim__racing_a_cancel_with_compensation_ends_the_run_cancelled_with_its_saga_unrun():
    """The claim is one statement: `WITH c AS (UPDATE run ...) SELECT ... LEFT JOIN step`. A worker's claim of a
    pending run blocks on the run's row lock held by cancel(compensate) (which plans compensate-1 at position
    step_count and moves the cursor there). When the cancel commits, the UPDATE re-checks the *new* run row
    (pending, lease free, no cancel pending) and claims it — but the JOIN reads the step table with the
    statement's snapshot, taken before the cancel committed: no step at the new cursor. The worker takes
    that for an empty plan (finish_empty) and ends the run `cancelled` as its saga said, with the
    compensation step never run: the charge stays."""
    run = api.start("two_charges", {"order_id": "CL-1"})
    assert advance(run.id) is Outcome.COMMITTED  # charge-a applied; the run is pending, no worker holds it
    with transaction.atomic():
        api.cancel(run.id, "customer cancelled", compensate=True, actor="ops")  # holds the run's row lock
        thread, out = in_another_connection(lambda: advance(run.id))  # a worker got the run's message
        until_blocked_on_a_lock(thread)
    outcome = joined(thread, out)
    run = drive(run.id)
    assert not (run.status == RunStatus.CANCELLED and _pending_compensation(run)), (
        "guarantee 9 (a saga, once started, finishes or stops visibly): a claim racing the cancel ended the run "
        f"{run.status} (worker outcome {outcome}) with compensation steps {_pending_compensation(run)} never "
        f"run; ledger {ledger('CL-1')}"
    )
    assert net("CL-1") == 0, f"the cancelled run's charge was never refunded: {ledger('CL-1')}"


# --- Cancel requests while a worker holds the run ---------------------------------------------------------------

workflow(
    "charge_work_tail",
    steps=[call("charge", _charge_step), call("work", _plain), call("tail", _plain)],
    replace=True,
)


def test_cancel__a_plain_cancel_after_a_requested_compensation_silently_drops_the_compensation():
    """While a worker holds the run, cancel(compensate=True) is accepted as `requested` (cancel_compensate set).
    A bulk cancel without compensation then hits the same run: cancel_txn's REQUEST_CANCEL overwrites
    cancel_compensate with False. When the step commits, the settle cancels the run plainly: the operator who
    was told the compensation is requested gets a cancelled run with the charge in place. Had no worker held the
    run, the first cancel would have started the saga and the second would have changed nothing (saga goes on):
    the outcome depends on who held the row when."""
    run = api.start("charge_work_tail", {"order_id": "CD-1"})
    assert advance(run.id) is Outcome.COMMITTED

    def two_operators(ctx):
        api.cancel(ctx.run_id, "customer asked for a refund", compensate=True, actor="ops-1")
        api.cancel(ctx.run_id, "bulk cleanup", actor="ops-2")

    HOOKS["carrier:work"] = two_operators
    advance(run.id)
    run = drive(run.id)
    assert net("CD-1") == 0, (
        "guarantee 9/8 (a cancel with compensation is honoured, nothing is dropped silently): a later plain cancel "
        f"overwrote a requested compensation; run {run.status}, ledger {ledger('CD-1')}"
    )
