"""Sagas across code changes: a run migrated to a new plan, replanned because its version is gone, or whose
compensating tool was renamed still undoes what it applied (or says it cannot), and an undecided approval counts as
a rejection.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import pytest

from durable_agents import api, clock
from durable_agents.api import StepContext, approval, call, workflow
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.waits import sweep_waits
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import RunStatus, Step, StepStatus, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.tools import tools
from durable_agents.workflows import registry
from tests.integration.interleavings import ledger, net
from tests.testapp.trust import hook
from tests.testapp.workflows import _charge_step, charge

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


def _hooked(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"atk:{ctx.step_id}")
    if ctx.args.get("fail"):
        raise ValueError("the order data is malformed")  # a permanent failure
    return {"step": ctx.step_id}


# Two versions: v2 replaces the tail step with another (a different step id).
V1 = workflow(
    "saga_across_versions", version=1, steps=[call("charge", _charge_step), call("hold", _hooked)], replace=True
)
workflow(
    "saga_across_versions",
    version=2,
    steps=[call("charge", _charge_step), call("ship_later", _hooked)],
    on_missing_version="replan",
    replace=True,
)
ATK_DEADLINE_V1 = workflow(
    "deadline_saga_across_versions",
    version=1,
    steps=[
        call("charge", _charge_step),
        approval("ok", question="Ship?", deadline=timedelta(hours=1), on_deadline="fail"),
    ],
    on_failure="compensate",
    replace=True,
)
workflow(
    "deadline_saga_across_versions",
    version=2,
    steps=[
        call("charge", _charge_step),
        approval("ok", question="Ship?", deadline=timedelta(hours=1), on_deadline="fail"),
    ],
    on_failure="compensate",
    on_missing_version="continue",
    replace=True,
)


# --- Operators racing a saga --------------------------------------------------------------------------------


def test_migrate__replan_of_a_compensating_run_throws_its_saga_away():
    """cancel(compensate) plans compensate-1; migrate(replan=True) to v2 supersedes every not-done step from the
    cursor — the compensation step — and plans v2's remaining forward step instead. The run executes forward
    work and still ends `cancelled` (finish_as), its charge never refunded.

    (With the same version the migration crashes instead: the skipped forward steps are not superseded, and
    the re-planned copies hit durable_step_run_step_id_uniq — an IntegrityError, not a domain error.)"""
    run = api.start("saga_across_versions", {"order_id": "MIG-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True, actor="ops-1")
    with contextlib.suppress(InvalidTransitionError):  # refusing to migrate a compensating run is a fix
        api.migrate(run.id, 2, replan=True, actor="ops-2")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    assert net("MIG-1") == 0, (
        "guarantee 9 (a saga, once started, finishes or stops visibly): a migration dropped the compensation "
        f"step and the run ended cancelled with its charge in place: {ledger('MIG-1')}"
    )
    forward = Step.objects.filter(run=run, step_id="ship_later", status=StepStatus.DONE)
    assert not forward.exists(), "a run cancelled with compensation executed a forward step after its saga started"


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


def test_version_gone__the_replan_policy_throws_a_running_saga_away():
    """A deploy drops v1 while a v1 run compensates; v2 says on_missing_version="replan". The compensation
    step's claim finds no v1, _version_gone adopts v2 *with replan*: the compensation step is superseded and
    v2's remaining forward step planned. The run executes forward work and ends `cancelled`, charge intact."""
    run = api.start("saga_across_versions", {"order_id": "VG-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True)
    registry.unregister("saga_across_versions", 1)  # the deploy removed v1
    try:
        run = drive(run.id)
    finally:
        registry.register(V1, replace=True)
    assert net("VG-1") == 0, (
        f"guarantee 9 (a saga, once started, finishes or stops visibly): the run ended {run.status} after a "
        f"version re-plan replaced its compensation with forward steps: {ledger('VG-1')}"
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
    assert net("TR-9") == 0 or (run.status == RunStatus.FAILED and left), (
        "guarantee 9 (a saga finishes or stops visibly with what is left to undo): the run ended "
        f"{run.status} with its charges in place and nothing left to undo on record: {ledger('TR-9')}"
    )


# --- Deadlines ---------------------------------------------------------------------------------------------


def test_deadline__fail_policy_skips_the_saga_once_the_runs_version_is_gone():
    """The sweep's "fail" policy asks `_compensates_on_failure(run)`, which reads the run's *pinned* version
    and answers False when that version is no longer registered. After a deploy that dropped v1 (v2 says
    "continue", and compensates on failure too), the deadline fails the run without undoing its charge, and
    nothing says what was left."""
    run = api.start("deadline_saga_across_versions", {"order_id": "DS-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.WAITING
    registry.unregister("deadline_saga_across_versions", 1)
    try:
        clock.advance(timedelta(hours=2))
        sweep_waits()
        run = drive(run.id)
    finally:
        registry.register(ATK_DEADLINE_V1, replace=True)
    assert run.status == RunStatus.FAILED
    left = (run.error or {}).get("left_to_undo") or []
    assert net("DS-1") == 0 or left, (
        "guarantee 9 (a saga finishes or stops visibly): the deadline failed a compensate-on-failure run "
        f"without compensating because its version was unregistered: {ledger('DS-1')}"
    )
