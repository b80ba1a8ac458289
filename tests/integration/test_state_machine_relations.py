"""A stateful hunt for holes in the relations between runs (Postgres, Redis): families, keys, buckets, schedules.

Three machines, each with its own test, interleave operators, workers (in this process), the sweep and the database
clock at random and check after every step:

Families and concurrency keys (`FamilyMachine`: `fan_*` parents of `child_work` / `keyed_child_work` children that
charge a ledger and wait for signal "go", and the `keyed` / `keyed_approval` runs):

1. every charge of a family a compensating cancel reached (the cancelled run and all its children and theirs, those
   that had already completed included) is refunded exactly once, once all those runs have ended and the family's
   saga is over (no `family_undo` left) — but for a charge the history says was kept for a run that still stands
   on it (`compensation_kept`: a fork that shares its keys);
2. no charge is refunded twice, and no ledger key is charged twice (no run fails on the ledger's unique key);
3. after a sweep, a cancelled parent has no child left live that is not on its way out (compensating, or its cancel
   requested);
4. no run is lost: every unfinished run is pending, running or waiting on an open wait, and driving, signalling,
   deciding and sweeping brings every run of the example to an end (checked when each example ends);
5. a concurrency key is held by at most its limit of families (admitted, unfinished runs that are not in their
   family's slot); after a sweep, no queued run of a key with a free slot is left unadmitted, and a child in its
   family's slot (`slot_of`) never waits behind its own family.

Shared rate-limit buckets (`BucketMachine`: the real Anthropic participant against a fake Messages API, on the
Postgres or the Redis backend):

6. a bucket never blocks past its horizon: every theoretical arrival time is a finite number at most the backend's
   now + LONGEST_RETRY_AFTER_SECONDS + the burst (+ what the test itself debited), whatever retry-after a 429 brought
   (NaN, inf, 1e400, negative, a year, a date) or reset the `anthropic-ratelimit-*` headers named;
7. nothing raises out of the limiter but the documented transient error (ModelUnavailableError, with a finite
   retry_after), also while its Redis is down or was flushed.

Schedules (`ScheduleMachine`: good schedules of `record` and a bad one whose slot arguments Postgres refuses):

8. no slot (schedule, slot time) is started twice, also by two sweeps at once;
9. a bad schedule never stops another schedule's due slot from starting, and its failed slot records `last_error`;
10. a paused schedule starts nothing, and no slot of its pause is started after it resumes.

Profiles (DURABLE_STATEFUL_PROFILE): `ci` (default: bounded and derandomized) and `long` (DURABLE_STATEFUL_EXAMPLES
random examples). Every example creates its own rows (names carry a nonce), checks only those and deletes them when
it ends. Time moves on the database clock (`clock.advance`), never by sleeping.
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

import pytest
import redis
from django.conf import settings as django_settings
from django.db import connection, connections, transaction
from django.test.utils import override_settings
from hypothesis import HealthCheck, Phase, note, settings
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
from durable_agents.agents import rate_limits
from durable_agents.agents.claude import LONGEST_RETRY_AFTER_SECONDS, retry_after
from durable_agents.agents.messages import ModelRequest
from durable_agents.agents.participants import participants
from durable_agents.engine import family
from durable_agents.engine.admission import IN_FAMILY_SLOT, holding, slots_held
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.runs import cancel_run
from durable_agents.engine.schedules import slot_key, start_due_schedules
from durable_agents.engine.sweep import sweep
from durable_agents.errors import (
    InvalidTransitionError,
    ModelUnavailableError,
    PermanentError,
    StepNotFoundError,
    WaitClosedError,
)
from durable_agents.models import (
    ACTIVE_RUN_STATUSES,
    QUEUED,
    RUNNABLE_RUN_STATUSES,
    Effect,
    EffectKind,
    Event,
    Payload,
    RateBucket,
    Reliance,
    Run,
    RunStatus,
    Schedule,
    Step,
    Turn,
    Wait,
    WaitKind,
    WaitStatus,
)
from durable_agents.signals import run_finished
from durable_agents.testing.fake_anthropic import Fault, Reply
from tests.integration.test_agent_faults import claude_on_the_fake
from tests.testapp.machine import active, fast_commits, machine_settings, runnable, stopped
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


def _profile(ci_examples: int, ci_steps: int) -> settings:
    examples = os.environ.get("DURABLE_STATEFUL_EXAMPLES")
    common: dict[str, Any] = {
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    }
    if os.environ.get("DURABLE_STATEFUL_SHRINK") == "0":  # report the first failure as found, at once
        common["phases"] = [Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("DURABLE_STATEFUL_PROFILE", "ci") == "long":
        return settings(max_examples=int(examples or "2000"), stateful_step_count=50, **common)
    return settings(
        max_examples=int(examples or ci_examples),
        stateful_step_count=ci_steps,
        derandomize=True,
        database=None,
        **common,
    )


DRIVE_LIMIT = 15
# Past IDLE_RESWEEP_SECONDS (machine_settings: 1 s): the sweep looks at every open join and idle run again.
SWEEP_STEP = timedelta(seconds=2)
FINISHED = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


def _close_thread_connections() -> None:
    connections.close_all()


# =====================================================================================================================
# Families and concurrency keys
# =====================================================================================================================

# Parents fanning out (and keyed runs), and whether their input carries a customer (the key).
FAMILY_WORKFLOWS = {
    "fan_all": False,
    "fan_collect": False,
    "fan_any": False,
    "fan_keyed": True,
    "fan_keyed_children": True,
    "fan_keyed_plain_children": True,
    "keyed": True,
    "keyed_approval": True,
}
FANS = tuple(name for name in FAMILY_WORKFLOWS if name.startswith("fan_"))
CHILD_WORKFLOWS = ("child_work", "keyed_child_work")
RERUN_STEPS = ("fan", "after", "charge", "go", "work", "enter", "leave")
# Customers and the limit every top-level run of theirs is started with (children of keyed_child_work take its 1).
CUSTOMERS = {"c1": 1, "c2": 2}
MAX_TOP_LEVEL = 5
WHICH = st.integers(0, 63)


@dataclass
class Compensating:
    """A compensating cancel: the family it reached (the cancelled run and its children and theirs, finished or
    not), whose charges must all be refunded once they have all ended."""

    what: str
    runs: frozenset[str]


@dataclass
class FamilyWorld:
    runs: dict[str, Run]
    open_waits: dict[str, list[Wait]]


class FamilyMachine(RuleBasedStateMachine):
    """Fan-out parents, their children and keyed runs: driven, signalled, cancelled, resumed, rerun, forked, swept."""

    def __init__(self) -> None:
        super().__init__()
        self.nonce = uuid.uuid4().hex[:8]
        self.tracked: dict[str, str] = {}  # run id -> name (run0, run1, ...)
        self.top_level = 0
        self.orders = 0
        self.compensating: list[Compensating] = []
        self.lost_hand_offs = False
        self.world: FamilyWorld | None = None

    # --- bookkeeping --------------------------------------------------------------------------------------------

    def _key(self, customer: str) -> str:
        return f"R{self.nonce}-{customer}"

    def _limit_of_key(self, key: str) -> int:
        return CUSTOMERS[key.rsplit("-", 1)[1]]

    def _order(self) -> str:
        self.orders += 1
        return f"R{self.nonce}-o{self.orders}"

    def _track(self, run_id: Any, what: str) -> None:
        run_id = str(run_id)
        if run_id not in self.tracked:
            self.tracked[run_id] = f"run{len(self.tracked)}"
            note(f"{self.tracked[run_id]} = {run_id} ({what})")

    def _discover(self) -> None:
        """Children of tracked runs are tracked too (fan-outs start them as their step runs)."""
        while True:
            found = Run.objects.filter(parent_id__in=list(self.tracked)).exclude(pk__in=list(self.tracked))
            rows = list(found.values_list("id", "workflow", "parent_id", "child_index"))
            if not rows:
                return
            # In the order of their parents' names, then by index: a replay names every run the same.
            order = {run_id: i for i, run_id in enumerate(self.tracked)}
            rows.sort(key=lambda row: (order[str(row[2])], row[3]))
            for run_id, workflow, parent, _ in rows:
                self._track(run_id, f"{workflow}, child of {self.tracked[str(parent)]}")

    def _names(self, where: Any) -> list[str]:
        if self.world is None:
            return []
        return [
            name
            for run_id, name in self.tracked.items()
            if run_id in self.world.runs and where(self.world.runs[run_id])
        ]

    def _pick(self, which: int, where: Any) -> str | None:
        """The `which`-th (modulo) of the runs for which `where(run row)` held at the last check, oldest first; None if
        there are none. Drawn as a number whatever the state, so a replay draws alike even if the engine does not."""
        names = self._names(where)
        if not names:
            return None
        name = names[which % len(names)]
        note(f"-> {name}")
        return next(run_id for run_id, n in self.tracked.items() if n == name)

    # --- starting -----------------------------------------------------------------------------------------------

    def _start(self, workflow: str, customer: str, n: int) -> None:
        keyed = FAMILY_WORKFLOWS[workflow]
        key = self._key(customer)
        inp: dict[str, Any] = {"customer": key} if keyed else {}
        if workflow in FANS:
            items = []
            for i in range(n):
                item = {"item": i, "order_id": self._order(), "hold": True}
                if workflow in ("fan_keyed", "fan_keyed_children"):
                    item["customer"] = key
                items.append(item)
            inp["items"] = items
        options = {"concurrency_limit": CUSTOMERS[customer]} if keyed and "customer" in inp else {}
        run = api.start(workflow, inp, **options)
        self.top_level += 1
        self._track(run.id, f"{workflow} {inp}")

    @initialize(workflow=st.sampled_from(FANS), customer=st.sampled_from(sorted(CUSTOMERS)), n=st.integers(1, 2))
    def start_first(self, workflow: str, customer: str, n: int) -> None:
        self._start(workflow, customer, n)

    @precondition(lambda self: self.top_level < MAX_TOP_LEVEL)
    @rule(
        workflow=st.sampled_from(sorted(FAMILY_WORKFLOWS)),
        customer=st.sampled_from(sorted(CUSTOMERS)),
        n=st.integers(1, 2),
    )
    def start(self, workflow: str, customer: str, n: int) -> None:
        self._start(workflow, customer, n)

    # --- workers ------------------------------------------------------------------------------------------------

    def _drive(self, run_id: str, limit: int = DRIVE_LIMIT) -> None:
        for _ in range(limit):
            row = Run.objects.filter(pk=run_id).values_list("status", flat=True).first()
            if row not in RUNNABLE_RUN_STATUSES or advance(run_id) is Outcome.SKIPPED:
                return

    @rule(which=WHICH)
    def advance_once(self, which: int) -> None:
        run = self._pick(which, runnable)
        if run is not None:
            advance(run)

    @rule(which=WHICH)
    def drive(self, which: int) -> None:
        run = self._pick(which, runnable)
        if run is not None:
            self._drive(run)

    @rule(which=WHICH)
    def signal_go(self, which: int) -> None:
        child = self._pick(which, _live_child)
        if child is None:
            return
        try:
            api.send_signal(child, "go", {}, by="machine")
        except (InvalidTransitionError, WaitClosedError):
            return

    @rule(which=WHICH, approve=st.booleans())
    def decide(self, which: int, approve: bool) -> None:
        run = self._pick(which, self._waiting_for_approval)
        if run is None:
            return
        assert self.world is not None
        wait = next(w for w in self.world.open_waits[run] if w.kind == WaitKind.APPROVAL)
        try:
            api.decide(wait.id, approve, by="machine", via="form")
        except (WaitClosedError, InvalidTransitionError):
            return

    def _waiting_for_approval(self, run: Run) -> bool:
        assert self.world is not None
        return any(w.kind == WaitKind.APPROVAL for w in self.world.open_waits.get(str(run.id), []))

    # --- operators ----------------------------------------------------------------------------------------------

    def _family(self, run_id: str) -> frozenset[str]:
        """The run and its (grand)children, finished or not: what a compensating cancel of it is to undo."""
        family_ = {run_id}
        frontier = [run_id]
        while frontier:
            kids = Run.objects.filter(parent_id__in=frontier)
            frontier = [str(k) for k in kids.values_list("id", flat=True)]
            family_.update(frontier)
        return frozenset(family_)

    def _restarted(self, run_id: str) -> None:
        """A run (and the children a resume brings back with it) is working again: its compensation no longer holds."""
        back = {run_id, *(str(k) for k in Run.objects.filter(parent_id=run_id).values_list("id", flat=True))}
        self.compensating = [c for c in self.compensating if not (c.runs & back)]

    @rule(which=WHICH, compensate=st.booleans())
    def cancel(self, which: int, compensate: bool) -> None:
        run = self._pick(which, active)
        if run is None:
            return
        scope = self._family(run) if compensate else frozenset()
        try:
            api.cancel(run, reason="machine", compensate=compensate, actor="machine")
        except InvalidTransitionError:
            return
        if compensate:
            self.compensating.append(Compensating(f"cancel of {self.tracked[run]}", scope))
            names = sorted(self.tracked.get(r, r) for r in scope)
            note(f"compensating cancel of {self.tracked[run]}: its family {names}")

    @rule(which=WHICH, compensate=st.booleans())
    def cancel_and_die(self, which: int, compensate: bool) -> None:
        """The parent's cancel commits, then the operator's process dies before it reaches the children."""
        run = self._pick(which, _active_parent)
        if run is None:
            return
        scope = self._family(run) if compensate else frozenset()
        run_finished.disconnect(dispatch_uid="durable_agents.engine.family")
        try:
            cancel_run(run, reason="machine", actor="machine", compensate=compensate)
        except InvalidTransitionError:
            return
        finally:
            run_finished.connect(family._on_run_finished, dispatch_uid="durable_agents.engine.family")
        if compensate:
            self.compensating.append(Compensating(f"dying cancel of {self.tracked[run]}", scope))
            names = sorted(self.tracked.get(r, r) for r in scope)
            note(f"compensating cancel of {self.tracked[run]}: its family {names}")

    @rule(which=WHICH)
    def cancel_and_lose_the_hand_off(self, which: int) -> None:
        """A keyed holder is cancelled and its process dies between the commit and handing its slot on."""
        run = self._pick(which, _keyed_holder)
        if run is None:
            return
        with mock.patch("durable_agents.engine.runs.admit_on_commit", lambda key: None):
            try:
                api.cancel(run, reason="machine", actor="machine")
            except InvalidTransitionError:
                return
        self.lost_hand_offs = True

    @rule(which=WHICH)
    def resume(self, which: int) -> None:
        run = self._pick(which, stopped)
        if run is None:
            return
        try:
            api.resume(run, actor="machine")
        except InvalidTransitionError:
            return  # compensated, or a child under a cancelled parent
        self._restarted(run)

    @rule(which=WHICH, step=st.sampled_from(RERUN_STEPS))
    def rerun(self, which: int, step: str) -> None:
        run = self._pick(which, lambda r: r.status != RunStatus.WAITING)
        if run is None:
            return
        try:
            api.resume(run, step, actor="machine")
        except (InvalidTransitionError, StepNotFoundError):
            return
        self._restarted(run)

    @precondition(lambda self: self.top_level < MAX_TOP_LEVEL)
    @rule(which=WHICH)
    def fork(self, which: int) -> None:
        run = self._pick(which, _fan_parent)
        if run is None:
            return
        try:
            forked = api.fork(run, "fan", actor="machine")
        except (InvalidTransitionError, StepNotFoundError, PermanentError):
            return
        self.top_level += 1
        self._track(forked.id, f"fork of {self.tracked[run]} at fan")

    @rule()
    def sweep(self) -> None:
        clock.advance(SWEEP_STEP)
        sweep()
        self.lost_hand_offs = False
        self._discover()
        self._cancelled_parents_have_no_live_children()
        self._free_slots_are_taken()

    @rule()
    def settle_everything(self) -> None:
        """Drive, signal, approve and sweep until every run of the example has ended (or is reported lost)."""
        self._settle()

    # --- invariants ---------------------------------------------------------------------------------------------

    @invariant()
    def relations_hold(self) -> None:
        self._discover()
        ids = [uuid.UUID(r) for r in self.tracked]
        runs = {str(r.id): r for r in Run.objects.filter(pk__in=ids)}
        open_waits: dict[str, list[Wait]] = {}
        for wait in Wait.objects.filter(run_id__in=ids, status=WaitStatus.OPEN).order_by("id"):
            open_waits.setdefault(str(wait.run_id), []).append(wait)
        self.world = FamilyWorld(runs, open_waits)
        self._runs_are_somewhere(runs, open_waits)
        self._ledger_is_sound(runs)
        self._compensations_are_complete(runs)
        self._keys_hold_their_limits()
        if not self.lost_hand_offs:
            self._children_never_wait_behind_their_parent()

    def _runs_are_somewhere(self, runs: dict[str, Run], open_waits: dict[str, list[Wait]]) -> None:
        """4. Every unfinished run is pending, running, or waiting on an open wait."""
        for run_id, run in runs.items():
            assert run.status in (*ACTIVE_RUN_STATUSES, *FINISHED), f"{self.tracked[run_id]}: status {run.status}"
            if run.status == RunStatus.WAITING:
                assert open_waits.get(run_id), f"{self.tracked[run_id]} is waiting with no open wait: lost"
            if run.is_finished:
                assert not open_waits.get(run_id), f"{self.tracked[run_id]} is {run.status} with an open wait"

    def _ledger_is_sound(self, runs: dict[str, Run]) -> None:
        """2. No ledger key charged twice (no run failed on the ledger's unique key); no charge refunded twice."""
        for run_id, run in runs.items():
            message = str((run.error or {}).get("message", ""))
            assert "duplicate key" not in message and "IntegrityError" not in message, (
                f"{self.tracked[run_id]} failed on a ledger key applied twice: {message}"
            )
        refunds = self._refunds_by_charge()
        twice = {charge: n for charge, n in refunds.items() if n > 1}
        assert not twice, f"charges refunded more than once (charge key: refunds): {twice}"

    def _refunds_by_charge(self) -> dict[str, int]:
        prefix = f"R{self.nonce}-"
        refund_keys = set(
            LedgerEntry.objects.filter(kind="refund", order_id__startswith=prefix).values_list(
                "idempotency_key", flat=True
            )
        )
        undoes = Effect.objects.filter(kind=EffectKind.COMPENSATION, idempotency_key__in=refund_keys).values_list(
            "idempotency_key", "compensates__idempotency_key"
        )
        found = {key: charge for key, charge in undoes}
        stray = refund_keys - set(found)
        assert not stray, f"refund ledger rows that no compensation of the engine made: {sorted(stray)}"
        counts: dict[str, int] = {}
        for charge in found.values():
            counts[charge] = counts.get(charge, 0) + 1
        return counts

    def _compensations_are_complete(self, runs: dict[str, Run]) -> None:
        """1. Once every run of a compensated family has ended and its saga is over, each charge is refunded once
        (but for those the history says were kept for another run)."""
        if not self.compensating:
            return
        refunds = None
        for comp in self.compensating:
            if not all(runs[r].is_finished for r in comp.runs if r in runs):
                continue
            if Run.objects.filter(pk__in=list(comp.runs), family_undo=True).exists():
                continue  # the sweep has not let go of the family yet: a child may still be reached
            refunds = refunds if refunds is not None else self._refunds_by_charge()
            keys = set(
                Effect.objects.filter(run_id__in=list(comp.runs), kind=EffectKind.EFFECT, tool="charge").values_list(
                    "idempotency_key", flat=True
                )
            )
            charged = set(
                LedgerEntry.objects.filter(kind="charge", idempotency_key__in=keys).values_list(
                    "idempotency_key", flat=True
                )
            )
            kept = set()
            for detail in Event.objects.filter(run_id__in=list(comp.runs), kind="compensation_kept").values_list(
                "detail", flat=True
            ):
                kept |= set(((detail or {}).get("effects") or {}).keys())
            missing = sorted(k for k in charged - kept if refunds.get(k, 0) != 1)
            ended = {self.tracked.get(r, r): runs[r].status for r in comp.runs if r in runs}
            assert not missing, (
                f"{comp.what}: every run live then has ended ({ended}), but charges {missing} were refunded "
                f"{[refunds.get(k, 0) for k in missing]} times, not once"
            )

    def _my_keys(self) -> list[str]:
        return [self._key(c) for c in sorted(CUSTOMERS)]

    def _keys_hold_their_limits(self) -> None:
        """5. At most `limit` families hold a key.

        A family is a run and its descendants keyed the same: children in its slot (`slot_of`), and children that
        outlive a cancelled parent (they hold the key in their own right until the sweep stops them, so the engine
        counts a slot for each of them: the key is never free while the family works, never over-admitted)."""
        for key in self._my_keys():
            limit = self._limit_of_key(key)
            rows = Run.objects.filter(concurrency_key=key).values_list("id", "slot_of_id", "slot_of__concurrency_key")
            parent_of = {run_id: ancestor for run_id, ancestor, ancestor_key in rows if ancestor_key == key}

            holders = Run.objects.filter(holding(key)).values_list("id", "workflow", "status")
            families: dict[Any, list[str]] = {}
            for run_id, workflow, _status in holders:
                families.setdefault(_root(run_id, parent_of), []).append(
                    f"{self.tracked.get(str(run_id), run_id)} {workflow}"
                )
            assert len(families) <= limit, (
                f"key {key} (limit {limit}) is held by {len(families)} families at once: {list(families.values())}"
            )

    def _children_never_wait_behind_their_parent(self) -> None:
        """5. A child whose family holds its key is admitted at once, in the family's slot."""
        stuck = Run.objects.filter(
            QUEUED, IN_FAMILY_SLOT, concurrency_key__in=self._my_keys(), cancel_requested_at=None
        )
        names = [self.tracked.get(str(r), r) for r in stuck.values_list("id", flat=True)]
        assert not names, f"children queued behind their own parent, which holds their key: {names}"

    def _free_slots_are_taken(self) -> None:
        """5. After a sweep, a key with a free slot has no queued run left (the head's limit decides)."""
        self._children_never_wait_behind_their_parent()
        for key in self._my_keys():
            queue = Run.objects.filter(QUEUED, concurrency_key=key, cancel_requested_at=None).order_by(
                "created_at", "id"
            )
            head = queue.values_list("id", "concurrency_limit").first()
            if head is None:
                continue
            held = slots_held(key)
            assert held >= head[1], (
                f"key {key}: {self.tracked.get(str(head[0]), head[0])} waits at the head of the queue (limit "
                f"{head[1]}) while only {held} slot(s) are held, after a sweep"
            )

    def _cancelled_parents_have_no_live_children(self) -> None:
        """3. After a sweep, every child of a cancelled parent has ended or is on its way out."""
        live = Run.objects.filter(
            parent__status=RunStatus.CANCELLED,
            parent_id__in=[uuid.UUID(r) for r in self.tracked],
            status__in=ACTIVE_RUN_STATUSES,
            cancel_requested_at=None,
            finish_as="",
        )
        names = [(self.tracked.get(str(r), r), s) for r, s in live.values_list("id", "status")]
        assert not names, f"children of cancelled parents still live after a sweep: {names}"

    # --- settling -----------------------------------------------------------------------------------------------

    def _settle(self, rounds: int = 12) -> None:
        for _ in range(rounds):
            self._discover()
            ids = [uuid.UUID(r) for r in self.tracked]
            open_runs = list(
                Run.objects.filter(pk__in=ids, status__in=ACTIVE_RUN_STATUSES).values_list("id", "workflow")
            )
            if not open_runs:
                return
            for run_id, workflow in open_runs:
                if workflow in CHILD_WORKFLOWS:
                    with suppress(InvalidTransitionError, WaitClosedError):
                        api.send_signal(run_id, "go", {}, by="machine")
            for wait_id in Wait.objects.filter(
                run_id__in=ids, status=WaitStatus.OPEN, kind=WaitKind.APPROVAL
            ).values_list("id", flat=True):
                with suppress(WaitClosedError, InvalidTransitionError):
                    api.decide(wait_id, True, by="machine", via="form")
            for run_id, _ in open_runs:
                self._drive(str(run_id), limit=30)
            clock.advance(SWEEP_STEP)
            sweep()
            self.lost_hand_offs = False
        self._discover()
        left = Run.objects.filter(pk__in=[uuid.UUID(r) for r in self.tracked], status__in=ACTIVE_RUN_STATUSES)
        stuck = [
            (self.tracked[str(r.id)], r.workflow, r.status, r.concurrency_key, r.admitted_at is not None, r.finish_as)
            for r in left
        ]
        assert not stuck, f"runs that driving, signalling, approving and sweeping never brought to an end: {stuck}"

    def teardown(self) -> None:
        try:
            if self.tracked:
                self._settle()
                self.relations_hold()
        finally:
            clock.reset()
            _forget([uuid.UUID(r) for r in self.tracked])
            LedgerEntry.objects.filter(order_id__startswith=f"R{self.nonce}-").delete()


def _root(run_id: Any, parent_of: dict[Any, Any]) -> Any:
    """The family a run works for: the ancestor whose slot it was started in (`slot_of`), else itself."""
    while run_id in parent_of:
        run_id = parent_of[run_id]
    return run_id


def _live_child(run: Run) -> bool:
    return run.workflow in CHILD_WORKFLOWS and run.status in ACTIVE_RUN_STATUSES


def _active_parent(run: Run) -> bool:
    return run.workflow in FANS and run.status in ACTIVE_RUN_STATUSES


def _fan_parent(run: Run) -> bool:
    return run.workflow in FANS and run.parent_id is None


def _keyed_holder(run: Run) -> bool:
    return run.concurrency_key is not None and run.admitted_at is not None and run.status in ACTIVE_RUN_STATUSES


def _forget(ids: list[uuid.UUID]) -> None:
    """Delete runs with everything that hangs off them (raw DELETEs, foreign keys checked at commit)."""
    if not ids:
        return
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {Reliance._meta.db_table} WHERE run_id = ANY(%s) OR effect_id IN "
            f"(SELECT id FROM {Effect._meta.db_table} WHERE run_id = ANY(%s))",
            [ids, ids],
        )
        cursor.execute(f"UPDATE {Schedule._meta.db_table} SET last_run_id = NULL WHERE last_run_id = ANY(%s)", [ids])
        for model in (Event, Wait, Turn, Payload, Effect, Step, Execution):
            cursor.execute(f"DELETE FROM {model._meta.db_table} WHERE run_id = ANY(%s)", [ids])
        cursor.execute(f"UPDATE {Run._meta.db_table} SET parent_id = NULL WHERE parent_id = ANY(%s)", [ids])
        cursor.execute(f"UPDATE {Run._meta.db_table} SET forked_from_id = NULL WHERE forked_from_id = ANY(%s)", [ids])
        cursor.execute(f"DELETE FROM {Run._meta.db_table} WHERE id = ANY(%s)", [ids])


