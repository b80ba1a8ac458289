"""A claim racing a transaction that changes the plan (a migration, a saga's planner) executes and
checkpoints only the step under the cursor; the lease proof does not wait on a saga being planned; on every
supported database (SQLite too) a checkpoint of a step that is no longer live moves nothing.

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
from django.db import transaction
from django.utils import timezone

from durable_agents import api
from durable_agents.api import PlannedStep, StepContext, call, workflow
from durable_agents.engine import transitions, turnpath
from durable_agents.engine.advance import Outcome, advance
from durable_agents.models import Effect, Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive, wait_for
from tests.integration.interleavings import (
    in_another_connection,
    joined,
    ledger,
    someone_waits_for_a_lock,
    until_blocked_on_a_lock,
)
from tests.integration.outside_carrier import CARRIER, _plain
from tests.testapp.trust import HOOKS
from tests.testapp.workflows import _charge_step

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


# --- Helpers ------------------------------------------------------------------------------------------------


workflow(
    "plan_drift",
    version=1,
    steps=[call("prepare", _plain), call("charge", _charge_step)],
    plan=lambda inp: [PlannedStep("prepare", "prepare"), PlannedStep("bill", "charge", {"amount": "99.00"})],
    replace=True,
)
# v2 fixes the amount: the bill is re-planned as another plan element with the right amount.
workflow(
    "plan_drift",
    version=2,
    steps=[call("prepare", _plain), call("charge", _charge_step)],
    plan=lambda inp: [PlannedStep("prepare", "prepare"), PlannedStep("bill-v2", "charge", {"amount": "10.00"})],
    replace=True,
)


def test_claim__racing_a_migration_executes_the_plan_element_the_migration_replaced():
    """Same snapshot seam, with migrate(replan=True): v2 re-plans v1's `bill` (99.00, a wrong amount) as `bill-v2`
    (10.00). The migration takes the pending run (token bumped), supersedes `bill` and plans `bill-v2` at the
    cursor. A claim blocked on the run's row lock then claims the migrated run (a fresh, valid token) but loads
    the step at the cursor from its snapshot: the superseded `bill` row, still pending there. The worker
    executes it; its charge proves the lease (the token is valid) and lands 99.00; only the checkpoint is then
    refused (the row is superseded), and the run goes on to charge bill-v2's 10.00 as well."""
    run = api.start("plan_drift", {"order_id": "MG-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED  # prepare done; cursor on bill, pending, no holder
    with transaction.atomic():
        api.migrate(run.id, 2, replan=True, actor="ops")  # holds the run's row lock
        thread, out = in_another_connection(lambda: advance(run.id))
        until_blocked_on_a_lock(thread)
    outcome = joined(thread, out)
    assert ("charge", 99) not in ledger("MG-1"), (
        "guarantee 4/9 (one writer; a decision means what the decider saw): a claim racing the migration "
        f"executed the superseded v1 plan element `bill` (outcome {outcome}); ledger {ledger('MG-1')}"
    )


# --- The lease proof of an external call vs a saga being planned ---------------------------------------------------


@pytest.mark.parametrize("path", ["one statement", "transaction"])
def test_effects__the_lease_proof_reads_the_run_without_waiting_for_a_saga_being_planned(path, monkeypatch):
    """The proof that fences an external call must wait for the run's row lock, not read the run in its snapshot. A
    worker paused past its lease right before its proof; cancel(compensate) takes the run (token bumped) and plans its
    saga from the effects it sees — the shipment is not invoked: nothing to undo. While that transaction is still
    open, the worker thaws: were its proof a plain read of the old run row (its token, running), it would count the
    invocation and ship, and once the cancel commits: a run cancelled "with compensation" and a shipment applied after
    the saga looked, undone by nobody and flagged nowhere.

    `path`: on Postgres a new key's outbox row is written with the proof in one statement (hotpath.start_effect),
    before which the worker pauses; elsewhere (here: that statement turned off) ensure_lease proves the lease, then
    a transaction proves it again and counts the invocation."""
    planned, committed = threading.Event(), threading.Event()
    state: dict[str, Any] = {}

    def operator_cancels():
        with transaction.atomic():
            api.cancel(state["run"], "customer cancelled", compensate=True, actor="ops")
            planned.set()
            # Commits once the worker's call is under way — or once the worker waits for this transaction.
            wait_for(lambda: committed.is_set() or someone_waits_for_a_lock(), timeout=30, what="the worker")

    def paused(run_id):
        Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
        state["thread"] = in_another_connection(operator_cancels)
        planned.wait()  # the saga was planned (not committed) while this worker was paused

    if path == "one statement":
        original = transitions.start_external_effect

        def pauses_then_proves(claim, **kwargs):
            monkeypatch.setattr(transitions, "start_external_effect", original)
            paused(claim.run_id)
            return original(claim, **kwargs)

        monkeypatch.setattr(transitions, "start_external_effect", pauses_then_proves)
    else:
        monkeypatch.setattr(turnpath, "is_available", lambda: False)
        original = StepContext.ensure_lease

        def proves_then_pauses(self):
            original(self)
            monkeypatch.setattr(StepContext, "ensure_lease", original)
            paused(self.run_id)

        monkeypatch.setattr(StepContext, "ensure_lease", proves_then_pauses)

    def the_call_is_under_way(ctx):
        committed.set()
        joined(*state.pop("thread"))

    HOOKS["carrier:sent:PS-1"] = the_call_is_under_way
    try:
        run = api.start("carrier_send_hold", {"order_id": "PS-1"})
        state["run"] = run.id
        outcome = advance(run.id)
    finally:
        committed.set()
        if "thread" in state:
            joined(*state.pop("thread"))
    monkeypatch.undo()
    run = drive(run.id)
    effect = Effect.objects.filter(run=run, tool="carrier_send").first()
    shipped = effect is not None and CARRIER.get(effect.idempotency_key) == "shipped"
    undone = effect is not None and f"{effect.idempotency_key}:compensate" in CARRIER
    assert run.status == RunStatus.CANCELLED
    assert not (shipped and not undone and not effect.needs_attention), (
        "guarantee 4/9 (a zombie never applies an effect; a saga is never silently half-done): the worker's lease "
        f"proof passed while the cancel's saga was being planned (outcome {outcome}); the shipment landed, "
        f"effect {effect.status}, run {run.status}, nothing undone or flagged: {CARRIER}"
    )


def test_claim__racing_a_planners_commit_checkpoints_a_step_that_is_not_under_the_cursor():
    """The planner's worker was paused past its lease and commits its plan (cursor on the first planned step; the
    old tail step `after` moved behind the planned ones) just as another worker's claim arrives (the sweep re-woke
    the run). The claim blocks on the run's row, then claims the committed row — and loads the step at the cursor
    from its snapshot: `after`, at its old position. It executes `after` and the checkpoint (by step pk, never by
    position) writes it and moves the cursor past the first planned step, which never runs: a step checkpointed
    while the run did not advance over it, and a planned step skipped."""
    from durable_agents.engine import advance as advance_module

    run = api.start("planned", {})
    assert advance(run.id) is Outcome.COMMITTED  # observe
    original_extend, original_event = advance_module._extend, advance_module.record_event
    state: dict[str, Any] = {}

    def paused_then_commits(claim, step, extension):
        Run.objects.filter(pk=run.id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
        return original_extend(claim, step, extension)

    def another_worker_claims_meanwhile(run_id, kind, **kwargs):
        event = original_event(run_id, kind, **kwargs)
        if kind == "planned":  # inside the planner's commit, the run's row locked
            state["other"] = in_another_connection(lambda: advance(run.id))
            until_blocked_on_a_lock(state["other"][0])
        return event

    advance_module._extend, advance_module.record_event = paused_then_commits, another_worker_claims_meanwhile
    try:
        assert advance(run.id) is Outcome.COMMITTED  # the planner's plan
    finally:
        advance_module._extend, advance_module.record_event = original_extend, original_event
    other = joined(*state["other"])
    run = Run.objects.get(pk=run.id)
    behind = list(
        Step.objects.live()
        .filter(run=run, position__lt=run.cursor)
        .exclude(status=StepStatus.DONE)
        .values_list("step_id", "status")
    )
    assert not behind, (
        "guarantee 1/4 (a checkpoint is the committed result of the step under the cursor): the racing claim "
        f"(outcome {other}) executed a step the plan had moved and moved the cursor to {run.cursor} past "
        f"planned steps that never ran: {behind}"
    )


# --- SQLite, the embedded default ---------------------------------------------------------------------------------

CHECKPOINT_A_STEP_NO_LONGER_LIVE = """
import json
from django.db import transaction
from durable_agents import api
from durable_agents.engine import transitions
from durable_agents.engine.payloads import StoredResult
from durable_agents.models import Run, Step
from durable_agents.states import StepOp, StepStatus

run = api.start("two_charges", {"order_id": "SQ-1"})
claim, step = transitions.claim_run(run.id)
with transaction.atomic():  # the step is no longer live while its worker runs it (a deadline failed it)
    transitions.move_steps_txn(StepOp.FAIL, Step.objects.filter(pk=step.pk), to=StepStatus.FAILED)
committed = transitions.checkpoint(claim, step, StoredResult({"charged": True}), final=False)
run = Run.objects.get(pk=run.id)
step = Step.objects.get(pk=step.pk)
print(json.dumps({"committed": committed, "cursor": run.cursor, "step": step.status, "held": run.lease_owner}))
"""


def test_checkpoint__on_sqlite_moves_the_run_past_a_step_it_did_not_write(worker_env, tmp_path):
    """Round 1's fix "the checkpoint writes the run only if it wrote the step" lives in the Postgres CTE only. The
    ORM path (SQLite, the embedded default) moves the cursor and releases the lease first, then calls
    commit_step_txn and ignores that it wrote 0 rows: the run is advanced past a step that is not done, and the
    worker is told `checkpointed`. (Postgres, in this process, answers `lost` and moves nothing.)"""
    import json
    import subprocess
    import sys

    from durable_agents.engine import transitions as engine_transitions
    from durable_agents.engine.payloads import StoredResult
    from durable_agents.states import StepOp
    from tests.conftest import ROOT

    run = api.start("two_charges", {"order_id": "PG-1"})
    claim, step = engine_transitions.claim_run(run.id)
    with transaction.atomic():
        engine_transitions.move_steps_txn(StepOp.FAIL, Step.objects.filter(pk=step.pk), to=StepStatus.FAILED)
    assert engine_transitions.checkpoint(claim, step, StoredResult({"charged": True}), final=False) == "lost"

    env = {**worker_env, "DATABASE_URL": f"sqlite:///{tmp_path / 'embedded.sqlite3'}"}
    for command in (["migrate", "-v0"], ["shell", "-c", CHECKPOINT_A_STEP_NO_LONGER_LIVE]):
        done = subprocess.run(
            [sys.executable, "-m", "django", *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-2000:]
    sqlite = json.loads(done.stdout.strip().splitlines()[-1])
    assert sqlite["committed"] == "lost" and sqlite["cursor"] == 0, (
        "guarantee 1/4 (a checkpoint is the committed result of its step, on every supported database): on SQLite "
        f"the checkpoint of a step that is no longer live advanced the run: {sqlite}"
    )
