"""The SIGKILL loop: refund_agent runs (Claude played by the fake Messages API) on real workers, SIGKILLed at
random moments — the pool child holding a run's lease (an OOM kill mid-step), or a whole worker with its broker
connection — on Redis and on RabbitMQ (quorum queue, publisher confirms).

Counts scale with DURABLE_CHAOS_SCALE (default 1: 40 runs and 60 kills per broker, under a minute each on two
cores). The issue's full count, ≥ 1,000 kills across ≥ 200 runs, is::

    DURABLE_CHAOS_SCALE=25 scripts/test tests/chaos -k sigkill -s

(1,500 kills across 1,000 runs per broker, roughly 20 minutes each). `-s` shows the figures: kills, runs,
recovery p50/p95 (kill → another worker took the run over). A kill lands every 0.2-1.0s on the process holding
a random in-flight run's lease; every fourth takes that process's whole worker, which is restarted.

Invariants (tests/chaos/workload.py `check`): every run completed; every effect applied once (one refund
per refundable order, one email per run, each under an applied effect's key); no step body started after its
checkpoint committed and no step committed twice (side table written by instrumented steps); no journaled
model turn requested again after it was journaled, and every extra request for an unjournaled turn explained
by an interruption of its run (a lost worker's lease taken over, or a retry).
"""

from __future__ import annotations

import random
import time

import pytest
from django.conf import settings
from django.utils import timezone

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
    unfinished,
    wait_until_finished,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]

RUNS = scaled(40)
KILLS = scaled(60)
IN_FLIGHT = 8
# Every n-th kill takes a whole worker (parent, pool children, broker connection), the others one pool child.
WHOLE_WORKER_EVERY = 4
# Worker 0 runs beat (the sweep) and only ever loses pool children; worker 1 is also killed whole.
KILLABLE = 1


def test_sigkill_loop__every_run_completes_with_no_effect_step_or_turn_repeated(broker, chaos_env, chaos_logs, fake):
    rng = random.Random(20261129)
    env = {**chaos_env, "CELERY_BROKER_URL": broker}
    runs, kills = {}, []
    began = time.monotonic()
    with Fleet(env, chaos_logs, [prefork(2, beat=True), prefork(2)]) as fleet:
        next_kill = time.monotonic() + 2.0
        pending_cases = []
        while len(runs) < RUNS or len(kills) < KILLS:
            assert time.monotonic() - began < 900 * max(1.0, len(runs) / 40), (
                f"the loop made too little progress: {len(runs)} runs, {len(kills)} kills; "
                f"unfinished: {describe(unfinished(runs))}"
            )
            active = unfinished(runs)
            while len(active) < IN_FLIGHT:
                if not pending_cases:
                    pending_cases = make_cases(IN_FLIGHT * 2, rng)
                    seed(pending_cases)
                case = pending_cases.pop()
                run_id = start(case)
                runs[run_id] = case
                active.append(run_id)
            if time.monotonic() < next_kill or len(kills) >= KILLS:
                time.sleep(0.05)
                continue
            kill = _kill_one(fleet, active, rng, whole=len(kills) % WHOLE_WORKER_EVERY == WHOLE_WORKER_EVERY - 1)
            if kill is not None:
                kills.append(kill)
                next_kill = time.monotonic() + rng.uniform(0.2, 1.0)
            else:
                next_kill = time.monotonic() + 0.1  # nothing leased right now: look again soon

        left = wait_until_finished(runs, timeout=240 * max(1.0, len(runs) / 200))
        assert not left, f"{len(left)} runs did not finish after the kills stopped:\n  {describe(left)}"
    elapsed = time.monotonic() - began

    report = check(runs, fake)
    whole = sum(1 for k in kills if k.kind == "worker")
    name = "rabbitmq (quorum queue)" if broker.startswith("amqp") else "redis"
    print(
        f"\nSIGKILL loop on {name}: {len(kills)} kills ({whole} whole workers, {len(kills) - whole} "
        f"pool children holding a lease) across {len(runs)} refund_agent runs in {elapsed:.0f}s; recovery "
        f"kill → another worker took the victim's run over: {percentiles(recoveries(kills))} "
        f"(lease {settings.DURABLE_AGENTS['LEASE_SECONDS']}s, sweep every 0.5s)\n  {report.summary()}"
    )
    assert len(kills) >= KILLS and len(runs) >= RUNS
    report.assert_ok()


def _kill_one(fleet: Fleet, active: list, rng: random.Random, *, whole: bool) -> Kill | None:
    """SIGKILL the process holding a random run's lease (or its whole worker); None if no run is leased."""
    pids = fleet.pids()
    held = {run_id: pid for run_id, pid in lease_holders(active).items() if pid in pids}
    if not held:
        return None
    _run, pid = rng.choice(sorted(held.items(), key=str))
    if whole and any(pids[p] == KILLABLE for p in held.values()):
        victims = tuple(r for r, p in held.items() if pids[p] == KILLABLE)
        at = timezone.now()
        killed = fleet.kill_worker(KILLABLE)
        return Kill(at, "worker", tuple(killed), victims)
    at = timezone.now()
    if not fleet.kill_pid(pid):
        return None
    return Kill(at, "child", (pid,), tuple(r for r, p in held.items() if p == pid))
