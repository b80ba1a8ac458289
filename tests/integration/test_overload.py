"""Overload: when workers fall behind, the sweep must not multiply the messages they are behind on.

No worker runs in these tests: a started run's wake-up stays on the (real Redis) broker's queue, as it does behind a
saturated queue. Engine time is moved with `clock.advance` (set back after each test by the plugin).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import override_settings

from durable_agents import api, broker, clock, tasks
from durable_agents.clock import DbNow
from durable_agents.engine.advance import advance
from durable_agents.engine.heartbeats import record_beat
from durable_agents.engine.sweep import sweep
from durable_agents.health import system_health
from durable_agents.models import Event, ProcessHeartbeat, Run
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.testing.runs import take_lease
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)

IDLE = 10.0
SWEEPS = {"IDLE_RESWEEP_SECONDS": IDLE, "RESWEEP_BACKOFF_MAX_SECONDS": 300.0, "SWEEP_BATCH": 100}


def _swept(run: Run) -> int:
    return Event.objects.filter(run=run, kind="swept").count()


def _stall(minutes: int, every: float = 10.0) -> None:
    """Sweep every `every` seconds of engine time for `minutes`, as beat would while no worker takes the run."""
    for _ in range(int(minutes * 60 / every)):
        clock.advance(timedelta(seconds=every))
        sweep()


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_sweep__a_run_no_worker_takes_is_re_woken_ever_more_rarely():
    run = api.start("noop", {"steps": 1})
    _stall(minutes=10)
    # One wake-up per IDLE_RESWEEP_SECONDS would be 60 over ten minutes; backing off (10, 20, 40, 80, 160, 320 s
    # of stall) it is six — every one of them a message a saturated worker would have had to turn away.
    assert _swept(run) <= 7, f"{_swept(run)} re-wakes in ten minutes"
    assert _swept(run) >= 5, "a run nobody takes must still be re-woken (its message may be lost)"


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_sweep__a_run_that_progressed_is_re_woken_after_idle_again():
    run = api.start("noop", {"steps": 1})
    _stall(minutes=5)
    before = _swept(run)
    Run.objects.filter(pk=run.id).update(updated_at=DbNow())  # a worker took a step: progress
    clock.advance(timedelta(seconds=IDLE + 1))
    sweep()
    assert _swept(run) == before + 1, "after progress a lost message is found within IDLE_RESWEEP_SECONDS again"


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_sweep__backoff_is_capped_so_a_lost_message_is_found_within_the_cap():
    run = api.start("noop", {"steps": 1})
    _stall(minutes=30, every=30.0)
    swept = list(Event.objects.filter(run=run, kind="swept").order_by("id").values_list("created_at", flat=True))
    gaps = [(later - earlier).total_seconds() for earlier, later in zip(swept, swept[1:], strict=False)]
    assert gaps and max(gaps) <= 300 + 30, f"gaps between re-wakes: {gaps}"


@override_settings(DURABLE_AGENTS={**SWEEPS, "WAKE_BATCH_SIZE": 1})  # a message per wake-up
def test_sweep__while_the_broker_holds_a_backlog_it_re_wakes_only_runs_whose_holder_died():
    waiting = [api.start("noop", {"steps": 1}) for _ in range(3)]
    dead = api.start("noop", {"steps": 1})
    take_lease(dead.id)  # its worker died holding it: no message of its is queued any more
    clock.advance(timedelta(minutes=2))  # past IDLE_RESWEEP_SECONDS, within RESWEEP_BACKOFF_MAX_SECONDS

    report = sweep(backlog={None: 3})

    assert report.woken == 1 and _swept(dead) == 1
    assert [_swept(run) for run in waiting] == [0, 0, 0], "three queued messages: each may be a wake-up of theirs"
    assert sweep(backlog={None: 1}).woken == 2, "one queued message: two of them have none, the oldest two are re-woken"
    assert [_swept(run) for run in waiting] == [1, 1, 0]


@override_settings(DURABLE_AGENTS={**SWEEPS, "MODEL_QUEUE": "durable-model"})
def test_sweep__a_deep_model_queue_never_holds_back_the_lost_runs_of_the_default_queue():
    model_bound = api.start("agent_charge", {"message": "charge order 7"})  # its next step waits on the model
    plain = api.start("noop", {"steps": 1})
    clock.advance(timedelta(minutes=2))  # past IDLE_RESWEEP_SECONDS, within RESWEEP_BACKOFF_MAX_SECONDS

    sweep(backlog={"durable-model": 5_000, None: 0})

    assert (_swept(model_bound), _swept(plain)) == (0, 1), "each queue's depth stands for its own runs' wake-ups"
    clock.advance(timedelta(minutes=1))
    sweep(backlog={"durable-model": 0, None: 5_000})
    assert (_swept(model_bound), _swept(plain)) == (1, 1)


@override_settings(DURABLE_AGENTS={**SWEEPS, "MODEL_QUEUE": "durable-model"})
def test_sweep__a_lost_run_with_an_empty_plan_is_re_woken_within_idle_with_a_model_queue(broker_url):
    plain = api.start("noop", {"steps": 1})
    empty = api.start("noop", {"steps": 0})  # a plan built from its input can be empty: no step under its cursor
    redis.Redis.from_url(broker_url).flushdb()  # both wake-ups lost (a Redis restarted without persistence)
    clock.advance(timedelta(seconds=IDLE + 1))

    sweep(backlog={None: 0, "durable-model": 0})

    assert (_swept(plain), _swept(empty)) == (1, 1), "a run with no next step belongs to the default queue"


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_sweep_task__adds_nothing_to_a_queue_of_batched_wake_ups(broker_url):
    with transaction.atomic():
        for _ in range(100):
            api.start("noop", {"steps": 1})  # one transaction: woken WAKE_BATCH_SIZE (25) to a message
    depth = broker.backlog()[None]
    clock.advance(timedelta(seconds=IDLE + 1))

    assert tasks.sweep()["woken"] == 0, f"{depth} messages carry all 100 runs' wake-ups"


def test_backlog__is_read_from_the_queue_the_products_routes_send_wake_ups_to(broker_url):
    amqp = current_app.amqp
    before = current_app.conf.task_routes
    current_app.conf.task_routes = {"durable_agents.advance": {"queue": "durable-runs"}}
    amqp.flush_routes()
    amqp.router = amqp.Router()
    try:
        for _ in range(3):
            api.start("noop", {"steps": 1})
        assert redis.Redis.from_url(broker_url).llen("durable-runs") == 3, "the wake-ups went to the routed queue"
        assert broker.backlog()[None] == 3 and broker.run_queues() == ["durable-runs"]
    finally:
        current_app.conf.task_routes = before
        amqp.flush_routes()
        amqp.router = amqp.Router()


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_admission__a_run_just_admitted_is_neither_behind_nor_re_woken(broker_url):
    holder = api.start("noop", {"steps": 1}, concurrency_key="customer-1")
    queued = api.start("noop", {"steps": 1}, concurrency_key="customer-1")
    clock.advance(timedelta(minutes=10))  # `queued` waited for its key (a wait health rightly ignores), not a worker
    advance(holder.id)  # the holder completes: `queued` is admitted and its wake-up sent
    tasks.sweep()
    record_beat("worker:b@h:9", ProcessHeartbeat.Kind.WORKER, hostname="b@h", pid=9, queues=["celery"])

    assert _swept(queued) == 0, "its wake-up was sent a moment ago; the sweep sent it a second one"
    assert system_health().ok, system_health().verdict


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_status__a_default_queue_so_deep_that_the_sweep_waits_in_it_says_workers_are_behind(broker_url):
    tasks.sweep()  # the last pass that got through
    for _ in range(200):
        api.start("noop", {"steps": 1})  # the default queue is deep
    tasks.sweep.apply_async(expires=30)  # beat's next pass waits behind them, on the same queue...
    clock.advance(timedelta(minutes=3))  # ...for three minutes
    record_beat("worker:b@h:9", ProcessHeartbeat.Kind.WORKER, hostname="b@h", pid=9, queues=["celery"])

    verdict = system_health().verdict
    assert verdict.startswith("workers are behind: a runnable run has waited 3 min for a worker (201 messages"), verdict
    assert verdict.endswith("the sweep is late too (its task waits in the queue)"), verdict


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_sweep__under_a_backlog_that_never_drains_a_waiting_run_is_still_re_woken_within_the_cap():
    api.start("noop", {"steps": 1})  # its message was lost, say, behind a queue that stays deep
    woken_at = []
    for second in range(30, 20 * 60 + 1, 30):
        clock.advance(timedelta(seconds=30))
        if sweep(backlog={None: 10_000}).woken:
            woken_at.append(second)
    # First after the cap (300 s) since its start, then once per cap since the last re-wake: bounded both ways.
    assert woken_at and woken_at[0] <= 300 + 30, woken_at
    assert all(b - a <= 300 + 30 for a, b in zip(woken_at, woken_at[1:], strict=False)), woken_at
    assert len(woken_at) <= 4, f"at most one wake-up per cap in 20 minutes: {woken_at}"


def test_backlog__counts_the_wake_ups_waiting_on_the_broker(broker_url):
    # No worker consumes: each start's message waits on the queue, which the broker counts (a passive declare:
    # kombu's virtual transports answer it with the Redis list's length).
    before = broker.backlog()
    for _ in range(3):
        api.start("noop", {"steps": 1})
    assert before is not None and broker.backlog() == {None: before[None] + 3}
    assert broker.queue_depths(["never-used-queue"]) == {"never-used-queue": 0}


@pytest.fixture
def silent_broker() -> Iterator[int]:
    """A port that accepts connections and never answers: a stalled Redis, a partition, a failover in progress."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(50)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(server.accept()[0])  # never read, never answered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_backlog__a_broker_that_cannot_be_asked_is_unknown_not_zero(monkeypatch):
    monkeypatch.setitem(current_app.conf, "broker_read_url", "redis://127.0.0.1:1/0")  # nothing listens there
    assert broker.backlog() is None