# Generating is bounded by the profile; shrinking a failure is bounded by Hypothesis (about five minutes).
@pytest.mark.timeout(1800)
def test_families_and_keys__keep_their_promises_under_random_interleavings() -> None:
    with machine_settings(), fast_commits():
        run_state_machine_as_test(FamilyMachine, settings=_profile(ci_examples=120, ci_steps=30))


# =====================================================================================================================
# Shared rate-limit buckets
# =====================================================================================================================

API_KEY = "sk-ant-test-secret-relations-0123456789"
BURST = 1.0
# Hostile and ordinary retry-after values a 429 may bring (seconds, or milliseconds under retry-after-ms).
RETRY_AFTERS = (
    "nan",
    "NaN",
    "inf",
    "-inf",
    "1e400",
    "-5",
    "-0",
    "0",
    "3",
    "40",
    "899",
    "901",
    str(365 * 86400),
    "a year",
    "Wed, 21 Oct 2026 07:28:00 GMT",
    "1e308",
    "",
)
# `anthropic-ratelimit-*` headers an answer may carry: a reset far away, in the past, unreadable, or normal.
RESETS = ("9999-12-31T23:59:59Z", "1970-01-01T00:00:00Z", "soon", "2026-01-01T00:00:30Z", "nan")
CLOCK_STEPS = (1, 30, 61, 600, 901, 86400)


