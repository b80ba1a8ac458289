"""Workflows and harness for the state-machine test: an order saga whose workers the test can pause and kill.

Two workflows, both compensating on failure:

* `machine_order`: charge (ledger, compensable) → ship (external shipping service, compensable) → observe
  the order (freshness budget; its amount changes between observations) → refund the observed amount
  (approval-gated) → wait for the `paid` signal → nap (timer) → done;
* `machine_saga`: charge → approve (approval step, the deadline fails the run) → ship → done.

Every call that reaches a receiver is written to `ReceiverCall` with the caller's fencing token and whether
that token still held the run; every step body records its execution (`Execution`). A test arms a pause
point with `PausedWorker`: its worker thread blocks there until the test lets it go on or kills it (the
thread stops at that point, like SIGKILL). Points are `<step>:body` (inside a step body, after it recorded
its execution) and `ship:before_land` / `ship:after_land` (inside the shipping call). `control.fault_next_ship`
makes the next shipping call time out before or after the parcel left.

Pause points never sit inside a transaction: a paused worker holding row locks would deadlock the test.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings as django_settings
from django.db import connection, connections
from django.db.backends.signals import connection_created
from django.test.utils import override_settings

from durable_agents.api import PermanentError, RetryPolicy, StepContext, approval, call, sleep, tool, wait_for_signal
from durable_agents.api import workflow as define_workflow
from durable_agents.engine.advance import Outcome, advance
from durable_agents.models import ACTIVE_RUN_STATUSES, RUNNABLE_RUN_STATUSES, Run, RunStatus
from tests.testapp.models import MachineOrder, ReceiverCall
from tests.testapp.workflows import record_execution

# A lease far longer than any example: the process's renewer thread (every third of a lease) never renews
# during one, so only the test's clock moves decide whether a lease is live.
LEASE_SECONDS = 300.0
FRESH_FOR = timedelta(minutes=10)
NAP = timedelta(minutes=20)
DEADLINE = timedelta(hours=1)
# How long the test waits for a worker thread to pause or finish: a hang guard, not a timing assumption.
THREAD_TIMEOUT = 60.0


RESWEEP_CAP = timedelta(seconds=4)


def machine_settings() -> Any:
    """The DURABLE_AGENTS the machine runs under: long leases, immediate retries, wake-ups left to the test."""
    return override_settings(
        DURABLE_AGENTS={
            **django_settings.DURABLE_AGENTS,
            "LEASE_SECONDS": LEASE_SECONDS,
            "IDLE_RESWEEP_SECONDS": 1.0,
            # A run the sweep re-woke without progress waits up to this before the next re-wake (engine/sweep.py).
            "RESWEEP_BACKOFF_MAX_SECONDS": RESWEEP_CAP.total_seconds(),
            "RETRY_MAX_ATTEMPTS": 3,
            # No backoff: a retry is claimable at once, so no test waits on the wall clock.
            "RETRY_BACKOFF_SECONDS": 0.0,
            "RETRY_BACKOFF_MAX_SECONDS": 0.0,
            "EFFECT_MAX_INVOCATIONS": 3,
            "APPROVAL_DEADLINE_SECONDS": DEADLINE.total_seconds(),
            "WAKER": "tests.testapp.machine.ignore_wake",
            "APPROVERS": ["ops@example.com"],
        }
    )


@contextlib.contextmanager
def fast_commits() -> Iterator[None]:
    """Commits without waiting for the WAL flush, on every connection opened meanwhile (worker threads too).

    Only a crash of the Postgres server itself could lose such a commit; the state-machine test makes
    thousands of small commits and does not crash the server, so it waits for no disk.
    """

    def relax(sender: Any, connection: Any, **kwargs: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit TO off")

    connection_created.connect(relax)
    if connection.connection is not None:
        relax(None, connection)
    try:
        yield
    finally:
        connection_created.disconnect(relax)
        if connection.connection is not None:
            with connection.cursor() as cursor:
                cursor.execute("SET synchronous_commit TO DEFAULT")


def ignore_wake(run_id: str, countdown: float | None = None, queue: str | None = None) -> None:
    """The machine's waker: no broker, no worker. The test itself delivers wake-ups (its advance rules)."""