def test_backlog__a_broker_that_never_answers_is_unknown_within_seconds(monkeypatch, silent_broker):
    monkeypatch.setitem(current_app.conf, "broker_read_url", f"redis://127.0.0.1:{silent_broker}/0")
    asked = threading.Thread(target=broker.backlog, daemon=True)
    asked.start()
    asked.join(timeout=30)  # broker.ANSWER_WITHIN_SECONDS is 2: the read gives up long before
    assert not asked.is_alive(), "the sweep, durable_status and /metrics would hang on a silent broker"
    assert broker.backlog() is None


def test_status__answers_on_a_broker_that_never_answers(silent_broker):
    env = {**os.environ, "CELERY_BROKER_URL": f"redis://127.0.0.1:{silent_broker}/0"}
    env["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{connection.settings_dict['NAME']}"
    status = subprocess.run(
        [sys.executable, "manage.py", "durable_status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert "queued messages: unknown (the broker did not answer)" in status.stdout, status.stdout + status.stderr


@override_settings(DURABLE_AGENTS=SWEEPS)
def test_sweep_task__measures_the_backlog_and_adds_nothing_to_a_deep_queue(broker_url):
    runs = [api.start("noop", {"steps": 1}) for _ in range(3)]  # each one's message waits on the queue
    clock.advance(timedelta(minutes=2))  # past IDLE_RESWEEP_SECONDS, within RESWEEP_BACKOFF_MAX_SECONDS
    depth = broker.backlog()

    assert tasks.sweep()["woken"] == 0, "beat's pass asked the broker and found the queue deep enough"
    assert broker.backlog() == depth and [_swept(run) for run in runs] == [0, 0, 0]


def test_worker__a_task_that_waits_out_the_pools_timeout_logs_one_line_and_its_run_completes_later(
    start_worker, tmp_path
):
    # Django's pool (psycopg_pool.ConnectionPool) raises PoolTimeout when no connection frees up within `timeout`
    # (https://www.psycopg.org/psycopg3/docs/api/pool.html: getconn "raises PoolTimeout"); Django re-raises it as an
    # OperationalError. A gevent worker with more greenlets than connections meets it under load: overload, not a
    # fault — one line, no traceback, and the run is woken again.
    worker = start_worker(pool="gevent", concurrency=2, env={"DJANGO_DB_POOL": "1", "DJANGO_DB_POOL_TIMEOUT": "2"})
    release = tmp_path / "release"
    holder = api.start("slow", {"until": str(release)})  # its step holds the only pooled connection
    wait_for(lambda: Execution.objects.filter(run_id=holder.id).exists(), timeout=60, what="the holder's step")
    starved = api.start("noop", {"steps": 1})
    log = lambda: worker.log_path.read_text(errors="replace")  # noqa: E731
    wait_for(lambda: "no free database connection" in log(), timeout=60, what="the starved task to time out")
    release.touch()
    wait_for_run(holder.id, "completed", timeout=60)

    clock.advance(timedelta(minutes=1))
    sweep()  # the sweep (beat's, here this process's) wakes the starved run again
    wait_for_run(starved.id, "completed", timeout=60)

    assert f"run {starved.id}: no free database connection within the pool's timeout" in log()
    assert "Traceback" not in log() and "raised unexpected" not in log(), log()


def test_worker__a_batch_whose_run_waits_out_the_pools_timeout_logs_one_line_and_every_run_completes_later(
    start_worker, tmp_path
):
    # As above for a batched wake-up (tasks.advance_many): the run that met the timeout and the runs after it in the
    # batch are left to the sweep (more messages would only deepen the queue the worker is behind on).
    worker = start_worker(pool="gevent", concurrency=2, env={"DJANGO_DB_POOL": "1", "DJANGO_DB_POOL_TIMEOUT": "2"})
    release = tmp_path / "release"
    holder = api.start("slow", {"until": str(release)})
    wait_for(lambda: Execution.objects.filter(run_id=holder.id).exists(), timeout=60, what="the holder's step")
    batched = {**settings.DURABLE_AGENTS, "WAKE_BATCH_SIZE": 25}
    with override_settings(DURABLE_AGENTS=batched), transaction.atomic():
        starved = [api.start("noop", {"steps": 1}) for _ in range(3)]  # one advance_many message for the three
    log = lambda: worker.log_path.read_text(errors="replace")  # noqa: E731
    wait_for(lambda: "no free database connection" in log(), timeout=60, what="the starved batch to time out")
    release.touch()
    wait_for_run(holder.id, "completed", timeout=60)

    clock.advance(timedelta(minutes=1))
    sweep()
    for run in starved:
        wait_for_run(run.id, "completed", timeout=60)

    assert log().count("no free database connection within the pool's timeout") == 1, log()
    assert "Traceback" not in log() and "raised unexpected" not in log(), log()