class BucketMachine(RuleBasedStateMachine):
    """Model calls through one shared bucket: answers, 429s with any retry-after, headers, refunds, outages, time."""

    def __init__(self) -> None:
        super().__init__()
        self.model = f"claude-relations-{uuid.uuid4().hex[:8]}"
        self.backend_url = "postgres"
        self.debited = 0.0  # seconds the test itself pushed the bucket forward (debits beyond the reservations)
        self.answer: Reply | Fault = Reply.text("ok")

    @initialize(backend=st.sampled_from(["postgres", "redis"]))
    def choose_backend(self, backend: str) -> None:
        self.backend_url = "postgres" if backend == "postgres" else _BUCKET_REDIS
        note(f"model {self.model} on {self.backend_url}")

    @contextmanager
    def _limited(self, backend: str | None = None) -> Any:
        durable = {
            **django_settings.DURABLE_AGENTS,
            "MODEL_RATE_LIMITS": {self.model: {"requests_per_minute": 600}},
            "RATE_LIMIT_BACKEND": backend or self.backend_url,
            "RATE_LIMIT_MAX_WAIT_SECONDS": 0.0,
            "RATE_LIMIT_BURST_SECONDS": BURST,
        }
        with override_settings(DURABLE_AGENTS=durable):
            yield

    @property
    def bucket(self) -> str:
        return rate_limits.bucket_name(self.model, API_KEY)

    def _respond(self, backend: str | None = None) -> Any:
        """One model call through the real participant; only the documented transient error may come out."""
        request = ModelRequest(
            model=self.model, max_tokens=16, system="", tools=(), messages=({"role": "user", "content": "hi"},)
        )
        with self._limited(backend):
            try:
                return participants.get("anthropic").respond(request)
            except ModelUnavailableError as exc:
                wait = exc.retry_after
                assert wait is None or (math.isfinite(wait) and wait >= 0), f"a transient error to wait {wait!r}"
                return exc

    @rule()
    def call_answered(self) -> None:
        _FAKE_ANSWER[0] = Reply.text("ok")
        self._respond()

    @rule(value=st.sampled_from(RETRY_AFTERS), header=st.sampled_from(["retry-after", "retry-after-ms"]))
    def call_refused_with_429(self, value: str, header: str) -> None:
        headers = {header: value} if value else {}
        _FAKE_ANSWER[0] = Fault.status(429, "slow down", headers)
        note(f"429 with {headers}: retry_after() reads {retry_after(headers)!r}")
        self._respond()

    @rule(
        remaining=st.sampled_from(["0", "1", "nan", "-1", "1e400"]),
        reset=st.sampled_from(RESETS),
        date=st.sampled_from(["", "Thu, 01 Jan 2026 00:00:00 GMT", "not a date"]),
    )
    def observe_headers(self, remaining: str, reset: str, date: str) -> None:
        headers = {
            "anthropic-ratelimit-requests-limit": "100",
            "anthropic-ratelimit-requests-remaining": remaining,
            "anthropic-ratelimit-requests-reset": reset,
        }
        if date:
            headers["date"] = date
        with self._limited():
            limiter = rate_limits.limiter()
            assert limiter is not None
            hold = limiter.observe(self.model, API_KEY, headers)
        assert math.isfinite(hold) and 0 <= hold <= rate_limits.LONGEST_HEADER_HOLD_SECONDS, hold

    @rule(seconds=st.sampled_from([-600.0, -5.0, -0.1, 0.05, 0.5]))
    def debit_or_refund(self, seconds: float) -> None:
        """A correction after a call: a refund (negative) or a debit of tokens beyond the estimate."""
        with self._limited():
            rate_limits.backend().debit(self.bucket, (seconds, 0.0, 0.0))
        self.debited += max(seconds, 0.0)

    @rule()
    def reserve_directly(self) -> None:
        with self._limited():
            wait = rate_limits.backend().reserve(self.bucket, (0.1, 0.0, 0.0), BURST, 0.0)
        assert wait is None or (math.isfinite(wait) and wait >= 0), wait

    @rule()
    def redis_is_down(self) -> None:
        """The limiter's Redis cannot be reached before a call: a transient error, nothing sent."""
        _FAKE_ANSWER[0] = Reply.text("ok")
        sent = len(_FAKE[0].requests)
        outcome = self._respond(f"redis://127.0.0.1:{_DEAD_PORT}/0")
        assert isinstance(outcome, ModelUnavailableError), f"a call went on without its limiter: {outcome!r}"
        assert len(_FAKE[0].requests) == sent, "a call was sent while the limiter could not say there was room"

    @precondition(lambda self: self.backend_url != "postgres")
    @rule()
    def redis_is_flushed(self) -> None:
        redis.Redis.from_url(self.backend_url).delete(f"durable_agents:rate:{self.bucket}")

    @rule(seconds=st.sampled_from(CLOCK_STEPS))
    def advance_clock(self, seconds: int) -> None:
        clock.advance(timedelta(seconds=seconds))

    @invariant()
    def bucket_within_its_horizon(self) -> None:
        """6. Every TAT is finite and no further than now + the cap + the burst (+ what the test debited)."""
        tats, now = self._tats()
        horizon = now + LONGEST_RETRY_AFTER_SECONDS + BURST + self.debited + 5.0
        for tat in tats:
            assert math.isfinite(tat), f"bucket {self.bucket}: a TAT of {tat!r} blocks every worker for ever"
            assert tat <= horizon, (
                f"bucket {self.bucket}: blocked {tat - now:.1f} s ahead, past its horizon of "
                f"{LONGEST_RETRY_AFTER_SECONDS + BURST + self.debited:.1f} s"
            )

    def _tats(self) -> tuple[list[float], float]:
        shift = clock.offset().total_seconds()
        if self.backend_url == "postgres":
            row = RateBucket.objects.filter(key=self.bucket).values_list("requests_tat", "input_tat", "output_tat")
            with connection.cursor() as cursor:
                cursor.execute("SELECT EXTRACT(EPOCH FROM STATEMENT_TIMESTAMP())::float8")
                now = cursor.fetchone()[0] + shift
            return [float(t) for t in (row.first() or ())], now
        client = redis.Redis.from_url(self.backend_url)
        stored = client.hmget(f"durable_agents:rate:{self.bucket}", "requests", "input", "output")
        seconds, micros = client.time()
        return [float(t) for t in stored if t is not None], seconds + micros / 1e6 + shift

    def teardown(self) -> None:
        clock.reset()
        RateBucket.objects.filter(key=self.bucket).delete()
        if self.backend_url != "postgres":
            redis.Redis.from_url(self.backend_url).delete(f"durable_agents:rate:{self.bucket}")


