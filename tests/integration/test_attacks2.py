"""Adversarial review, round 2: holes in the fixes of round 1 and what it missed. Each test is a hole in a
guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams, threads with their
own connections that are joined — or seen blocked on a row lock in pg_locks — before the next act; no sleeps
for timing).

A test FAILS while the hole is open; its assertion message names the broken guarantee. Where the obvious fix is
to refuse the operator's action, the test accepts that refusal (InvalidTransitionError) too.
"""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from durable_agents import api, clock
from durable_agents.api import PlannedStep, StepContext, call, tool, workflow
from durable_agents.engine import advance as advance_module
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError, ToolFailedError, WaitClosedError
from durable_agents.models import Effect, Run, RunStatus, Step, StepStatus
from durable_agents.testing import drive, wait_for
from tests.testapp.models import LedgerEntry
from tests.testapp.trust import HOOKS, hook
from tests.testapp.workflows import _charge_step

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _clean():
    HOOKS.clear()
    CARRIER.clear()
    yield
    HOOKS.clear()
    CARRIER.clear()
    clock.reset()


# --- An outside carrier in this process: dedupes on the key, may refuse, may lose its answer ------------------

# key -> what the carrier did ("shipped" / "unshipped"); "mode:<order>" -> how it answers the next call.
CARRIER: dict[str, Any] = {}


