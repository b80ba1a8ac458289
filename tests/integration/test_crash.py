"""Crash tests: SIGKILL and SIGSTOP real worker processes; count every execution of every step."""

from __future__ import annotations

import os
import random
import signal
import statistics
import time

import pytest
from django.conf import settings
from django.db.models import Count
from django.utils import timezone

from durable_agents import api
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus
from durable_agents.testing import wait_for, wait_for_run
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

KILLS = int(os.environ.get("DURABLE_CHAOS_KILLS", "10"))


def _committed_after(moment) -> bool:
    return Step.objects.filter(finished_at__gt=moment, status=StepStatus.DONE).exists()


@pytest.mark.slow
def test_sigkill__fifty_step_run_survives_repeated_kills(start_worker):
    rng = random.Random(20261129)
    workers = [start_worker(beat=True), start_worker()]
    run = api.start("record", {"steps": 50, "sleep_ms": [50, 120]})
    wait_for(lambda: Execution.objects.filter(run_id=run.id).exists(), timeout=30, what="the first step")

    kills, recoveries = 0, []
    while kills < KILLS:
        time.sleep(rng.uniform(0.02, 0.4))
        current = Run.objects.get(pk=run.id)
        if current.status != RunStatus.RUNNING:
            break
        holders = [w for w in workers if current.lease_owner and w.owns(current.lease_owner)]
        victim = holders[0] if holders else rng.choice(workers)
        killed_at = timezone.now()
        victim.kill()
        kills += 1
        workers[workers.index(victim)] = start_worker(beat=victim.args.count("--beat") > 0)
        if Run.objects.get(pk=run.id).status == RunStatus.RUNNING:
            wait_for(lambda at=killed_at: _committed_after(at), timeout=60, what="a commit after the kill")
            recoveries.append(
                (
                    Step.objects.filter(finished_at__gt=killed_at).order_by("finished_at").first().finished_at
                    - killed_at
                ).total_seconds()
            )

    run = wait_for_run(run.id, "completed", timeout=120)
    print(
        f"\nSIGKILL loop: {kills} kills; recovery kill→next commit: "
        f"median {statistics.median(recoveries):.2f}s, max {max(recoveries):.2f}s "
        f"(lease {settings.DURABLE_AGENTS['LEASE_SECONDS']}s, sweep every 0.5s)"
    )
    assert kills >= KILLS, f"the run finished after {kills} kills; lengthen its steps so the test kills {KILLS} times"
    counts = dict(Execution.objects.filter(run_id=run.id).values_list("step_id").annotate(n=Count("id")))
    assert len(counts) == 50, "every step executed"
    assert not Execution.objects.filter(run_id=run.id, after_commit=True).exists(), (
        "a step whose checkpoint had committed executed again: the claim or the fencing is broken"
    )
    assert sum(counts.values()) - 50 <= kills, f"more re-executions than kills: {counts}"
    assert Step.objects.filter(run=run, status=StepStatus.DONE).count() == 50


def test_zombie__late_commit_of_a_paused_worker_is_rejected(start_worker, tmp_path):
    zombie = start_worker()
    gate = tmp_path / "go-on"  # the step runs until the worker executing it is paused
    run = api.start("slow", {"until": str(gate)})
    wait_for(lambda: Execution.objects.filter(run_id=run.id).exists(), timeout=30, what="the slow step to start")
    zombie.signal(signal.SIGSTOP)
    gate.touch()  # the successor's execution returns at once; the zombie's, once it thaws
    try:
        start_worker(beat=True)  # the successor; its beat runs the sweep that re-wakes the run
        wait_for(
            lambda: Step.objects.filter(run=run, step_id="slow", status=StepStatus.DONE).exists(),
            timeout=60,
            what="the successor to commit the step",
        )
    finally:
        zombie.signal(signal.SIGCONT)

    rejected = wait_for(
        lambda: Event.objects.filter(run=run, kind="zombie_commit_rejected").first(),
        timeout=30,
        what="the zombie's commit to be rejected",
    )
    run = wait_for_run(run.id, "completed", timeout=60)
    assert zombie.owns(rejected.detail["owner"]), "the rejected commit came from the paused worker"
    takeover = Event.objects.get(run=run, kind="lease_takeover")
    assert zombie.owns(takeover.detail["previous_owner"]), "the successor took the lease over from the zombie"
    assert rejected.detail["current_token"] > rejected.detail["token"]
    step = Step.objects.get(run=run, step_id="slow")
    assert step.status == StepStatus.DONE and Execution.objects.filter(run_id=run.id, step_id="slow").count() == 2