_BUCKET_REDIS = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
_DEAD_PORT = 1  # nothing listens there: connection refused at once
_FAKE_ANSWER: list[Any] = [Reply.text("ok")]
_FAKE: list[Any] = [None]


@pytest.mark.timeout(1800)
def test_shared_buckets__never_block_past_their_horizon_nor_raise_but_transient_errors(monkeypatch) -> None:
    with claude_on_the_fake(monkeypatch, timeout=5, api_key=API_KEY) as fake:
        fake.responder = lambda request: _FAKE_ANSWER[0]
        _FAKE[0] = fake
        try:
            run_state_machine_as_test(BucketMachine, settings=_profile(ci_examples=150, ci_steps=25))
        finally:
            _FAKE[0] = None


# =====================================================================================================================
# Schedules
# =====================================================================================================================

GOOD_CRONS = ("*/5 * * * *", "0 * * * *", "*/20 * * * *")
MINUTE_STEPS = (1, 4, 5, 17, 61, 180)
MAX_GOOD = 3


@dataclass
class Pause:
    since: datetime
    until: datetime | None = None


@dataclass
class Tracked:
    good: bool
    pauses: list[Pause] = field(default_factory=list)

    @property
    def paused(self) -> bool:
        return bool(self.pauses) and self.pauses[-1].until is None