# --- Pause points and faults ----------------------------------------------------------------------------


class WorkerKilled(BaseException):  # noqa: N818 - like SIGKILL, not an error anyone should catch
    """Raised at a pause point to stop a worker there: nothing after that point runs.

    A BaseException so neither the step code nor the engine's `except Exception` handlers see it.
    """


class _Gate:
    def __init__(self, run_id: str, point: str) -> None:
        self.run_id = run_id
        self.point = point
        self.thread: threading.Thread | None = None
        self.token: int | None = None
        self.reports: queue.Queue[str] = queue.Queue()
        self.orders: queue.Queue[str] = queue.Queue()


class Control:
    """Armed pause points and one-shot shipping faults, shared by the test and its worker threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[tuple[str, str], _Gate] = {}
        self._paused: list[_Gate] = []
        self._faults: dict[str, str] = {}

    def arm(self, run_id: Any, point: str) -> _Gate:
        gate = _Gate(str(run_id), point)
        with self._lock:
            self._gates[(gate.run_id, point)] = gate
        return gate

    def disarm(self, gate: _Gate) -> None:
        with self._lock:
            if self._gates.get((gate.run_id, gate.point)) is gate:
                del self._gates[(gate.run_id, gate.point)]

    def reach(self, ctx: StepContext | None, point: str) -> None:
        """Called by step bodies and tools: block here if the test armed this point for this worker thread."""
        if ctx is None:
            return
        with self._lock:
            gate = self._gates.get((str(ctx.run_id), point))
            # Only the thread the gate was armed for pauses; the test's own advances never block.
            if gate is None or gate.thread is not threading.current_thread():
                return
            del self._gates[(gate.run_id, point)]
        if connection.in_atomic_block:
            raise RuntimeError(f"pause point {point!r} is inside a transaction; a paused worker would hold locks")
        gate.token = ctx.lease_token
        with self._lock:
            self._paused.append(gate)
        gate.reports.put("paused")
        try:
            order = gate.orders.get(timeout=THREAD_TIMEOUT * 10)
        except queue.Empty:
            order = "die"  # the test is gone: never wake up and write as a zombie of a dead test
        if order == "die":
            raise WorkerKilled(point)

    def fault_next_ship(self, run_id: Any, when: str) -> None:
        """The next shipping call of this run times out `before` the parcel leaves, or `after` (answer lost)."""
        with self._lock:
            self._faults[str(run_id)] = when

    def take_fault(self, ctx: StepContext | None, when: str) -> bool:
        if ctx is None:
            return False
        with self._lock:
            if self._faults.get(str(ctx.run_id)) != when:
                return False
            del self._faults[str(ctx.run_id)]
        return True

    def reset(self) -> None:
        """Disarm everything and kill every worker still paused (a test that failed half-way leaves some)."""
        with self._lock:
            self._gates.clear()
            self._faults.clear()
            paused, self._paused = self._paused, []
        for gate in paused:
            gate.orders.put("die")
            if gate.thread is not None:
                gate.thread.join(THREAD_TIMEOUT)


control = Control()


class PausedWorker:
    """A worker advancing one run in its own thread, paused at `point` until the test releases it.

    Usage::

        worker = PausedWorker(run.id, "ship:body")
        if worker.start():          # True: paused at the point, holding the run's lease
            ...                      # the lease expires, another worker takes over
            worker.release()         # goes on: tries to apply its effects and commit
            assert worker.outcome is Outcome.LEASE_LOST
    """

    def __init__(self, run_id: Any, point: str) -> None:
        self.run_id = str(run_id)
        self.point = point
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None
        self.killed = False
        self._gate = control.arm(self.run_id, point)
        self._thread = threading.Thread(target=self._work, name=f"machine-worker-{point}", daemon=True)
        self._gate.thread = self._thread

    @property
    def token(self) -> int | None:
        """The fencing token the paused worker holds."""
        return self._gate.token

    def start(self) -> bool:
        """Start advancing; True once paused at the point, False if the advance finished without reaching it."""
        self._thread.start()
        report = self._gate.reports.get(timeout=THREAD_TIMEOUT)
        if report == "paused":
            return True
        control.disarm(self._gate)
        self._join()
        return False

    def release(self, *, die: bool = False) -> None:
        """Let the paused worker go on (or stop it dead at the point) and wait until its advance ends."""
        self._gate.orders.put("die" if die else "go")
        self._join()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _join(self) -> None:
        self._thread.join(THREAD_TIMEOUT)
        if self._thread.is_alive():
            raise AssertionError(f"worker thread for run {self.run_id} did not finish after release")

    def _work(self) -> None:
        try:
            self.outcome = advance(self.run_id)
        except WorkerKilled:
            self.killed = True
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails on it
            self.error = exc
        finally:
            # This thread's own connection; closing it leaves no idle session behind the example.
            connections.close_all()
            self._gate.reports.put("finished")


@contextlib.contextmanager
def skewed_clock(seconds: float) -> Iterator[None]:
    """This process's wall clock runs `seconds` ahead (a worker machine with a drifting clock).

    Only the worker's own clock moves, not the database's: an engine on the database clock is unaffected.
    """
    from django.utils import timezone

    real_now = timezone.now
    timezone.now = lambda: real_now() + timedelta(seconds=seconds)
    try:
        yield
    finally:
        timezone.now = real_now


# --- Receivers ------------------------------------------------------------------------------------------


def _holder(ctx: StepContext | None) -> tuple[int | None, bool]:
    """The caller's token, and whether it still holds the run (a zombie's does not)."""
    token = ctx.lease_token if ctx is not None else None
    held = ctx is not None and Run.objects.filter(pk=ctx.run_id, lease_token=token, status=RunStatus.RUNNING).exists()
    return token, held


def _land(
    receiver: str,
    kind: str,
    key: str,
    ctx: StepContext | None,
    args: dict[str, Any],
    *,
    token: int | None,
    held: bool,
    dedupe: bool,
) -> None:
    undoes = key.removesuffix(":compensate") if kind == "undo" else ""
    seen = dedupe and ReceiverCall.objects.filter(receiver=receiver, idempotency_key=key, deduped=False).exists()
    ReceiverCall.objects.create(
        receiver=receiver,
        kind=kind,
        idempotency_key=key,
        undoes=undoes,
        run_id=ctx.run_id if ctx is not None else uuid.UUID(int=0),
        args=args,
        token=token,
        held=held,
        deduped=seen,
    )


@tool(name="machine_charge", effectful=True, transactional=True, compensate="machine_uncharge")
def machine_charge(order_id: str, amount: Decimal, *, idempotency_key: str, ctx: StepContext | None = None) -> dict:
    """Charge an order: a ledger entry in this database, committed with the effect's outbox row."""
    token, held = _holder(ctx)
    args = {"order_id": order_id, "amount": str(amount)}
    _land("ledger", "apply", idempotency_key, ctx, args, token=token, held=held, dedupe=False)
    return {"charged": str(amount)}


