"""Infrastructure outages under load: the broker wiped and restarted, Postgres restarted, the broker down at start.

Each test starts and breaks services of its own (tests/chaos/services.py): a `redis-server` and a Postgres
cluster on free ports, never the machine's. Runs are refund_agent runs played by the fake Messages API, and
every test ends with the invariants of tests/chaos/workload.py `check`: 0 runs lost (all completed), effects
once, no step committed twice, no journaled turn asked again.

Counts scale with DURABLE_CHAOS_SCALE (default 1: 30 runs per outage); full count::

    DURABLE_CHAOS_SCALE=25 scripts/test tests/chaos -k outage -s
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import dj_database_url
import pytest
import redis
from django.db import InterfaceError, OperationalError, connections

from durable_agents.models import Run, Turn
from durable_agents.tasks import advance as advance_task
from durable_agents.testing import wait_for
from tests.chaos.conftest import publishing_wakeups
from tests.chaos.fleet import API_KEY, DJANGO_SECRET_KEY, ROOT, Fleet, prefork
from tests.chaos.services import WAKE_BROKER_ENV, PostgresCluster, RedisServer, postgres_bin, refused_port
from tests.chaos.workload import (
    Case,
    check,
    describe,
    make_cases,
    scaled,
    seed,
    start,
    timeout,
    wait_until_finished,
)

pytestmark = [pytest.mark.slow, timeout()]

RUNS = scaled(30)
# Per run: load_order, 4-5 agent turns, 1 verdict; the outages hit at these fractions of the journaled turns.
TURNS_PER_RUN = 5


def journaled(runs: Iterator[uuid.UUID] | dict, *, using: str = "default") -> int:
    return Turn.objects.using(using).filter(run_id__in=list(runs)).count()


def wait_for_progress(runs: dict, fraction: float, *, using: str = "default", timeout: float = 180) -> int:
    goal = int(len(runs) * TURNS_PER_RUN * fraction)
    deadline = time.monotonic() + timeout
    while (done := _retrying(lambda: journaled(runs, using=using), using)) < goal:
        assert time.monotonic() < deadline, f"only {done} of {goal} turns journaled after {timeout:.0f}s"
        time.sleep(0.2)
    return done


def _retrying(query: Callable[[], int], using: str) -> int:
    """Run a query, riding out a database that is restarting (the connection is dropped and reopened)."""
    for _ in range(120):
        try:
            return query()
        except (OperationalError, InterfaceError):
            connections[using].close()
            time.sleep(0.5)
    return query()


@pytest.mark.django_db(transaction=True)
def test_outage__redis_wiped_mid_load_then_killed_and_restarted_loses_no_run(chaos_env, chaos_logs, fake, monkeypatch):
    rng = random.Random(10)
    with RedisServer(chaos_logs / "redis.log") as redis_server:
        monkeypatch.setenv(WAKE_BROKER_ENV, redis_server.url)
        env = {**chaos_env, "CELERY_BROKER_URL": redis_server.url}
        with publishing_wakeups(), Fleet(env, chaos_logs, [prefork(2, beat=True), prefork(2)]):
            cases = make_cases(RUNS, rng)
            seed(cases)
            began = time.monotonic()
            runs = {start(case): case for case in cases}

            at_wipe = wait_for_progress(runs, 0.2)
            redis_server.flushall()  # every queued and unacknowledged wake-up is gone, and kombu's bindings
            wiped = time.monotonic()
            at_crash = wait_for_progress(runs, 0.5)
            redis_server.stop()  # SIGKILL: the broker is gone; workers lose their connections
            crashed = time.monotonic()
            time.sleep(3)
            redis_server.start()  # empty: no persistence
            restarted = time.monotonic()

            left = wait_until_finished(runs, timeout=180 * max(1.0, RUNS / 30))
            assert not left, f"{len(left)} runs never finished after the broker came back:\n  {describe(left)}"
            done = time.monotonic()

    report = check(runs, fake)
    print(
        f"\nRedis outage: {len(runs)} refund_agent runs; FLUSHALL at {wiped - began:.1f}s ({at_wipe} turns "
        f"journaled), SIGKILL of redis-server at {crashed - began:.1f}s ({at_crash} turns), restarted empty 3s "
        f"later; all runs completed {done - restarted:.1f}s after the restart\n  {report.summary()}"
    )
    report.assert_ok()


# --- Postgres restarted under load -------------------------------------------------------------------------------

PG_ALIAS = "chaos_pg"


@pytest.fixture
def cluster(chaos_logs) -> Iterator[PostgresCluster]:
    bin_dir = postgres_bin()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    with PostgresCluster(bin_dir) as server:
        try:
            yield server
        finally:
            if server.log.exists():
                shutil.copy(server.log, chaos_logs / "postgres.log")


@contextlib.contextmanager
def database_alias(url: str, django_db_blocker) -> Iterator[str]:
    """Make the cluster's database reachable from this process as connections[PG_ALIAS]."""
    config = dj_database_url.parse(url, conn_max_age=0, conn_health_checks=True)
    connections.settings[PG_ALIAS] = connections.configure_settings({"default": config})["default"]
    try:
        with django_db_blocker.unblock():
            yield PG_ALIAS
            connections[PG_ALIAS].close()
    finally:
        with contextlib.suppress(AttributeError):
            del connections[PG_ALIAS]
        del connections.settings[PG_ALIAS]