@tool(effectful=True, compensate="atk2_unsend", name="atk2_send")
def send(order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Ship an order through an outside carrier that dedupes on the key."""
    mode = CARRIER.get(f"mode:{order_id}", "ok")
    if mode == "refuse":
        raise ToolFailedError(f"the carrier refused order {order_id}")
    CARRIER.setdefault(idempotency_key, "shipped")
    hook(ctx, f"atk2:sent:{order_id}")
    if mode == "lost":
        raise ConnectionResetError("the connection broke after the carrier accepted the shipment")
    return {"shipped": order_id}


@tool(effectful=True, name="atk2_unsend")
def unsend(order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict[str, Any]:
    """Call a shipment back."""
    if CARRIER.get("unsend") == "broken":
        raise ToolFailedError("the carrier's call-back desk is down")
    CARRIER[idempotency_key] = "unshipped"
    return {"unshipped": order_id}


def _send(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"atk2:{ctx.step_id}")
    return ctx.call_tool(send, {"order_id": ctx.args.get("order", ctx.input["order_id"])})


def _plain(ctx: StepContext) -> dict[str, Any]:
    hook(ctx, f"atk2:{ctx.step_id}")
    if ctx.args.get("fail"):
        raise ValueError("the order data is malformed")
    return {"step": ctx.step_id}


# --- Helpers ------------------------------------------------------------------------------------------------


def _ledger(order_id: str) -> list[tuple[str, int]]:
    return list(LedgerEntry.objects.filter(order_id=order_id).order_by("id").values_list("kind", "amount"))


def _net(order_id: str) -> Any:
    return sum((amount for _, amount in _ledger(order_id)), 0)


def _in_another_connection(action) -> Any:
    """Run `action` in a thread with its own connection and wait for it to finish."""
    thread, out = _start_in_another_connection(action)
    return _join(thread, out)


def _start_in_another_connection(action) -> tuple[threading.Thread, dict[str, Any]]:
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
    return thread, out


def _someone_waits_for_a_lock() -> bool:
    """True while a transaction waits for a row lock another holds (read in the caller's own connection)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
        return cursor.fetchone()[0] > 0


def _join(thread: threading.Thread, out: dict[str, Any]) -> Any:
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _until_blocked_on_a_lock(thread: threading.Thread, statement: str = "") -> None:
    """Wait until another backend waits for a lock (pg_locks is read live) while running `statement`."""
    for _ in range(20_000):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT a.query FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE NOT l.granted"
            )
            if any(statement in query for (query,) in cursor.fetchall()):
                return
        assert thread.is_alive(), "the other connection finished without waiting for the lock"
        threading.Event().wait(0.001)
    raise AssertionError("the other connection never blocked on the lock")


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
        thread, out = _start_in_another_connection(lambda: advance(run.id))  # a worker got the run's message
        _until_blocked_on_a_lock(thread)
    outcome = _join(thread, out)
    run = drive(run.id)
    assert not (run.status == RunStatus.CANCELLED and _pending_compensation(run)), (
        "guarantee 9 (a saga, once started, finishes or stops visibly): a claim racing the cancel ended the run "
        f"{run.status} (worker outcome {outcome}) with compensation steps {_pending_compensation(run)} never "
        f"run; ledger {_ledger('CL-1')}"
    )
    assert _net("CL-1") == 0, f"the cancelled run's charge was never refunded: {_ledger('CL-1')}"


workflow(
    "atk2_drift",
    version=1,
    steps=[call("prepare", _plain), call("charge", _charge_step)],
    plan=lambda inp: [PlannedStep("prepare", "prepare"), PlannedStep("bill", "charge", {"amount": "99.00"})],
    replace=True,
)
# v2 fixes the amount: the bill is re-planned as another plan element with the right amount.
workflow(
    "atk2_drift",
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
    run = api.start("atk2_drift", {"order_id": "MG-1"}, version=1)
    assert advance(run.id) is Outcome.COMMITTED  # prepare done; cursor on bill, pending, no holder
    with transaction.atomic():
        api.migrate(run.id, 2, replan=True, actor="ops")  # holds the run's row lock
        thread, out = _start_in_another_connection(lambda: advance(run.id))
        _until_blocked_on_a_lock(thread)
    outcome = _join(thread, out)
    assert ("charge", 99) not in _ledger("MG-1"), (
        "guarantee 4/9 (one writer; a decision means what the decider saw): a claim racing the migration "
        f"executed the superseded v1 plan element `bill` (outcome {outcome}); ledger {_ledger('MG-1')}"
    )


# --- resolve_effect reopening a saga ----------------------------------------------------------------------------

workflow(
    "atk2_send_two",
    steps=[call("send", _send)],
    plan=lambda inp: [
        PlannedStep("send-a", "send", {"order": f"{inp['order_id']}-A"}),
        PlannedStep("send-b", "send", {"order": f"{inp['order_id']}-B"}),
    ],
    on_failure="compensate",
    replace=True,
)


def _key(run: Run, order: str) -> str:
    return Effect.objects.get(tool="atk2_send", args__order_id=order, kind="effect").idempotency_key


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
    run = drive(api.start("atk2_send_two", {"order_id": "RO-1"}).id)  # send-b refused: the saga starts, stops
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
    run = drive(api.start("atk2_send_two", {"order_id": "RK-1"}, concurrency_key="rk-customer").id)
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
    run = api.start("atk2_send_two", {"order_id": "RZ-1"})
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


# --- Reliance: who may undo an effect several runs stand on ----------------------------------------------------

workflow(
    "atk2_three_charges",
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
    assert _net("RL-1") == 0, (
        "guarantee 9/2 (the last run to let go of an effect undoes it): the source and its fork were both cancelled "
        f"with compensation ({source.status}/{source.finish_as!r}, {fork.status}/{fork.finish_as!r}) and the "
        f"charges stay: {_ledger('RL-1')}"
    )


def test_reliance__a_fork_of_a_fork_relies_on_effects_of_steps_after_its_fork_point():
    """A runs c1, c2 and waits at c3. B = fork(A, at c2), shared scope: B reuses A's c2 (a Reliance row) and applies
    c3 itself (owns it). C = fork(B, at c2) with new input: C copies only c1's checkpoint, so it relies on c1 —
    but _recorded_before adds *every* effect B relies on, whatever the step: C relies on A's c2 too, though C
    never copied that checkpoint (its own c2 charges C's order). B is cancelled with compensation (undoes c3),
    then A: A's saga keeps c2 for C, which never used it. A's 20.00 is never refunded."""
    a = api.start("atk2_three_charges", {"order_id": "FF-1"})
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
    assert ("refund", -20) in _ledger("FF-1"), (
        "guarantee 9/2 (a saga undoes an effect once no run that relies on it stands): A's c2 was kept for fork C, "
        f"which forked before c2 and charged its own order; ledger {_ledger('FF-1')}, C's {_ledger('FF-2')}"
    )


workflow("atk2_send_hold", steps=[call("send", _send), call("hold", _plain)], replace=True)


def test_reliance__a_fork_that_applies_the_sources_in_flight_effect_is_not_recorded_as_relying_on_it():
    """The source's shipment is in flight with an unknown outcome (its answer was lost: `pending`, invoked once,
    owned by the source, which backs off to retry). A fork with the same input shares the key, calls again (the
    carrier dedupes) and records it `applied` — on the source's row, without a Reliance row (only a key found
    already applied records one). The fork completes on that shipment. Cancelling the source with compensation
    then finds its own applied effect that nobody relies on, and calls the completed fork's shipment back."""
    CARRIER["mode:IF-1"] = "lost"
    source = api.start("atk2_send_hold", {"order_id": "IF-1"})
    assert advance(source.id) is Outcome.RETRY  # shipped, answer lost: pending, attempts 1
    CARRIER["mode:IF-1"] = "ok"
    fork = drive(api.fork(source.id, "send", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED, "the fork shipped (the carrier deduped) and completed"
    api.cancel(source.id, "source abandoned", compensate=True, actor="ops")
    drive(source.id)
    key = Effect.objects.get(tool="atk2_send").idempotency_key
    assert CARRIER[key] == "shipped" and f"{key}:compensate" not in CARRIER, (
        "guarantee 2/9 (a saga never undoes an effect another standing run relies on): the source's saga called "
        f"back the shipment the completed fork {fork.id} was built on: {CARRIER}"
    )


def test_reliance__concurrent_sagas_of_a_source_and_its_fork_each_keep_the_shared_charge_for_the_other():
    """Write skew: the source A owns c1 and c2; fork B (new input, at c2) relies on c1 and owns its own c2. Both
    are cancelled with compensation at once (two operators, a bulk cancel on two workers). Each saga locks only
    its own run and reads the other's finish_as before the other commits: each sees the other standing and
    keeps c1 for it. Both sagas end; c1's 10.00 stays with nobody left to undo it."""
    a = api.start("atk2_three_charges", {"order_id": "WS-1"})
    assert advance(a.id) is Outcome.COMMITTED and advance(a.id) is Outcome.COMMITTED  # c1, c2
    b = api.fork(a.id, "c2", input={"order_id": "WS-2"}, actor="ops")
    assert advance(b.id) is Outcome.COMMITTED  # B's own c2 (its own order)
    with transaction.atomic():
        api.cancel(a.id, "customer cancelled", compensate=True, actor="ops-a")  # uncommitted yet
        other = _start_in_another_connection(
            lambda: api.cancel(b.id, "customer cancelled", compensate=True, actor="ops-b")
        )
        # B's saga must be planned while A's is uncommitted: it either finished, or waits for A's locks.
        wait_for(lambda: not other[0].is_alive() or _someone_waits_for_a_lock(), timeout=30, what="B's cancel")
    _join(*other)
    a, b = drive(a.id), drive(b.id)
    assert _net("WS-1") == 0, (
        "guarantee 9/2 (the last run to let go of an effect undoes it): A and its fork were both cancelled with "
        f"compensation ({a.status}, {b.status}) and each kept c1 for the other: {_ledger('WS-1')}"
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
    assert not (fork.status == RunStatus.COMPLETED and _net("FK2-1") == 0), (
        "guarantee 9/2 (a saga never undoes an effect another standing run relies on): the source's saga refunded "
        f"the charges the completed fork {fork.id} copied as checkpoints: {_ledger('FK2-1')}"
    )


# --- Cancel requests while a worker holds the run ---------------------------------------------------------------

workflow(
    "atk2_charge_work_tail",
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
    run = api.start("atk2_charge_work_tail", {"order_id": "CD-1"})
    assert advance(run.id) is Outcome.COMMITTED

    def two_operators(ctx):
        api.cancel(ctx.run_id, "customer asked for a refund", compensate=True, actor="ops-1")
        api.cancel(ctx.run_id, "bulk cleanup", actor="ops-2")

    HOOKS["atk2:work"] = two_operators
    advance(run.id)
    run = drive(run.id)
    assert _net("CD-1") == 0, (
        "guarantee 9/8 (a cancel with compensation is honoured, nothing is dropped silently): a later plain cancel "
        f"overwrote a requested compensation; run {run.status}, ledger {_ledger('CD-1')}"
    )


# --- The lease proof of an external call vs a saga being planned ---------------------------------------------------


def test_effects__the_lease_proof_reads_the_run_without_waiting_for_a_saga_being_planned():
    """The proof-and-count UPDATE fences on `Exists(run with this token, running)`: a plain read of the run in the
    statement's snapshot, which never waits for the run's row lock. A worker paused past its lease right after
    ensure_lease; cancel(compensate) takes the run (token bumped) and plans its saga from the effects it sees —
    the shipment is `pending`, never invoked: nothing to undo. While that transaction is still open, the worker
    thaws: its proof reads the old run row (its token, running), counts the invocation and ships. The cancel
    commits: a run cancelled "with compensation" and a shipment applied after the saga looked, undone by
    nobody and flagged nowhere."""
    original = StepContext.ensure_lease
    planned, committed = threading.Event(), threading.Event()
    state: dict[str, Any] = {}

    def operator_cancels():
        with transaction.atomic():
            api.cancel(state["run"], "customer cancelled", compensate=True, actor="ops")
            planned.set()
            # Commits once the worker's call is under way — or once the worker waits for this transaction.
            wait_for(lambda: committed.is_set() or _someone_waits_for_a_lock(), timeout=30, what="the worker")

    def proves_then_pauses(self):
        original(self)
        StepContext.ensure_lease = original
        Run.objects.filter(pk=self.run_id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
        state["thread"] = _start_in_another_connection(operator_cancels)
        planned.wait()  # the saga was planned (not committed) while this worker was paused

    def the_call_is_under_way(ctx):
        committed.set()
        _join(*state["thread"])

    HOOKS["atk2:sent:PS-1"] = the_call_is_under_way
    StepContext.ensure_lease = proves_then_pauses
    try:
        run = api.start("atk2_send_hold", {"order_id": "PS-1"})
        state["run"] = run.id
        outcome = advance(run.id)
    finally:
        StepContext.ensure_lease = original
        committed.set()
    run = drive(run.id)
    effect = Effect.objects.get(run=run, tool="atk2_send")
    shipped = CARRIER.get(effect.idempotency_key) == "shipped"
    undone = f"{effect.idempotency_key}:compensate" in CARRIER
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
            state["other"] = _start_in_another_connection(lambda: advance(run.id))
            _until_blocked_on_a_lock(state["other"][0])
        return event

    advance_module._extend, advance_module.record_event = paused_then_commits, another_worker_claims_meanwhile
    try:
        assert advance(run.id) is Outcome.COMMITTED  # the planner's plan
    finally:
        advance_module._extend, advance_module.record_event = original_extend, original_event
    other = _join(*state["other"])
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


# --- Deadlines ------------------------------------------------------------------------------------------------------


def test_signal__one_that_arrives_after_the_timeout_is_accepted_if_the_sweep_is_late():
    """Round 1 made decide_wait refuse a decision past the deadline (on the database clock) and apply the policy.
    send_signal was left out: it closes the open signal wait whatever its deadline. A payment confirmation an hour
    past the step's timeout (on_timeout="fail") is accepted until the sweep gets to the wait, and the run goes on
    as if it came in time: the declared policy depends on the sweep's timing."""
    run = api.start("signal_flow", {})
    assert advance(run.id) is Outcome.WAITING
    clock.advance(timedelta(hours=2))  # an hour past the timeout; the sweep has not run yet
    with contextlib.suppress(InvalidTransitionError, WaitClosedError):  # refusing the late signal is a fix
        api.send_signal(run.id, "payment.confirmed", {"amount": "10.00"}, by="bank")
    run = drive(run.id)
    assert run.status != RunStatus.COMPLETED, (
        "guarantee 4/9 (deadlines on the database's clock; a deadline applies its declared policy): a signal an hour "
        "past its timeout (on_timeout='fail') was accepted and the run completed"
    )


# --- Notifications vs waits closing -----------------------------------------------------------------------------


def test_deliver__a_request_for_a_wait_decided_after_the_skip_check_is_still_sent():
    """deliver() reads the wait (open: send), then claims the row with an UPDATE that does not look at the wait
    again, then sends. An approver deciding in between gets "Approval needed" for a request already decided —
    the very message the skip rule exists to withhold. The claim is the place to re-check: it is fenced on
    the row's attempts and due time, not on its wait being open."""
    from django.core import mail

    from durable_agents.engine import outbox
    from durable_agents.models import Wait
    from durable_agents.testing import deliver_notifications

    run = api.start("approve_charge", {"order_id": "NT-1"})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.WAITING
    wait = Wait.objects.get(run=run, kind="approval")
    original = outbox._skip_reason

    def decided_right_after_the_check(effect, notifier):
        reason = original(effect, notifier)
        outbox._skip_reason = original
        api.decide(wait.pk, True, by="alice")  # the approver acted from the admin meanwhile
        return reason

    outbox._skip_reason = decided_right_after_the_check
    try:
        deliver_notifications()
    finally:
        outbox._skip_reason = original
    sent = [m.subject for m in mail.outbox if m.subject.startswith("Approval needed")]
    assert not sent, (
        "guarantee 9/8 (a request is sent only while its wait is open; notifications skipped when pointless): "
        f"{sent} went out after wait {wait.pk} was approved by alice"
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
