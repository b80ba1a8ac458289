"""Connections that die under a worker: pooled database connections, and the broker connection of a step in flight.

**Pooled connections the server ended while they sat idle** (a restart, a failover, an idle timeout).

psycopg_pool hands idle connections out untested — "The pool doesn't actively check the state of the connections
held in its state ... the application might be served a connection in broken state" (psycopg 3 docs, Connection
pools > Connection quality) — and a worker's pool keeps several. A task that meets a dead one fails (nothing is
retried blindly: a step may have done its work), and its run is woken again by the sweep; but every later task must
not meet the next dead one: one failure per worker, not one per pooled connection. (The journal's write of a
billed answer is retried on a fresh connection: tests of the model worker.)

**The broker connection of a step in flight.** Wake-ups are acknowledged late (tasks.py: acks_late), so when the
connection closes while a step runs, the step finishes but its message cannot be acknowledged ("Couldn't ack",
Celery's CRITICAL log line) and the broker delivers it again. A lost ack must cost nothing but that delivery: the
step is not run twice, the run completes.
"""

from __future__ import annotations

import subprocess
import uuid
from datetime import timedelta

import psycopg
import pytest
import redis
from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.test.utils import override_settings

from durable_agents import api, clock, tasks
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.sweep import sweep
from durable_agents.models import Run
from durable_agents.testing import wait_for, wait_for_run
from tests.celery import deliveries_key
from tests.chaos.services import WAKE_BROKER_ENV, rabbit_vhost, require_rabbitmq
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

POOL = 4


def _admin() -> psycopg.Connection:
    db = connection.settings_dict
    return psycopg.connect(
        dbname=db["NAME"], user=db["USER"] or None, host=db["HOST"] or None, port=db["PORT"] or None, autocommit=True
    )


def _pooled(admin: psycopg.Connection, name: str) -> int:
    return admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s", [name]
    ).fetchone()[0]


def test_worker__connections_ended_while_idle_fail_one_task_not_one_per_connection(start_worker):
    name = f"dead-{uuid.uuid4().hex[:8]}"
    env = {"DJANGO_DB_POOL": str(POOL), "DJANGO_DB_APPLICATION_NAME": name}
    worker = start_worker(pool="gevent", concurrency=POOL * 2, env=env)
    warm = [api.start("noop", {"steps": 3}) for _ in range(POOL * 4)]  # busy enough to open the whole pool
    for run in warm:
        wait_for_run(run.id, "completed", timeout=120)
    with _admin() as admin:
        opened = _pooled(admin, name)
        assert opened >= 2, f"the worker's pool holds {opened} connection(s): nothing to test"
        ended = admin.execute(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid, 10000) AS ok FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s) t WHERE ok",
            [name],
        ).fetchone()[0]
    assert ended == opened, f"{ended} of {opened} pooled connections ended"

    later = []
    for _ in range(opened * 2):  # one at a time: each takes whichever idle connection the pool hands out
        failed_before = _failed(worker)
        run = api.start("noop", {"steps": 1})
        later.append(run)
        wait_for(
            lambda run=run, before=failed_before: _status(run) == "completed" or _failed(worker) > before,
            timeout=60,
            what=f"run {run.id} to complete or its task to fail",
        )

    failed = _failed(worker)
    assert failed <= 1, (
        f"{failed} tasks failed on {opened} dead pooled connections: each one met the next dead connection (the "
        f"pool must test its idle connections after the first failure)\n{worker.log_path.read_text()[-3000:]}"
    )
    clock.advance(timedelta(minutes=5))
    sweep()  # the run whose task failed is woken again
    for run in later:
        wait_for_run(run.id, "completed", timeout=60)


def _failed(worker) -> int:
    return worker.log_path.read_text(errors="replace").count("raised unexpected")


def _status(run: Run) -> str:
    return Run.objects.values_list("status", flat=True).get(pk=run.id)