def start_remotely(env: dict[str, str], cases: list[Case]) -> dict[uuid.UUID, Case]:
    """Start the runs through the public API in a subprocess connected to the cluster's database."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.chaos.remote"],
        input=json.dumps([case.run_input for case in cases]),
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"starting runs failed: {done.stderr[-2000:]}"
    return {uuid.UUID(run_id): case for run_id, case in zip(json.loads(done.stdout), cases, strict=True)}


def test_outage__postgres_restarted_mid_load_and_idle_loses_no_run(
    cluster, broker_url, chaos_logs, fake, django_db_blocker
):
    """Three restarts: mid-load with 3s down, while every worker is idle, and mid-load again. Then no worker may
    keep failing on a dead connection, and every run completes."""
    rng = random.Random(11)
    url = cluster.create_database("chaos")
    env = {
        **fake.environ(api_key=API_KEY),
        "DJANGO_SECRET_KEY": DJANGO_SECRET_KEY,
        "DJANGO_SETTINGS_MODULE": "tests.chaos.settings",
        "DATABASE_URL": url,
        "CELERY_BROKER_URL": broker_url,
        "PYTHONUNBUFFERED": "1",
        "DURABLE_CHAOS_RECORD": "refund_agent",
    }
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], env=env, cwd=ROOT, check=True, timeout=300)
    with database_alias(url, django_db_blocker) as using:
        cases = make_cases(RUNS, rng)
        seed(cases, using=using)
        with Fleet(env, chaos_logs, [prefork(2, beat=True), prefork(2)]) as fleet:
            began = time.monotonic()
            first_wave = start_remotely(env, cases[: RUNS // 2])
            wait_for_progress(first_wave, 0.25, using=using)
            cluster.restart(down_seconds=3)  # fast shutdown cuts every connection; 3s of refused connections
            left = wait_until_finished(first_wave, timeout=60 * scale_factor(), using=using)
            assert not left, f"{len(left)} runs never finished after a restart:\n  {describe(left, using=using)}"

            cluster.restart()  # every worker is idle, holding a connection that is now dead
            wake_all(first_wave)  # so that each worker's next task is an advance (a claim), not the sweep
            second_wave = start_remotely(env, cases[RUNS // 2 :])
            wait_for_progress(second_wave, 0.3, using=using, timeout=60 * scale_factor())
            cluster.restart(down_seconds=1)
            last = time.monotonic()
            time.sleep(5)  # a worker may fail a task or two right after a restart, not forever
            offsets = {path: path.stat().st_size for path in fleet.log_files()}

            runs = {**first_wave, **second_wave}
            wake_all(runs)  # every worker process gets tasks while the logs are watched
            left = wait_until_finished(runs, timeout=60 * scale_factor(), using=using)
            assert not left, f"{len(left)} runs never finished after the restarts:\n  {describe(left, using=using)}"
            done = time.monotonic()
            wait_for(lambda: not redis.Redis.from_url(broker_url).llen("celery"), timeout=60, what="the queue to drain")
            time.sleep(1)
            broken = dead_connection_errors(offsets)
        report = check(runs, fake, using=using)
    print(
        f"\nPostgres restarts: {len(runs)} refund_agent runs in two waves; restarted 3 times (mid-load with 3s "
        f"down, idle, mid-load); all runs completed {done - last:.1f}s after the last restart, "
        f"{done - began:.0f}s in all\n  {report.summary()}"
    )
    assert not broken, f"workers still failing on a dead database connection 5s after the restart: {broken[:5]}"
    report.assert_ok()


def wake_all(runs: dict, copies: int = 4) -> None:
    """Send `copies` advance messages for each run (a duplicate of a finished run's advance does nothing)."""
    for run_id in runs:
        for _ in range(copies):
            advance_task.delay(str(run_id))


def scale_factor() -> float:
    return max(1.0, RUNS / 30)


DEAD_CONNECTION = ("connection is closed", "connection is lost", "terminating connection", "server closed")


def dead_connection_errors(offsets: dict) -> list[str]:
    """Task failures on a dead database connection logged after the given offsets of the worker logs."""
    lines = []
    for path, offset in offsets.items():
        with open(path, "rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        lines += [
            line
            for line in text.splitlines()
            if "raised unexpected" in line and any(d in line for d in DEAD_CONNECTION)
        ]
    return lines


# --- The broker down when a run starts ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_outage__start_while_the_broker_is_down_returns_the_run(worker_env):
    with refused_port() as down:
        started = subprocess.run(
            [sys.executable, "manage.py", "durable_start", "noop", "--input", '{"steps": 1}', "--key", "broker-down"],
            env={**worker_env, "CELERY_BROKER_URL": f"redis://127.0.0.1:{down}/0"},
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    created = [str(run_id) for run_id in Run.objects.values_list("id", flat=True)]
    assert len(created) == 1, "the run is committed before its wake-up is sent"
    assert started.returncode == 0 and started.stdout.strip() == created[0], (
        f"durable_start exited {started.returncode} although run {created[0]} was created (the sweep runs it "
        f"once the broker is back); stderr: {started.stderr.strip()[-300:]}"
    )