class ScheduleMachine(RuleBasedStateMachine):
    """Good schedules and a bad one, swept (also by two sweeps at once), paused, resumed, redefined as time moves."""

    def __init__(self) -> None:
        super().__init__()
        self.nonce = uuid.uuid4().hex[:8]
        self.schedules: dict[str, Tracked] = {}

    def _name(self, what: str) -> str:
        return f"R{self.nonce}-{what}"

    @initialize(cron=st.sampled_from(GOOD_CRONS), overlap=st.sampled_from(["skip", "allow"]))
    def define_first(self, cron: str, overlap: str) -> None:
        api.schedule(self._name("bad"), "relations_nan_args", cron="*/5 * * * *", overlap="allow")
        self.schedules[self._name("bad")] = Tracked(good=False)
        self.define_good(cron, overlap)

    @precondition(lambda self: sum(t.good for t in self.schedules.values()) < MAX_GOOD)
    @rule(cron=st.sampled_from(GOOD_CRONS), overlap=st.sampled_from(["skip", "allow"]))
    def define_good(self, cron: str, overlap: str) -> None:
        name = self._name(f"good{len(self.schedules)}")
        api.schedule(name, "record", cron=cron, overlap=overlap)
        self.schedules[name] = Tracked(good=True)

    @rule(data=st.data(), cron=st.sampled_from(GOOD_CRONS))
    def redefine(self, data: st.DataObject, cron: str) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, t in self.schedules.items() if t.good)))
        schedule = Schedule.objects.get(name=name)
        api.schedule(name, "record", cron=cron, overlap=schedule.overlap)

    @rule(minutes=st.sampled_from(MINUTE_STEPS))
    def advance_clock(self, minutes: int) -> None:
        clock.advance(timedelta(minutes=minutes))

    @rule(whole_sweep=st.booleans())
    def sweep_once(self, whole_sweep: bool) -> None:
        now = clock.now()
        sweep() if whole_sweep else start_due_schedules(now)
        self._due_slots_were_started(now)

    @rule(whole_sweep=st.booleans())
    def sweep_twice_at_once(self, whole_sweep: bool) -> None:
        now = clock.now()
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def sweeper() -> None:
            try:
                barrier.wait(timeout=60)
                sweep() if whole_sweep else start_due_schedules(clock.now())
            except BaseException as exc:  # noqa: BLE001 - reported in the test's thread
                errors.append(exc)
            finally:
                _close_thread_connections()

        threads = [threading.Thread(target=sweeper, name="relations-sweeper") for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a sweep hung"
        assert not errors, f"a concurrent sweep raised {errors[0]!r}"
        self._due_slots_were_started(now)

    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.schedules)))
        tracked = self.schedules[name]
        schedule = api.pause_schedule(name)
        if not tracked.paused:
            # The engine's own time of the pause, not a clock read after it: a slot could fall between the two.
            tracked.pauses.append(Pause(since=schedule.paused_changed_at))

    @precondition(lambda self: any(t.paused for t in self.schedules.values()))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(n for n, t in self.schedules.items() if t.paused)))
        schedule = api.resume_schedule(name)
        tracked = self.schedules[name]
        tracked.pauses[-1].until = schedule.paused_changed_at  # the engine's time of the resume, as for the pause
        next_slot = schedule.next_slot
        assert next_slot > tracked.pauses[-1].until, f"{name} resumed owing slot {next_slot} of its pause"

    @rule(which=st.integers(0, 7))
    def finish_a_run(self, which: int) -> None:
        # Which runs are live depends on where the wall clock stood in the hour: drawn by position, so a replay draws
        # the same whatever it finds.
        live = self._live_runs()
        if not live:
            return
        run_id = live[which % len(live)]
        for _ in range(DRIVE_LIMIT):
            if Run.objects.get(pk=run_id).status not in RUNNABLE_RUN_STATUSES or advance(run_id) is Outcome.SKIPPED:
                return

    def _live_runs(self) -> list[str]:
        runs = Run.objects.filter(schedule__startswith=f"R{self.nonce}-", status__in=RUNNABLE_RUN_STATUSES)
        return [str(r) for r in runs.order_by("created_at", "idempotency_key").values_list("id", flat=True)]

    def _due_slots_were_started(self, now: datetime) -> None:
        """9. After a pass at `now`, no unpaused good schedule still owes a slot; the bad one says why it owes it."""
        for schedule in Schedule.objects.filter(name__in=list(self.schedules)).order_by("name"):
            tracked = self.schedules[schedule.name]
            if schedule.paused:
                continue
            if tracked.good:
                assert schedule.next_slot > now, (
                    f"{schedule.name} still owes slot {schedule.next_slot} after a pass at {now} "
                    f"(last_error {schedule.last_error!r})"
                )
            elif schedule.next_slot <= now:
                assert schedule.last_error, (
                    f"{schedule.name} could not start slot {schedule.next_slot} but says nothing"
                )

    @invariant()
    def slots_start_once(self) -> None:
        """8, 10. One run and one 'scheduled' event per slot; no slot of a pause is started."""
        runs = Run.objects.filter(schedule__startswith=f"R{self.nonce}-").values_list(
            "schedule", "idempotency_key", "id"
        )
        by_key: dict[str, int] = {}
        for _, key, _ in runs:
            by_key[key] = by_key.get(key, 0) + 1
        assert all(n == 1 for n in by_key.values()), f"slots started twice: {by_key}"
        events = Event.objects.filter(kind="scheduled", run_id__in=[r for _, _, r in runs]).values_list(
            "detail", flat=True
        )
        seen: dict[tuple[str, str], int] = {}
        for detail in events:
            slot = (detail["schedule"], detail["slot"])
            seen[slot] = seen.get(slot, 0) + 1
            tracked = self.schedules[detail["schedule"]]
            assert tracked.good, f"the bad schedule started a run: {detail}"
            when = datetime.fromisoformat(detail["slot"])
            assert slot_key(detail["schedule"], when) in by_key
            for pause in tracked.pauses:
                inside = when > pause.since and (pause.until is None or when <= pause.until)
                assert not inside, f"{detail['schedule']} started slot {when} of its pause {pause}"
        twice = {slot: n for slot, n in seen.items() if n > 1}
        assert not twice, f"slots recorded as started more than once: {twice}"

    def teardown(self) -> None:
        try:
            alive = [t.name for t in threading.enumerate() if t.name == "relations-sweeper"]
            assert not alive, f"sweeper threads outlived their example: {alive}"
        finally:
            clock.reset()
            ids = list(Run.objects.filter(schedule__startswith=f"R{self.nonce}-").values_list("id", flat=True))
            Schedule.objects.filter(name__startswith=f"R{self.nonce}-").delete()
            _forget(ids)


@pytest.mark.timeout(1800)
def test_schedules__start_each_slot_once_and_one_bad_schedule_stops_no_other() -> None:
    with machine_settings(), fast_commits():
        run_state_machine_as_test(ScheduleMachine, settings=_profile(ci_examples=80, ci_steps=25))
