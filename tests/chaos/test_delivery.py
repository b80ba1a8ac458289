"""One writer per run: the same advance delivered 10× concurrently, and SIGSTOP/SIGCONT zombie workers.

* Ten threads advance one run at the same instant (a barrier), for every step: exactly one claims and
  commits, nine do nothing.
* On real workers, every wake-up of every refund_agent run is sent 10× at once: no step executes twice,
  no turn is asked twice, no effect is applied twice (leases are long here, so nothing expires by accident).
* A worker process holding a run's lease is frozen with SIGSTOP past its lease; another worker takes the
  run over; the zombie is thawed with SIGCONT mid-step: its late commit is rejected, its effects dedupe.

Counts scale with DURABLE_CHAOS_SCALE (default 1: 20 raced steps, 15 duplicated runs, 8 zombies); full count::

    DURABLE_CHAOS_SCALE=25 scripts/test tests/chaos -k "duplicate or zombie" -s
"""

from __future__ import annotations

import random
import signal
import threading
import time
import uuid
from collections import Counter
from datetime import datetime

import pytest
from django.db import connections
from django.db.models import Count
from django.utils import timezone

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance
from durable_agents.models import Event, Run, RunStatus
from durable_agents.tasks import advance as advance_task
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import RecordedRequest, Reply
from tests.chaos.fleet import Fleet, prefork
from tests.chaos.workload import (
    Kill,
    check,
    describe,
    lease_holders,
    make_cases,
    percentiles,
    recoveries,
    scaled,
    seed,
    start,
    timeout,
    wait_until_finished,
)
from tests.testapp.models import Execution, LedgerEntry

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]

DUPLICATES = 10


def test_duplicate_delivery__ten_concurrent_advances_of_each_step_commit_it_once():
    """Rounds of ten threads released at once by a barrier, until the run completes. A thread that arrives
    after the round's winner committed may legitimately claim the *next* step; what must hold is that every
    step is claimed, executed and committed exactly once."""
    steps = scaled(20)
    run = api.start("record", {"steps": steps, "sleep_ms": [5, 20]})
    rounds: list[Counter[str]] = []
    while Run.objects.get(pk=run.id).status != RunStatus.COMPLETED:
        assert len(rounds) < 2 * steps, f"the run did not complete in {len(rounds)} rounds: {rounds}"
        rounds.append(_race(run.id))

    counts = dict(Execution.objects.filter(run_id=run.id).values_list("step_id").annotate(n=Count("id")))
    commits = sum(n for r in rounds for outcome, n in r.items() if outcome != Outcome.SKIPPED)
    print(
        f"\nDuplicate delivery in-process: {steps} steps advanced in {len(rounds)} rounds of {DUPLICATES} "
        f"simultaneous advances ({DUPLICATES * len(rounds)} deliveries); commits {commits}, step executions "
        f"{sum(counts.values())}, rounds with a second commit (of the next step) "
        f"{sum(1 for r in rounds if sum(n for o, n in r.items() if o != Outcome.SKIPPED) > 1)}"
    )
    assert commits == steps, f"{commits} commits for {steps} steps: {rounds}"
    assert counts == {f"s{i:03d}": 1 for i in range(1, steps + 1)}, f"a step executed more than once: {counts}"
    assert not Execution.objects.filter(after_commit=True).exists()


