"""A stateful hunt for holes: random interleavings of workers, zombies, operators and time on real Postgres.

Hypothesis drives a few runs of the `machine_*` workflows (tests/testapp/machine.py) at once through
advances, paused and killed workers, skewed clocks, cancels, resumes, reruns, forks, decisions (also
from stale forms), signals, timeouts and faulty external calls, and checks the guarantees of DESIGN.md §2
after every operation:

1. every effect lands at most once per idempotency key in its receiver, and is undone at most once;
2. no run ends while a compensation it started is pending; a saga that ends leaves nothing it applied
   silently undone (what it could not undo is flagged for an operator);
3. an approval authorises only the arguments it showed;
4. a committed step never executes again unless a rerun or re-plan superseded it;
5. every open run is leased, waiting on an open wait, or found by the next sweep;
6. a run has at most one open wait, a closed wait never reopens, a finished run has no open wait;
7. a worker that lost its lease applies no effect (it proves the lease before calling out) and commits
   nothing; a duplicate or clock-skewed worker never takes a live lease;
8. a run completes only once every step of its plan is done;
9. a completed run's effects are in force: none of them was undone by a compensation.

Profiles (DURABLE_STATEFUL_PROFILE): `ci` (default: bounded and derandomized, so CI is reproducible) and
`long` (thousands of random examples). Examples share the database without flushing it: each one creates
its own runs, checks only those, and deletes them when it ends; no worker thread outlives its example.

Every distinct failure this machine found has a deterministic test in test_state_machine_regressions.py.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection, transaction
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from durable_agents import api, clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.sweep import sweep
from durable_agents.errors import InvalidTransitionError, StepNotFoundError, WaitClosedError
from durable_agents.models import (
    ACTIVE_RUN_STATUSES,
    RUNNABLE_RUN_STATUSES,
    Effect,
    EffectKind,
    Event,
    Payload,
    Reliance,
    Run,
    RunStatus,
    Step,
    StepKind,
    StepStatus,
    Turn,
    Wait,
    WaitKind,
    WaitStatus,
)
from tests.testapp.machine import (
    DEADLINE,
    FRESH_FOR,
    LEASE_SECONDS,
    NAP,
    ORDER_STEPS,
    RESWEEP_CAP,
    SAGA_STEPS,
    PausedWorker,
    active,
    control,
    fast_commits,
    machine_refund,
    machine_settings,
    runnable,
    skewed_clock,
    stopped,
)
from tests.testapp.models import Execution, MachineOrder, ReceiverCall

pytestmark = pytest.mark.django_db(transaction=True)

PROFILES = {
    "ci": settings(
        max_examples=int(os.environ.get("DURABLE_STATEFUL_EXAMPLES", "250")),
        stateful_step_count=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    ),
    "long": settings(
        max_examples=int(os.environ.get("DURABLE_STATEFUL_EXAMPLES", "5000")),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    ),
}

MAX_RUNS = 3
MAX_PAUSED_WORKERS = 2
DRIVE_LIMIT = 15
# Where a worker can be paused: inside a step body, or inside the shipping call before or after it landed.
POINTS = ("charge:body", "ship:body", "refund:body", "ship:before_land", "ship:after_land")
# One second past each threshold: a lease, a freshness budget, the timer (deadlines: expire_waits). Sums of
# these cross a threshold by at least a second or stay hundreds of seconds short, so the wall clock's own
# few seconds per example never decide anything.
TIME_STEPS = tuple(int(t.total_seconds()) + 1 for t in (timedelta(seconds=LEASE_SECONDS), FRESH_FOR, NAP))
# A worker whose clock runs further ahead than any lease is long: it sees every live lease as expired.
SKEW_SECONDS = LEASE_SECONDS + 20
# The sweep that must find a lost run: within the backoff's cap (RESWEEP_BACKOFF_MAX_SECONDS) after the last re-wake,
# plus one idle period (IDLE_RESWEEP_SECONDS) — a run re-woken without progress is not re-woken at every idle period.
SWEEP_HORIZON = RESWEEP_CAP + timedelta(seconds=2)
RERUN_STEPS = tuple(dict.fromkeys((*ORDER_STEPS, *SAGA_STEPS, "compensate-1")))
COMPENSABLE_TOOLS = ("machine_charge", "machine_ship")
AMOUNTS = ("60.00", "80.00", "95.00")
WORKFLOWS = ("machine_order", "machine_saga")


def _not_waiting(run: Run) -> bool:
    return run.status != RunStatus.WAITING


def _active_order(run: Run) -> bool:
    return run.workflow == "machine_order" and active(run)


@dataclass
class Tracked:
    """What the test knows about one of its runs."""

    workflow: str
    order_id: str
    # An operator asked to undo its effects (cancel with compensation) and has not restarted it since.
    compensate: bool = False


@dataclass(frozen=True)
class World:
    """One consistent-enough read of everything the invariants look at, for the example's runs only."""

    runs: dict[str, Run]
    waits: list[Wait]
    effects: list[Effect]
    calls: list[ReceiverCall]
    # Calls that changed a receiver (not deduped), in the order they landed.
    landed: list[ReceiverCall]
    # Live plan steps of finished runs that are not done or skipped, by run.
    unfinished_steps: dict[str, list[Step]]
    reexecuted: list[tuple[Any, str]]

    @classmethod
    def load(cls, ids: list[str]) -> World:
        # Raw SELECTs: this runs after every step of every example, and compiling ORM queries cost more
        # than running them.
        uuids = [uuid.UUID(i) for i in ids]
        runs = {str(r.id): r for r in _rows(Run, "id = ANY(%s)", uuids)}
        calls = list(_rows(ReceiverCall, "run_id = ANY(%s) ORDER BY id", uuids))
        finished = [r.id for r in runs.values() if r.is_finished]
        unfinished: dict[str, list[Step]] = {}
        if finished:
            done = (StepStatus.DONE.value, StepStatus.SKIPPED.value, StepStatus.SUPERSEDED.value)
            for step in _rows(Step, "run_id = ANY(%s) AND NOT status = ANY(%s)", finished, list(done)):
                unfinished.setdefault(str(step.run_id), []).append(step)
        return cls(
            runs=runs,
            # Ordered: forms are drawn from this list, and a replay must see the same list.
            waits=list(_rows(Wait, "run_id = ANY(%s) ORDER BY id", uuids)),
            effects=list(_rows(Effect, "run_id = ANY(%s) AND kind = %s", uuids, EffectKind.EFFECT.value)),
            calls=calls,
            landed=[c for c in calls if not c.deduped],
            unfinished_steps=unfinished,
            reexecuted=[(e.run_id, e.step_id) for e in _rows(Execution, "run_id = ANY(%s) AND after_commit", uuids)],
        )


