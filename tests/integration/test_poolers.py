"""The engine behind PgBouncer in transaction mode: nothing it needs lives in a session beyond its transaction.

Real `celery worker` processes, commands and prune passes connect through a real PgBouncer (tests/integration/
pgbouncer.py) with the settings docs/howto/poolers.md gives (tests/settings.py,
DJANGO_DB_TRANSACTION_POOLER): `DISABLE_SERVER_SIDE_CURSORS` and psycopg's `prepare_threshold` None. This process
sets up and checks directly against Postgres. Each test also checks that its processes did log in through
PgBouncer, not around it.

The rules (https://www.pgbouncer.org/features.html, "SQL feature map for pooling modes"): in transaction pooling,
SET/RESET, LISTEN, WITH HOLD cursors, PREPARE, session temp tables and session-level advisory locks are "Never"
supported; transaction-scoped state (SET LOCAL, pg_advisory_xact_lock, cursors WITHOUT HOLD) and protocol-level
startup parameters (TimeZone, application_name: Django sets the time zone on each new connection) are.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from django.db import connection

from durable_agents import api, clock
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus, Wait, WaitStatus
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.testing.pytest_plugin import database_url
from tests.integration.pgbouncer import PgBouncer
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncer]:
    db = connection.settings_dict
    with PgBouncer(
        host=db["HOST"] or "127.0.0.1", port=int(db["PORT"] or 5432), user=db["USER"], password=db["PASSWORD"]
    ) as running:
        yield running


@pytest.fixture
def pooled_env(worker_env: dict[str, str], bouncer: PgBouncer) -> dict[str, str]:
    """The workers' environment with their database behind PgBouncer, and the settings transaction mode needs."""
    url = database_url({**connection.settings_dict, "HOST": "127.0.0.1", "PORT": bouncer.port})
    return {**worker_env, "DATABASE_URL": url, "DJANGO_DB_TRANSACTION_POOLER": "1"}


@pytest.fixture
def manage_pooled(pooled_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`manage.py ARGS` in a subprocess whose database is behind PgBouncer."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=pooled_env, capture_output=True, text=True, timeout=120
        )

    return run


@pytest.fixture
def through(bouncer: PgBouncer) -> Iterator[None]:
    """The test's processes logged in through PgBouncer (a DATABASE_URL that went around it would prove nothing)."""
    name = connection.settings_dict["NAME"]
    before = bouncer.logins(name)
    yield
    assert bouncer.logins(name) > before, f"nothing logged in to {name} through PgBouncer: the test went around it"


def test_pooler__runs_complete_on_a_worker_and_its_sweep_behind_pgbouncer(start_worker, pooled_env, through):
    """Claims, heartbeats, commits, the sweep (beat), admission under a concurrency key (a transaction-scoped
    advisory lock) and an out-of-row result (the Payload table), all through transaction pooling."""
    start_worker(env=pooled_env, beat=True)
    queued = [api.start("record", {"steps": 4}, concurrency_key="pooled", concurrency_limit=1).id for _ in range(2)]
    big = api.start("big", {"size": 100_000}).id
    for run_id in queued:
        wait_for_run(run_id, "completed")
        steps = list(Execution.objects.filter(run_id=run_id).values_list("step_id", flat=True))
        assert sorted(steps) == ["s001", "s002", "s003", "s004"], "every step ran exactly once"
    assert wait_for_run(big, "completed").output == {"length": 100_000}


def test_pooler__an_approval_decided_behind_pgbouncer_resumes_its_run(start_worker, pooled_env, manage_pooled, through):
    start_worker(env=pooled_env)
    run = api.start("approve_charge", {"order_id": "PB-1"})
    wait_for_run(run.id, "waiting")
    wait = Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN)
    decided = manage_pooled("durable_decide", str(wait.pk), "--approve", "--as", "approver")
    assert decided.returncode == 0, decided.stderr
    wait_for_run(run.id, "completed")
    assert LedgerEntry.objects.filter(order_id="PB-1").count() == 1, "the approved charge applied once"