def test_worker__a_step_whose_broker_connection_closed_commits_once_and_its_redelivery_runs_nothing(
    start_worker, monkeypatch, tmp_path
):
    require_rabbitmq()
    with rabbit_vhost() as url:
        vhost = url.rsplit("/", 1)[1]
        monkeypatch.setenv(WAKE_BROKER_ENV, url)
        waker = {**settings.DURABLE_AGENTS, "WAKER": "tests.chaos.services.wake"}  # this process publishes there
        with override_settings(DURABLE_AGENTS=waker):
            counter = redis.Redis.from_url(settings.CELERY_BROKER_URL)
            counting = {"DURABLE_TEST_COUNT_DELIVERIES": "1", "DURABLE_TEST_COUNT_REDIS": settings.CELERY_BROKER_URL}
            worker = start_worker(pool="prefork", concurrency=1, env={"CELERY_BROKER_URL": url, **counting})
            release = tmp_path / "release"
            run = api.start("slow", {"until": str(release)})
            wait_for(lambda: Execution.objects.filter(run_id=run.id).exists(), timeout=60, what="the slow step")
            subprocess.run(
                ["rabbitmqctl", "-q", "close_all_connections", "-p", vhost, "the test closes it"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            release.touch()
            wait_for_run(run.id, "completed", timeout=90)
            # The broker requeued what the closed channel had not acknowledged; the reconnected worker takes it.
            wait_for(lambda: int(counter.get(deliveries_key(run.id)) or 0) >= 2, timeout=90, what="the redelivery")
            wait_for(lambda: "Couldn't ack" in worker.log_path.read_text(errors="replace"), timeout=30)

    steps = sorted(Execution.objects.filter(run_id=run.id).values_list("step_id", flat=True))
    assert steps == ["after", "slow"], f"steps executed: {steps} (a redelivered wake-up ran a committed step again)"


@pytest.mark.django_db(transaction=True)
def test_a_statement_timeout_is_no_dead_connection_and_an_open_transaction_is_kept():
    # A task called inside the caller's transaction (or a statement timeout, a deadlock: OperationalErrors of a
    # connection that works) must not drop the connection: the caller's transaction would be lost with it.
    def slow() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL statement_timeout = 50")
            cursor.execute("SELECT pg_sleep(1)")

    with transaction.atomic():
        run = api.start("noop", {"steps": 1})
        with pytest.raises(OperationalError), transaction.atomic():
            tasks._dropping_dead_connections(slow)
        assert Run.objects.filter(pk=run.id).exists(), "the caller's transaction goes on"
    assert Run.objects.filter(pk=run.id).exists()

    with pytest.raises(OperationalError):
        tasks._dropping_dead_connections(lambda: transaction.atomic()(slow)())
    assert connection.connection is not None, "a connection that only timed out a statement is kept"


def test_the_engine_s_statements_test_a_persistent_connection_as_django_does_with_conn_health_checks():
    """With CONN_HEALTH_CHECKS, Django tests a persistent connection before the first query of a request or a task
    (Celery's Django fixup closes old connections as each task starts) and replaces it if the server ended it. The
    engine's own statements (engine/statements.py) must too: the first step after a database restart would fail."""
    run = api.start("noop", {"steps": 1})
    connection.close()
    saved = {key: connection.settings_dict[key] for key in ("CONN_HEALTH_CHECKS", "CONN_MAX_AGE")}
    connection.settings_dict.update(CONN_HEALTH_CHECKS=True, CONN_MAX_AGE=None)
    try:
        connection.ensure_connection()
        with _admin() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid])
        connection.close_if_unusable_or_obsolete()  # what a task's start does: the connection is kept, to be tested
        assert connection.connection is not None
        assert advance(run.id) is Outcome.COMPLETED, "the claim ran on a connection the server had ended"
    finally:
        connection.close()
        connection.settings_dict.update(saved)