def _rows(model: Any, where: str, *params: Any) -> Any:
    return model.objects.raw(f"SELECT * FROM {model._meta.db_table} WHERE {where}", params)


class _Rollback(Exception):
    """Leaves the what-would-the-next-sweep-do sandbox without keeping anything it wrote."""


class DurableMachine(RuleBasedStateMachine):
    """Runs, workers, operators and time, interleaved at random; the guarantees hold after every step.

    Rules pick their run among those the operation can apply to (read from the last invariant check's
    `world`), so few steps are wasted on no-ops. Runs are named run0, run1, ... in the printed examples.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tracked: dict[str, Tracked] = {}
        self.names: dict[str, str] = {}
        # Workers paused at a point, by run (insertion order keeps draws reproducible across replays).
        self.paused: dict[str, PausedWorker] = {}
        self.workers: list[PausedWorker] = []
        self.closed_waits: dict[int, str] = {}
        # Approval waits an operator has seen open: decision forms that may be submitted much later.
        self.forms: list[int] = []
        self.nonce = uuid.uuid4().hex[:8]
        self.world: World | None = None

    # --- choosing runs ----------------------------------------------------------------------------------

    def _runs(self, where: Any) -> list[str]:
        """The example's runs (by name, oldest first) for which `where(run row)` holds in the last check."""
        if self.world is None:
            return []
        return [name for run_id, name in self.names.items() if where(self.world.runs[run_id])]

    def _draw(self, data: st.DataObject, where: Any, label: str = "run") -> str:
        name = data.draw(st.sampled_from(self._runs(where)), label=label)
        return next(run_id for run_id, n in self.names.items() if n == name)

    def _run(self, run: str) -> Run:
        return Run.objects.get(pk=run)

    # --- runs -------------------------------------------------------------------------------------------

    def _new_order(self) -> str:
        order_id = f"M-{self.nonce}-{MachineOrder.objects.filter(order_id__startswith=f'M-{self.nonce}-').count()}"
        MachineOrder.objects.create(order_id=order_id, amount=Decimal(AMOUNTS[0]))
        return order_id

    def _track(self, run: Run, order_id: str) -> None:
        self.tracked[str(run.id)] = Tracked(run.workflow, order_id)
        self.names[str(run.id)] = f"run{len(self.names)}"
        note(f"{self.names[str(run.id)]} = {run.id} ({run.workflow}, order {order_id})")

    @initialize(workflow=st.sampled_from(WORKFLOWS))
    def start_first(self, workflow: str) -> None:
        self.start(workflow)

    @precondition(lambda self: len(self.tracked) < MAX_RUNS)
    @rule(workflow=st.sampled_from(WORKFLOWS))
    def start(self, workflow: str) -> None:
        order_id = self._new_order()
        self._track(api.start(workflow, {"order_id": order_id}), order_id)

    # --- workers ----------------------------------------------------------------------------------------

    def _live_holder(self, run: str) -> PausedWorker | None:
        """The paused worker whose lease on `run` is still live on the engine's clock, if any."""
        worker = self.paused.get(run)
        if worker is None:
            return None
        row = self._run(run)
        live = row.lease_token == worker.token and row.lease_expires_at and row.lease_expires_at > clock.now()
        return worker if live else None

    def _advance(self, run: str) -> Outcome:
        holder = self._live_holder(run)
        token = self._run(run).lease_token
        outcome = advance(run)
        if holder is not None:
            # A duplicate delivery while a live worker holds the run: it must do nothing at all.
            assert outcome is Outcome.SKIPPED and self._run(run).lease_token == token, (
                f"run {run}: an advance took over a live lease held by a paused worker (token {holder.token}), "
                f"outcome {outcome}; one writer per run"
            )
        return outcome

    @precondition(lambda self: self._runs(runnable))
    @rule(data=st.data())
    def advance_once(self, data: st.DataObject) -> None:
        """One delivery of the run's wake-up message (possibly a duplicate)."""
        self._advance(self._draw(data, runnable))

    @precondition(lambda self: self._runs(runnable))
    @rule(data=st.data())
    def drive(self, data: st.DataObject) -> None:
        """Deliver wake-ups until the run stops being runnable (waits, finishes) or is held elsewhere."""
        run = self._draw(data, runnable)
        for _ in range(DRIVE_LIMIT):
            if self._run(run).status not in RUNNABLE_RUN_STATUSES or self._advance(run) is Outcome.SKIPPED:
                return

    @precondition(lambda self: len(self.paused) < MAX_PAUSED_WORKERS and self._runs(self._pausable))
    @rule(data=st.data(), point=st.sampled_from(POINTS))
    def pause_worker(self, data: st.DataObject, point: str) -> None:
        """Workers advance the run until one stops at `point` (SIGSTOP, a GC pause, a partition) holding it.

        The workers before it finish their steps normally; if the run stops being runnable first (it waits,
        ends, or never reaches the point), no worker is left paused.
        """
        run = self._draw(data, self._pausable)
        for _ in range(DRIVE_LIMIT):
            worker = PausedWorker(run, point)
            self.workers.append(worker)
            if worker.start():
                self.paused[run] = worker
                return
            assert worker.error is None, f"run {run}: advance raised {worker.error!r}"
            if worker.outcome is Outcome.SKIPPED or self._run(run).status not in RUNNABLE_RUN_STATUSES:
                return

    def _pausable(self, run: Run) -> bool:
        return runnable(run) and str(run.id) not in self.paused

    def _draw_paused(self, data: st.DataObject) -> str:
        return self._draw(data, lambda r: str(r.id) in self.paused, label="run of the paused worker")

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def take_over(self, data: st.DataObject) -> None:
        """The paused worker's lease expires and another worker receives the run's message."""
        run = self._draw_paused(data)
        clock.advance(timedelta(seconds=LEASE_SECONDS + 1))
        self._advance(run)

    def _release(self, run: str, *, die: bool) -> None:
        worker = self.paused.pop(run)
        zombie = self._run(run).lease_token != worker.token
        worker.release(die=die)
        assert worker.error is None, f"run {run}: advance raised in a released worker: {worker.error!r}"
        if zombie and not die:
            assert worker.outcome is Outcome.LEASE_LOST, (
                f"run {run}: a worker whose lease was taken (token {worker.token}) ended {worker.outcome}, "
                "not lease_lost; a zombie must commit nothing"
            )

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def release_worker(self, data: st.DataObject) -> None:
        """The paused worker wakes up and goes on: a zombie if it lost its lease meanwhile."""
        self._release(self._draw_paused(data), die=False)

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def kill_worker(self, data: st.DataObject) -> None:
        """The paused worker dies where it stands (SIGKILL, OOM): nothing after its pause point runs."""
        self._release(self._draw_paused(data), die=True)

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def skewed_advance(self, data: st.DataObject) -> None:
        """A worker whose clock runs ahead of the others' receives the run's message while its lease is live."""
        run = self._draw_paused(data)
        holder = self._live_holder(run)
        if holder is None:
            return
        with skewed_clock(SKEW_SECONDS):
            outcome = advance(run)
        assert self._run(run).lease_token == holder.token, (
            f"run {run}: a worker with its clock {SKEW_SECONDS:.0f}s ahead took over a live lease "
            f"(token {holder.token}, outcome {outcome}); leases must be judged on the database's clock"
        )

    # --- operators --------------------------------------------------------------------------------------

    @precondition(lambda self: self._runs(active))
    @rule(data=st.data(), compensate=st.booleans())
    def cancel(self, data: st.DataObject, compensate: bool) -> None:
        run = self._draw(data, active)
        api.cancel(run, reason="machine", compensate=compensate, actor="machine")
        if compensate:
            self.tracked[run].compensate = True

    @precondition(lambda self: self._runs(stopped))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        run = self._draw(data, stopped)
        try:
            api.resume(run, actor="machine")
        except InvalidTransitionError as exc:
            # Refused only for a run whose saga finished: it does not resume into its undone world.
            assert "compensat" in str(exc), f"run {run}: resume refused for another reason: {exc}"
            return
        self.tracked[run].compensate = False

    @precondition(lambda self: self._runs(_not_waiting))
    @rule(data=st.data(), step=st.sampled_from(RERUN_STEPS))
    def rerun(self, data: st.DataObject, step: str) -> None:
        run = self._draw(data, _not_waiting)
        try:
            api.resume(run, from_step=step, actor="machine")
        except (InvalidTransitionError, StepNotFoundError):
            return
        self.tracked[run].compensate = False

    @precondition(lambda self: 0 < len(self.tracked) < MAX_RUNS)
    @rule(data=st.data(), step=st.sampled_from(RERUN_STEPS), new_order=st.booleans())
    def fork(self, data: st.DataObject, step: str, new_order: bool) -> None:
        run = self._draw(data, lambda r: True)
        source = self.tracked[run]
        order_id = self._new_order() if new_order else source.order_id
        try:
            forked = api.fork(run, step, input={"order_id": order_id} if new_order else None, actor="machine")
        except (StepNotFoundError, InvalidTransitionError):
            return  # no checkpoint to fork from, or a source whose saga is under way or undid what it would copy
        self._track(forked, order_id)

    def _waits(self, run_id: Any) -> dict[int, str]:
        return dict(Wait.objects.filter(run_id=run_id).values_list("id", "status"))

    def _decide(self, wait_id: int, approve: bool) -> None:
        run_id = Wait.objects.values_list("run_id", flat=True).get(pk=wait_id)
        before, status = self._waits(run_id), self._run(run_id).status
        try:
            api.decide(wait_id, approve, by="machine", via="form")
        except WaitClosedError:
            if before[wait_id] == WaitStatus.OPEN:
                # Open, but past its deadline (time advanced with no sweep since): the decision is refused and
                # the deadline's policy applies instead (DESIGN: a decision after the deadline is refused).
                deadline = Wait.objects.values_list("deadline", flat=True).get(pk=wait_id)
                assert deadline is not None and deadline <= clock.now(), (
                    f"wait {wait_id} is open and within its deadline, yet its decision was refused"
                )
                assert self._waits(run_id)[wait_id] == WaitStatus.EXPIRED, (
                    f"wait {wait_id}: a decision after its deadline was refused, but its policy was not applied"
                )
                return
            assert self._waits(run_id) == before and self._run(run_id).status == status, (
                f"run {run_id}: a refused decision on closed wait {wait_id} changed the run or its waits"
            )
            return
        after = self._waits(run_id)
        assert before[wait_id] == WaitStatus.OPEN, f"wait {wait_id} was {before[wait_id]}, yet a decision closed it"
        changed = {w for w in after if after[w] != before.get(w)}
        assert changed == {wait_id}, f"run {run_id}: deciding wait {wait_id} changed waits {sorted(changed)}"

    def _open_approval(self, run: Run) -> int | None:
        assert self.world is not None
        return next(
            (
                w.id
                for w in self.world.waits
                if w.run_id == run.id and w.kind == WaitKind.APPROVAL and w.status == WaitStatus.OPEN
            ),
            None,
        )

    @precondition(lambda self: self._runs(lambda r: self._open_approval(r)))
    @rule(data=st.data(), approve=st.booleans())
    def decide_open_approval(self, data: st.DataObject, approve: bool) -> None:
        run = self._draw(data, lambda r: self._open_approval(r), label="run waiting for approval")
        wait_id = self._open_approval(self._run(run))
        assert wait_id is not None
        self._decide(wait_id, approve)

    @precondition(lambda self: self.forms)
    @rule(data=st.data(), approve=st.booleans())
    def decide_from_form(self, data: st.DataObject, approve: bool) -> None:
        """An operator submits a form read earlier: its wait may have closed and the run re-parked since."""
        self._decide(data.draw(st.sampled_from(self.forms), label="form of wait"), approve)

    @precondition(lambda self: self._runs(_active_order))
    @rule(data=st.data())
    def send_signal(self, data: st.DataObject) -> None:
        api.send_signal(self._draw(data, _active_order), "paid", {"paid": True}, by="machine")

    # --- the world and time -----------------------------------------------------------------------------

    @precondition(lambda self: self._runs(_active_order))
    @rule(data=st.data(), amount=st.sampled_from(AMOUNTS[1:]))
    def change_order(self, data: st.DataObject, amount: str) -> None:
        """The customer changes the order: the next observation sees another amount."""
        run = self._draw(data, _active_order)
        MachineOrder.objects.filter(order_id=self.tracked[run].order_id).update(amount=Decimal(amount))

    @precondition(lambda self: self._runs(active))
    @rule(data=st.data(), when=st.sampled_from(["before", "after"]))
    def fault_next_ship(self, data: st.DataObject, when: str) -> None:
        """The run's next shipping call times out: before the parcel left, or after (outcome unknown)."""
        control.fault_next_ship(self._draw(data, active), when)

    @rule(seconds=st.sampled_from(TIME_STEPS))
    def advance_time(self, seconds: int) -> None:
        clock.advance(timedelta(seconds=seconds))

    @rule()
    def expire_waits(self) -> None:
        """Every open wait's deadline passes, and the sweep applies its policy."""
        clock.advance(DEADLINE + timedelta(seconds=1))
        sweep()

    @rule()
    def sweep(self) -> None:
        sweep()

    # TODO(resolve_effect): once `api.resolve_effect(key, ...)` lands, add a rule that marks an effect of
    # unknown outcome applied or failed (as an operator would after checking the receiver), and check that
    # compensation and retries follow the recorded outcome.

    # --- invariants -------------------------------------------------------------------------------------

    @invariant()
    def guarantees_hold(self) -> None:
        world = self.world = World.load(list(self.tracked))
        self._effects_land_once(world)
        self._sagas_finish(world)
        self._completed_runs_keep_their_effects(world)
        self._approvals_authorise_what_they_showed(world)
        self._committed_steps_never_rerun(world)
        self._waits_are_sane(world)
        self._open_runs_are_not_lost(world)
        self._zombies_apply_nothing(world)

    def _effects_land_once(self, world: World) -> None:
        """1. At most one application and one undo per key; an undo only of what was applied before it."""
        seen: dict[tuple[str, str, str], int] = {}
        for call in world.landed:
            target = call.undoes if call.kind == "undo" else call.idempotency_key
            seen[(call.receiver, call.kind, target)] = seen.get((call.receiver, call.kind, target), 0) + 1
            if call.kind == "undo":
                assert (call.receiver, "apply", target) in seen, (
                    f"{call.receiver}: effect {target} was undone (call {call.id}) but never applied before"
                )
        twice = {key: n for key, n in seen.items() if n > 1}
        assert not twice, f"effects landed more than once (receiver, kind, key): {twice}"

    def _sagas_finish(self, world: World) -> None:
        """2. A finished run has no compensation pending, and a saga leaves nothing silently undone.

        8. A run completes only once every step of its plan is done (none jumped over).
        """
        applied = {c.idempotency_key for c in world.landed if c.kind == "apply"}
        undone = {c.undoes for c in world.landed if c.kind == "undo"}
        for run_id, run in world.runs.items():
            if not run.is_finished:
                continue
            left = world.unfinished_steps.get(run_id, [])
            pending = [(s.step_id, s.args) for s in left if s.kind == StepKind.COMPENSATE]
            # A saga that cannot finish stops `failed`, listing what is left to undo: that is visible.
            listed = set((run.error or {}).get("left_to_undo") or []) if run.status == RunStatus.FAILED else set()
            assert all(args.get("effect") in listed for _, args in pending), (
                f"run {run_id} ({run.workflow}) is {run.status} while its compensation is still pending: {pending}; "
                "a started saga must finish, or stop visibly with what is left to undo"
            )
            if run.status == RunStatus.COMPLETED:
                assert not left, (
                    f"run {run_id} ({run.workflow}) completed with plan steps never done: "
                    f"{[(s.step_id, s.status) for s in left]}"
                )
            saga = run.status == RunStatus.FAILED or (
                run.status == RunStatus.CANCELLED and self.tracked[run_id].compensate
            )
            if not saga:
                continue
            # Kept for another run that still stands on it: recorded in the saga's history, not silent.
            kept = {
                key
                for detail in Event.objects.filter(run_id=run_id, kind="compensation_kept").values_list(
                    "detail", flat=True
                )
                for key in detail.get("effects", {})
            }
            for effect in world.effects:
                key = effect.idempotency_key
                if str(effect.run_id) != run_id or effect.tool not in COMPENSABLE_TOOLS:
                    continue
                visible = key in listed or key in kept or effect.needs_attention
                assert key not in applied or key in undone or visible, (
                    f"run {run_id} ({run.workflow}) ended {run.status} after compensating, but effect {key} "
                    f"({effect.tool}, outbox status {effect.status}) landed and was neither undone nor flagged "
                    "for an operator: a saga half-done in silence"
                )

    def _completed_runs_keep_their_effects(self, world: World) -> None:
        """9. A completed run's effects are in force: none of the keys its steps use was undone.

        A step that runs again (resume, rerun, fork with the same input) after its effect was compensated
        must apply it again or stop, not take the undone effect as done.
        """
        undone = {c.undoes for c in world.landed if c.kind == "undo"}
        for run_id, run in world.runs.items():
            if run.status != RunStatus.COMPLETED:
                continue
            scope = f"{run.effect_scope or run_id}:"
            lost = sorted(key for key in undone if key.startswith(scope))
            assert not lost, (
                f"run {run_id} ({run.workflow}) completed, but effects its steps rely on were undone by a "
                f"compensation: {lost}; a compensated effect was taken as applied when its step ran again"
            )

    def _approvals_authorise_what_they_showed(self, world: World) -> None:
        """3. Every applied approval-gated call has an approved wait that showed exactly its arguments."""
        for effect in world.effects:
            if effect.tool != machine_refund.name or effect.status in ("pending", "failed"):
                continue
            shown = [
                _shown_arguments(w)
                for w in world.waits
                if w.kind == WaitKind.APPROVAL
                and w.effect_key == effect.idempotency_key
                and w.status == WaitStatus.APPROVED
            ]
            assert any(_same_call(s, effect) for s in shown), (
                f"run {effect.run_id}: {effect.tool} applied {effect.args} under key {effect.idempotency_key}, "
                f"but the approved waits showed {shown or 'nothing'}; an approval authorises only what it showed"
            )

    def _committed_steps_never_rerun(self, world: World) -> None:
        """4. No step body ran again after its checkpoint was committed (reruns and re-plans make new rows)."""
        assert not world.reexecuted, f"committed steps executed again (run, step): {world.reexecuted}"

    def _waits_are_sane(self, world: World) -> None:
        """6. One open wait per run at most; closed waits stay closed as decided; finished runs wait for nothing."""
        open_waits: dict[str, list[int]] = {}
        for wait in world.waits:
            run = world.runs[str(wait.run_id)]
            if wait.id in self.closed_waits:
                assert wait.status == self.closed_waits[wait.id], (
                    f"run {run.id}: {wait.kind} wait {wait.id} was {self.closed_waits[wait.id]} and is now "
                    f"{wait.status}; a closed wait never reopens or changes its decision"
                )
            elif wait.status != WaitStatus.OPEN:
                self.closed_waits[wait.id] = wait.status
            else:
                open_waits.setdefault(str(run.id), []).append(wait.id)
                assert not run.is_finished, f"run {run.id} is {run.status} with its wait {wait.id} still open"
                if wait.kind == WaitKind.APPROVAL and wait.id not in self.forms:
                    self.forms.append(wait.id)
        several = {run: ids for run, ids in open_waits.items() if len(ids) > 1}
        assert not several, f"runs with more than one open wait: {several}"

    def _open_runs_are_not_lost(self, world: World) -> None:
        """5. Every open run is leased, waiting on an open wait, or found by the next sweep."""
        now = clock.now()
        waiting_on = {str(w.run_id) for w in world.waits if w.status == WaitStatus.OPEN}
        unleased = []
        for run_id, run in world.runs.items():
            if run.status == RunStatus.WAITING:
                assert run_id in waiting_on, (
                    f"run {run_id} ({run.workflow}) is waiting with no open wait: nothing will ever wake it"
                )
            elif run.status in ACTIVE_RUN_STATUSES and not (run.lease_expires_at and run.lease_expires_at > now):
                unleased.append(run_id)
        # Asking the sweep costs a dozen queries, so its verdict is remembered by the shape of the run row
        # it decides on (see _sweep_shape), across examples: each shape is asked once per test session.
        unknown = [run_id for run_id in unleased if _sweep_shape(world.runs[run_id], now) not in _FOUND_SHAPES]
        if unknown:
            found = _found_by_next_sweep(unknown)
            lost = set(unknown) - found
            assert not lost, f"runs {sorted(lost)} are runnable, unleased and invisible to the sweep: lost forever"
            _FOUND_SHAPES.update(_sweep_shape(world.runs[run_id], now) for run_id in found)

    def _zombies_apply_nothing(self, world: World) -> None:
        """7. Every call that reached a receiver came from the execution holding the run's lease."""
        for call in world.calls:
            assert call.held, (
                f"run {call.run_id}: a worker that had lost its lease (token {call.token}) called {call.receiver} "
                f"({call.kind} {call.idempotency_key}, deduped={call.deduped}); a zombie never applies an effect"
            )

    # --- teardown ---------------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            for worker in self.paused.values():
                worker.release(die=True)
            alive = [w.run_id for w in self.workers if w.is_alive()]
            assert not alive, f"worker threads of runs {alive} outlived their example"
        finally:
            control.reset()
            clock.reset()
            _forget([uuid.UUID(i) for i in self.tracked])
            MachineOrder.objects.filter(order_id__startswith=f"M-{self.nonce}-").delete()