def test_pooler__the_lease_renewer_keeps_a_slow_step_behind_pgbouncer(start_worker, pooled_env, tmp_path, through):
    """A step longer than its lease (2 s in the tests): the worker's renewer thread pushes the expiry on through the
    pooler, so the sweep (beat) never takes the run over and the step runs once."""
    gate = tmp_path / "go"
    start_worker(env=pooled_env, beat=True)
    run = api.start("slow", {"until": str(gate)})
    wait_for(lambda: Execution.objects.filter(run_id=run.id, step_id="slow").exists(), what="the slow step to start")
    held = Run.objects.get(pk=run.id)
    wait_for(
        lambda: clock.now() > held.lease_expires_at + timedelta(seconds=1),
        timeout=30,
        what="the first lease to be a second past its expiry",
    )
    now = Run.objects.get(pk=run.id)
    assert now.lease_token == held.lease_token and now.lease_expires_at > held.lease_expires_at, (
        "the renewer did not renew the lease through the pooler"
    )
    gate.touch()
    wait_for_run(run.id, "completed")
    assert Execution.objects.filter(run_id=run.id, step_id="slow").count() == 1, "the slow step ran twice"
    assert not Event.objects.filter(run_id=run.id, kind="lease_takeover").exists()


def test_pooler__a_cancel_behind_pgbouncer_stops_a_running_run(
    start_worker, pooled_env, manage_pooled, tmp_path, through
):
    gate = tmp_path / "go"
    start_worker(env=pooled_env)
    run = api.start("slow", {"until": str(gate)})
    wait_for(lambda: Execution.objects.filter(run_id=run.id, step_id="slow").exists(), what="the slow step to start")
    cancelled = manage_pooled("durable_cancel", str(run.id), "--reason", "behind a pooler")
    assert cancelled.returncode == 0, cancelled.stderr
    gate.touch()
    wait_for_run(run.id, "cancelled")
    assert not Execution.objects.filter(run_id=run.id, step_id="after").exists(), "a step ran after the cancel"


def old_runs(n: int) -> list[uuid.UUID]:
    """`n` completed runs last changed a year ago (on the database's clock), each with one step."""
    then = clock.now() - timedelta(days=365)
    runs = Run.objects.bulk_create(
        Run(
            workflow="record",
            workflow_version=1,
            status=RunStatus.COMPLETED,
            input={"n": i},
            input_hash="x",
            step_count=1,
            cursor=1,
            created_at=then,
            updated_at=then,
            finished_at=then,
        )
        for i in range(n)
    )
    Step.objects.bulk_create(
        Step(run=run, step_id="s1", name="work", position=0, status=StepStatus.DONE, result={}) for run in runs
    )
    return [run.id for run in runs]


def advisory_locks() -> int:
    """Advisory locks held in this database (as seen by Postgres, not through the pooler)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return cursor.fetchone()[0]


def test_pooler__prune_passes_hold_nothing_on_a_pooled_connection(
    bouncer, pooled_env, manage_pooled, tmp_path, through
):
    """Pass A rests mid-pass. A pass started meanwhile through the pooler must be refused, naming A. Then another
    client holds the server connection A used (PgBouncer hands out the one released last), so A ends on another one;
    the next pass must run, and no lock may be left on any server connection.

    With a session advisory lock both fail: the pass started while A rests lands on A's server connection and takes
    the lock again beside A (two passes at once); A's unlock then runs on another connection and releases nothing,
    the lock stays on the held one, and the next pass is refused ("another prune is running") however long it waits.
    """
    ids = old_runs(2)
    gate = tmp_path / "go"
    first = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.gated_prune", str(gate)],
        cwd=ROOT,
        env=pooled_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: gate.with_suffix(".resting").exists() or first.poll() is not None, what="pass A to rest")
        assert first.poll() is None, first.communicate()
        busy = manage_pooled("durable_prune", "--older-than", "1d", "--json")
        assert busy.returncode == 0, busy.stderr
        report = json.loads(busy.stdout)
        assert report["busy"] and report["held_by"].endswith(f":{first.pid}"), (
            f"a pass through the pooler while A runs must name A (pid {first.pid}) as the holder: {report}"
        )
        with psycopg.connect(bouncer.url(connection.settings_dict["NAME"])) as other:
            other.execute("SELECT 1")  # a transaction: this client holds a server connection until it ends
            gate.touch()
            out, err = first.communicate(timeout=120)
            assert first.returncode == 0, err
            assert json.loads(out.splitlines()[-1])["deleted"] == 2 and not Run.objects.filter(id__in=ids).exists()
            later = old_runs(1)
            after = manage_pooled("durable_prune", "--older-than", "1d", "--json")
            assert after.returncode == 0, after.stderr
            assert json.loads(after.stdout)["deleted"] == 1, (
                f"a pass after A ended must run, not find A's lock left on a pooled connection: {after.stdout}"
            )
            assert not Run.objects.filter(id__in=later).exists()
            other.rollback()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)
    assert advisory_locks() == 0, "a pass left an advisory lock on a pooled server connection"