@tool(name="machine_uncharge", effectful=True, transactional=True)
def machine_uncharge(order_id: str, amount: Decimal, *, idempotency_key: str, ctx: StepContext | None = None) -> dict:
    """Give a charge back: a negative ledger entry."""
    token, held = _holder(ctx)
    args = {"order_id": order_id, "amount": str(amount)}
    _land("ledger", "undo", idempotency_key, ctx, args, token=token, held=held, dedupe=False)
    return {"uncharged": str(amount)}


@tool(name="machine_refund", effectful=True, transactional=True, needs_approval=True)
def machine_refund(order_id: str, amount: Decimal, *, idempotency_key: str, ctx: StepContext | None = None) -> dict:
    """Refund part of an order (a ledger entry); a human approves the exact amount first."""
    token, held = _holder(ctx)
    args = {"order_id": order_id, "amount": str(amount)}
    _land("ledger", "apply", idempotency_key, ctx, args, token=token, held=held, dedupe=False)
    return {"refunded": str(amount)}


@tool(name="machine_ship", effectful=True, compensate="machine_unship")
def machine_ship(order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict:
    """Ask the shipping service (another system) to ship an order; it dedupes on the idempotency key."""
    # Whether the caller holds the run as it enters the tool, i.e. after every check the engine makes
    # before calling out: a pause after this point is the one window no check-then-act closes.
    token, held = _holder(ctx)
    control.reach(ctx, "ship:before_land")
    if control.take_fault(ctx, "before"):
        raise TimeoutError("the shipping service timed out before it received the request")
    _land("shipping", "apply", idempotency_key, ctx, {"order_id": order_id}, token=token, held=held, dedupe=True)
    control.reach(ctx, "ship:after_land")
    if control.take_fault(ctx, "after"):
        raise TimeoutError("the shipping service timed out after shipping (its answer was lost)")
    return {"shipped": order_id}


@tool(name="machine_unship", effectful=True)
def machine_unship(order_id: str, *, idempotency_key: str, ctx: StepContext | None = None) -> dict:
    """Call a shipment back at the shipping service; it dedupes on the idempotency key."""
    token, held = _holder(ctx)
    _land("shipping", "undo", idempotency_key, ctx, {"order_id": order_id}, token=token, held=held, dedupe=True)
    return {"recalled": order_id}


# --- Steps and workflows --------------------------------------------------------------------------------


def _charge(ctx: StepContext) -> Any:
    record_execution(ctx)
    control.reach(ctx, f"{ctx.step_id}:body")
    return ctx.call_tool(machine_charge, {"order_id": ctx.input["order_id"], "amount": "30.00"})


def _ship(ctx: StepContext) -> Any:
    record_execution(ctx)
    control.reach(ctx, f"{ctx.step_id}:body")
    return ctx.call_tool(machine_ship, {"order_id": ctx.input["order_id"]})


def _observe(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    control.reach(ctx, f"{ctx.step_id}:body")
    order = MachineOrder.objects.filter(order_id=ctx.input["order_id"]).first()
    if order is None:
        raise PermanentError(f"order {ctx.input['order_id']} does not exist")
    return {"amount": str(order.amount)}


def _refund(ctx: StepContext) -> Any:
    record_execution(ctx)
    control.reach(ctx, f"{ctx.step_id}:body")
    amount = ctx.result("observe")["amount"]
    return ctx.call_tool(machine_refund, {"order_id": ctx.input["order_id"], "amount": amount})


def _done(ctx: StepContext) -> dict[str, Any]:
    record_execution(ctx)
    control.reach(ctx, f"{ctx.step_id}:body")
    return {"done": True}


ORDER_STEPS = ("charge", "ship", "observe", "refund", "paid", "nap", "done")
SAGA_STEPS = ("charge", "approve", "ship", "done")

define_workflow(
    "machine_order",
    steps=[
        call("charge", _charge),
        call("ship", _ship),
        call("observe", _observe, fresh_for=FRESH_FOR),
        call("refund", _refund, depends_on=["observe"]),
        wait_for_signal("paid", signal="paid", timeout=DEADLINE, on_timeout="continue"),
        sleep("nap", seconds=NAP.total_seconds()),
        call("done", _done),
    ],
    retry=RetryPolicy(max_attempts=3),
    on_failure="compensate",
    description="state-machine test: an order saga with an observation, an approval, a signal and a timer",
)
define_workflow(
    "machine_saga",
    steps=[
        call("charge", _charge),
        approval("approve", question="Ship the order?", reject="fail", deadline=DEADLINE, on_deadline="fail"),
        call("ship", _ship),
        call("done", _done),
    ],
    retry=RetryPolicy(max_attempts=3),
    on_failure="compensate",
    description="state-machine test: charge, a human approves, ship",
)

STEP_IDS = {"machine_order": ORDER_STEPS, "machine_saga": SAGA_STEPS}


# Which runs a state machine's rule may pick (both machines share them).
def runnable(run: Run) -> bool:
    return run.status in RUNNABLE_RUN_STATUSES


def active(run: Run) -> bool:
    return run.status in ACTIVE_RUN_STATUSES


def stopped(run: Run) -> bool:
    """Failed or cancelled: what an operator may resume."""
    return run.status in (RunStatus.FAILED, RunStatus.CANCELLED)