def _forget(ids: list[uuid.UUID]) -> None:
    """Delete the example's runs with everything that hangs off them, so the next example's sweeps stay small.

    Raw DELETEs in one transaction (foreign keys are checked at commit): the ORM's cascade collector would
    cost more than the example itself.
    """
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {Reliance._meta.db_table} WHERE run_id = ANY(%s) OR effect_id IN "
            f"(SELECT id FROM {Effect._meta.db_table} WHERE run_id = ANY(%s))",
            [ids, ids],
        )
        for model in (Event, Wait, Turn, Payload, Effect, Step, Execution, ReceiverCall):
            cursor.execute(f"DELETE FROM {model._meta.db_table} WHERE run_id = ANY(%s)", [ids])
        cursor.execute(f"DELETE FROM {Run._meta.db_table} WHERE id = ANY(%s)", [ids])


def _shown_arguments(wait: Wait) -> Any:
    """What an approval wait showed the human: its arguments' hash if the engine keeps it, else the question's."""
    if wait.args_hash:
        return {"args_hash": wait.args_hash}
    prefix = f"Allow {machine_refund.name}("
    if wait.question.startswith(prefix) and wait.question.endswith(")?"):
        try:
            return json.loads(wait.question[len(prefix) : -2])
        except ValueError:
            pass
    return {"question": wait.question}