def _race(run_id: uuid.UUID) -> Counter[str]:
    barrier = threading.Barrier(DUPLICATES)
    outcomes: list[str] = []

    def deliver() -> None:
        try:
            barrier.wait()
            outcomes.append(advance(run_id).value)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=deliver) for _ in range(DUPLICATES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return Counter(outcomes)


def test_duplicate_delivery__every_wakeup_sent_ten_times_to_real_workers(chaos_env, chaos_logs, fake):
    """Invariants (workload.check, strict): all runs completed, effects once, every step executed exactly
    once, every journaled turn requested exactly once, and no lease ever taken over."""
    rng = random.Random(7)
    env = {**chaos_env, "DURABLE_LEASE_SECONDS": "15"}  # nothing expires by accident: every duplicate is a duplicate
    cases = make_cases(scaled(15), rng)
    seed(cases)
    sent = 0
    with Fleet(env, chaos_logs, [prefork(3, beat=True), prefork(3)]):
        runs = {start(case): case for case in cases}
        seen: dict[uuid.UUID, tuple] = {}
        deadline = time.monotonic() + 300 * max(1.0, len(runs) / 15)
        while time.monotonic() < deadline:
            states = {
                run_id: (status, cursor, updated)
                for run_id, status, cursor, updated in Run.objects.filter(id__in=list(runs)).values_list(
                    "id", "status", "cursor", "updated_at"
                )
            }
            if all(state[0] == RunStatus.COMPLETED for state in states.values()):
                break
            for run_id, state in states.items():
                if state != seen.get(run_id) and state[0] in (RunStatus.PENDING, RunStatus.RUNNING):
                    for _ in range(DUPLICATES):
                        advance_task.delay(str(run_id))
                    sent += DUPLICATES
            seen = states
            time.sleep(0.05)
        left = wait_until_finished(runs, timeout=60)
        assert not left, f"{len(left)} runs did not finish:\n  {describe(left)}"

    report = check(runs, fake, strict_turns=True)
    takeovers = Event.objects.filter(run_id__in=list(runs), kind="lease_takeover").count()
    print(
        f"\nDuplicate delivery on workers: {len(runs)} refund_agent runs, {sent} extra advance messages "
        f"({DUPLICATES} per wake-up) on 6 pool processes; lease takeovers {takeovers}\n  {report.summary()}"
    )
    report.assert_ok()
    assert report.executions == 3 * len(runs), "every step executed exactly once despite the duplicates"
    assert takeovers == 0, "no lease expired, so no run may have been taken over"


def test_zombies__sigstopped_lease_holders_are_fenced_when_they_wake(chaos_env, chaos_logs, fake):
    """A frozen worker (SIGSTOP) loses its lease; another worker takes the run over; the zombie is thawed
    (SIGCONT) after the takeover. Invariants: workload.check — all completed, effects once, no step committed
    twice, no journaled turn asked again — except the one act no check-then-act can close: a zombie frozen
    between proving its lease and acting may start that step body or send that model request once when it
    thaws (never journaled, its commit rejected, its usage counted), at most once per freeze."""
    rng = random.Random(13)
    zombies_wanted = scaled(8)
    cases = make_cases(scaled(16), rng)
    seed(cases)
    episodes: list[Kill] = []
    with Fleet(chaos_env, chaos_logs, [prefork(2, beat=True), prefork(2)]) as fleet:
        runs = {start(case): case for case in cases}
        deadline = time.monotonic() + 240 * max(1.0, zombies_wanted / 8)
        while len(episodes) < zombies_wanted and time.monotonic() < deadline:
            pids = fleet.pids()
            held = {run_id: pid for run_id, pid in lease_holders(runs).items() if pid in pids}
            if not held:
                if not any(
                    s != RunStatus.COMPLETED
                    for s in Run.objects.filter(id__in=list(runs)).values_list("status", flat=True)
                ):
                    more = make_cases(4, rng)
                    seed(more)
                    runs.update({start(case): case for case in more})
                time.sleep(0.05)
                continue
            _run, pid = rng.choice(sorted(held.items(), key=str))
            at = timezone.now()
            fleet.kill_pid(pid, signal.SIGSTOP)
            try:
                taken = _wait_for_takeover(pid, at, timeout=30)
                if taken is not None:
                    time.sleep(rng.uniform(0.0, 1.5))  # let the successor get ahead of the zombie
            finally:
                fleet.kill_pid(pid, signal.SIGCONT)
            if taken is not None:  # else it had released its lease before it froze: not a zombie
                episodes.append(Kill(at, "sigstop", (pid,), (taken,)))
        left = wait_until_finished(runs, timeout=120 * max(1.0, len(runs) / 16))
        assert not left, f"{len(left)} runs did not finish:\n  {describe(left)}"
        # The last zombie thawed may still be between its model answer and the record of its usage: a SIGKILL now
        # would lose a record the check asks for. A warm shutdown lets it finish.
        fleet.drain()

    report = check(runs, fake)
    events = Counter(
        Event.objects.filter(
            run_id__in=list(runs), kind__in=["zombie_commit_rejected", "unjournaled_usage"]
        ).values_list("kind", flat=True)
    )
    print(
        f"\nZombies: {len(episodes)} lease holders frozen (SIGSTOP) past their lease and thawed after another "
        f"worker took over, across {len(runs)} refund_agent runs; takeover after the freeze: "
        f"{percentiles(recoveries(episodes))}; zombie commits rejected {events['zombie_commit_rejected']}, "
        f"zombie model answers not journaled {events['unjournaled_usage']}; a thawed zombie's one act past the "
        f"fence: step bodies started again {report.zombie_executions}, journaled turns asked again "
        f"{report.zombie_asks}\n  {report.summary()}"
    )
    assert len(episodes) >= zombies_wanted, f"only {len(episodes)} zombies in the time allowed"
    report.assert_ok()


def _wait_for_takeover(pid: int, since: datetime, *, timeout: float) -> uuid.UUID | None:
    """The run another worker took over from the frozen process `pid`; None if it held no lease."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        takeover = Event.objects.filter(
            kind="lease_takeover", created_at__gt=since, detail__previous_owner__endswith=f":{pid}"
        ).first()
        if takeover is not None:
            return takeover.run_id
        if not Run.objects.filter(status=RunStatus.RUNNING, lease_owner__endswith=f":{pid}").exists():
            return None
        time.sleep(0.05)
    return None


def billing_script(request: RecordedRequest) -> Reply:
    """The model's side of tests.testapp's agent_charge conversation, by turn (as in test_agents.py)."""
    if request.turn == 0:
        return Reply.tool_use("lookup_order", {"order_id": "A-1"}, id="toolu_lookup")
    if request.turn == 1:
        return Reply.tool_use("charge", {"order_id": "A-1", "amount": "30.00"}, id="toolu_charge")
    return Reply.text("Order A-1 is charged 30.00.")


def test_zombies__a_thawed_zombie_does_not_ask_the_model_for_a_turn_already_journaled(
    chaos_env, chaos_logs, fake, model
):
    """Frozen inside a tool call (turn 0 journaled), a worker loses the run; the successor journals turns 1
    and 2 and completes it. Thawed, the zombie must not ask the model for turn 1 again."""
    model.fault = None
    fake.responder = billing_script
    env = {**chaos_env, "DURABLE_CHAOS_RECORD": "agent_charge"}
    with Fleet(env, chaos_logs, [prefork(1, beat=True), prefork(1)]) as fleet:
        run = api.start("agent_charge", {"message": "Charge A-1", "pause_at": "in_lookup", "pause_s": 8})
        wait_for(
            lambda: Execution.objects.filter(run_id=run.id, step_id="assistant:in_lookup").exists(),
            timeout=60,
            what="the worker to sleep inside lookup_order",
        )
        zombie = lease_holders([run.id])[run.id]
        fleet.kill_pid(zombie, signal.SIGSTOP)
        try:
            wait_for_run(run.id, "completed", timeout=90)
        finally:
            fleet.kill_pid(zombie, signal.SIGCONT)
        wait_for(
            lambda: (
                Event.objects.filter(run=run, kind__in=["zombie_commit_rejected", "unjournaled_usage"]).exists()
                or fake.count(f"{run.id}:assistant", 1) > 1
            ),
            timeout=30,
            what="the zombie to wake up and hit the fence",
        )
        time.sleep(1)

    conversation = f"{run.id}:assistant"
    asked = [fake.count(conversation, turn) for turn in range(3)]
    assert LedgerEntry.objects.count() == 1, "the charge is applied once"
    assert asked == [1, 1, 1], (
        f"requests per turn {asked}: the thawed zombie asked the model for turn 1, which the worker that took "
        "the run over had already journaled (the agent loop asks without checking that it still holds the lease)"
    )
