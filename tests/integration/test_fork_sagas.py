"""Forks and sagas: a fork's saga and its source's each undo exactly the charges they own (not one the other
relies on, not one applied under another row), and a fork of a compensating source, or at a step past the source's
cursor, completes without re-running or skipping work.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from durable_agents import api, clock
from durable_agents.api import StepContext, call, tool, workflow
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Run, RunStatus, Step
from durable_agents.testing import drive
from tests.integration.interleavings import ledger, net
from tests.testapp.models import LedgerEntry
from tests.testapp.trust import HOOKS, hook

pytestmark = pytest.mark.django_db(transaction=True)

REFUSING = {"refuse": False}


@pytest.fixture(autouse=True)
def _clean():
    HOOKS.clear()
    REFUSING["refuse"] = False
    yield
    HOOKS.clear()
    REFUSING["refuse"] = False
    clock.reset()


# --- Workflows of these tests ---------------------------------------------------------------------------------


@tool(effectful=True, transactional=True, compensate="refund_charge", name="refusable_charge")
def refusable_charge(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
    """A ledger charge (undone by refund_charge) that the ledger refuses while REFUSING["refuse"] is set."""
    if REFUSING["refuse"]:
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
    "refusable_charge_then_hold",
    steps=[call("charge", _refusable), call("hold", _hooked)],
    replace=True,
)


# --- Helpers ------------------------------------------------------------------------------------------------


def _charged_once(order_id: str) -> Run:
    """A two_charges run whose first charge (10.00) is applied; its cursor on charge-b; no worker holds it."""
    run = api.start("two_charges", {"order_id": order_id})
    assert advance(run.id) is Outcome.COMMITTED
    assert ledger(order_id) == [("charge", 10)]
    return run


# --- Forks sharing the source's effect scope ----------------------------------------------------------------


def test_fork__its_saga_does_not_undo_a_charge_it_applied_under_the_sources_failed_row():
    """A fork with the source's input shares its keys. The source's charge failed (effect `failed`, run_id =
    source); the fork retries it under the same key: the row flips failed→pending→applied but keeps
    run_id = source. Cancelling the fork with compensation lists effects by run_id, so the fork's own charge
    is never refunded."""
    REFUSING["refuse"] = True
    source = drive(api.start("refusable_charge_then_hold", {"order_id": "FK-1"}).id)
    assert source.status == RunStatus.FAILED
    REFUSING["refuse"] = False
    fork = api.fork(source.id, "charge", actor="ops")
    assert advance(fork.id) is Outcome.COMMITTED
    assert ledger("FK-1") == [("charge", 15)], "the fork charged"
    api.cancel(fork.id, "customer cancelled", compensate=True)
    fork = drive(fork.id)
    assert fork.status == RunStatus.CANCELLED
    assert net("FK-1") == 0, (
        "guarantee 9/2: the fork applied a charge and its cancel-with-compensation did not refund it "
        f"(the effect row belongs to the source run): {ledger('FK-1')}"
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
        f"{kinds} and ended completed; ledger {ledger('FC-1')}"
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
    assert ledger("FS-1") == [("charge", 10), ("charge", 20)], "the source reused the fork's charge"
    api.cancel(fork.id, "fork abandoned", compensate=True)
    drive(fork.id)
    assert net("FS-1") == 30, (
        f"guarantee 2/9: the fork's saga refunded a charge the completed source run relies on: {ledger('FS-1')}"
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
    assert net("FR-1") == 30, (
        f"guarantee 2/9: the source's saga refunded the charges the completed fork was built on: {ledger('FR-1')}"
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
    assert sorted(amount for kind, amount in ledger("FP-1") if kind == "charge") == [10, 20]