def _same_call(shown: Any, effect: Effect) -> bool:
    if "args_hash" in shown:
        return shown["args_hash"] == machine_refund.args_hash(effect.args)
    return shown == effect.args


def _sweep_shape(run: Run, now: Any) -> tuple[Any, ...]:
    """What the sweep decides on, one idle period from `now`: status, lease, due retry, cancel request.

    The clock only moves forward, and every timestamp the sweep compares is either already past or in
    the future by a known sign, so runs of one shape get one verdict.
    """
    horizon = now + SWEEP_HORIZON

    def when(moment: Any) -> str:
        return "none" if moment is None else ("past" if moment <= horizon else "future")

    return (
        run.status,
        when(run.lease_expires_at),
        bool(run.lease_owner),
        when(run.wake_at),
        run.cancel_requested_at is not None,
        run.swept_at is not None,
        bool(run.finish_as),
    )


# Shapes of unleased runnable runs the sandboxed sweep found (a test-session cache; see above).
_FOUND_SHAPES: set[tuple[Any, ...]] = set()


def _found_by_next_sweep(run_ids: list[str]) -> set[str]:
    """The runs the next sweep (one idle period from now) would wake or settle: run it, then roll it back.

    Found: the sweep recorded anything for the run (woken, a cancellation settled, a saga planned) or
    changed its row.
    """
    fields = ("id", "status", "lease_token", "swept_at", "cancel_requested_at", "finish_as", "cursor")
    found: set[str] = set()
    try:
        with transaction.atomic():
            before = set(Run.objects.filter(pk__in=run_ids).values_list(*fields))
            mark = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
            clock.advance(SWEEP_HORIZON)
            try:
                sweep()
            finally:
                clock.advance(-SWEEP_HORIZON)
            recorded = Event.objects.filter(id__gt=mark, run_id__in=run_ids).values_list("run_id", flat=True)
            changed = set(Run.objects.filter(pk__in=run_ids).values_list(*fields)) - before
            found = {str(r) for r in recorded} | {str(row[0]) for row in changed}
            raise _Rollback
    except _Rollback:
        pass
    return found


# Generating is bounded by the profile; shrinking a failure is bounded by Hypothesis (about five minutes).
@pytest.mark.timeout(1200)
def test_engine__keeps_its_guarantees_under_random_interleavings() -> None:
    profile = PROFILES[os.environ.get("DURABLE_STATEFUL_PROFILE", "ci")]
    with machine_settings(), fast_commits():
        run_state_machine_as_test(DurableMachine, settings=profile)
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("machine-worker")]
    assert not leftover, f"worker threads outlived the examples that started them: {leftover}"
