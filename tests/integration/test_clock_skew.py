"""Workers whose clocks disagree: leases are compared on the database's clock, never a worker's (issue 13, item 9).

A real `celery worker` runs under libfaketime 20 s ahead of the machine, beside an honest one. Every wake-up
it receives while the honest worker holds a live, heartbeating lease must be a no-op; the honest worker's step
lasts until the skewed worker has handled one, so the test cannot pass without it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from durable_agents import api
from durable_agents.models import Event, RunStatus
from durable_agents.tasks import wake
from durable_agents.testing import wait_for, wait_for_run
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)
LIBFAKETIME = next(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"), Path("/usr/lib/faketime/libfaketime.so.1"))
AHEAD = {
    "LD_PRELOAD": str(LIBFAKETIME),
    "FAKETIME": "+20s",
    # Durations (heartbeat intervals, Celery's timers) stay honest: only the wall clock is wrong.
    "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    "FAKETIME_NO_CACHE": "1",
}
# Long enough that a loaded machine's heartbeat never misses it, far shorter than the skew.
LEASE = {"DURABLE_LEASE_SECONDS": "8"}


def _clock_of(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env=env, capture_output=True)
    return float(out.stdout)


def test_lease__a_worker_20s_ahead_never_takes_over_a_live_lease(start_worker, worker_env, tmp_path):
    assert LIBFAKETIME.exists(), "libfaketime is missing: scripts/test installs Debian's faketime package"
    skewed_env = {**worker_env, **AHEAD}
    skew = _clock_of(skewed_env) - time.time()
    assert 15 < skew < 30, f"the skewed worker's clock is {skew:.1f}s off, expected about +20s"

    start_worker(env=LEASE)
    gate = tmp_path / "go-on"  # the honest worker's step runs until the skewed worker has handled a wake-up
    run = api.start("slow", {"until": str(gate)})
    wait_for(lambda: Execution.objects.filter(run_id=run.id, step_id="slow").exists(), what="the honest worker")
    skewed = start_worker(env={**AHEAD, **LEASE}, extra_args=["--loglevel", "INFO"])

    def woken_and_handled() -> int:
        wake(str(run.id))  # a duplicate delivery: the honest worker is busy, so the skewed one takes it
        log = skewed.log_path.read_text().splitlines()
        return sum(1 for line in log if "durable_agents.advance[" in line and " succeeded in " in line)

    wait_for(woken_and_handled, timeout=90, interval=0.2, what="the skewed worker to handle a wake-up")
    gate.touch()
    wait_for_run(run.id, RunStatus.COMPLETED, timeout=60)

    assert Execution.objects.filter(run_id=run.id, step_id="slow").count() == 1, (
        "the slow step ran twice: a worker whose clock is ahead took over a live lease"
    )
    assert not Event.objects.filter(run=run, kind="lease_takeover").exists()
