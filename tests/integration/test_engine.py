"""The run engine on real Postgres + Redis + celery worker processes: completion, retries, cancel, lost messages.

Retry delays are also tried on RabbitMQ (a vhost of the machine's, per test; skipped without `rabbitmqctl`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Count
from django.test.utils import override_settings

from durable_agents import api, clock
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus
from durable_agents.tasks import advance as advance_task
from durable_agents.testing import wait_for, wait_for_run
from tests.chaos.services import WAKE_BROKER_ENV, rabbit_vhost, require_rabbitmq
from tests.integration.conftest import broker_down
from tests.integration.shared_clock import SharedClock
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db(transaction=True)


def executions_per_step(run_id) -> dict[str, int]:
    rows = Execution.objects.filter(run_id=run_id).values("step_id").annotate(n=Count("id"))
    return {row["step_id"]: row["n"] for row in rows}


def test_advance__twenty_step_run_commits_each_step_once(start_worker):
    start_worker()
    run = api.start("record", {"steps": 20})

    run = wait_for_run(run.id, "completed", timeout=60)

    counts = executions_per_step(run.id)
    assert len(counts) == 20 and set(counts.values()) == {1}, f"every step must run exactly once: {counts}"
    assert Step.objects.filter(run=run, status=StepStatus.DONE).count() == 20
    assert run.output == {"step": "s020"}, "the run's output is its last step's result"
    assert not Execution.objects.filter(after_commit=True).exists()


def test_advance__duplicate_delivery_commits_once(start_worker):
    start_worker(pool="prefork", concurrency=4)
    start_worker(pool="prefork", concurrency=4)
    run = api.start("record", {"steps": 5, "sleep_ms": [20, 40]})

    for _ in range(10):
        advance_task.delay(str(run.id))
    wait_for_run(run.id, "completed", timeout=60)

    counts = executions_per_step(run.id)
    assert counts == {f"s{i:03d}": 1 for i in range(1, 6)}, f"a duplicate delivery executed a step again: {counts}"


def test_retry__transient_errors_back_off_then_succeed(start_worker):
    start_worker()
    run = api.start("flaky", {"failures": 2})

    wait_for_run(run.id, "completed", timeout=60)

    assert executions_per_step(run.id)["flaky"] == 3
    retries = list(Event.objects.filter(run=run, kind="step_retry").order_by("id"))
    assert [e.detail["attempt"] for e in retries] == [1, 2], "each failed attempt is in the history"
    assert retries[0].detail["error"]["type"] == "RetryableError"
    assert Step.objects.get(run=run, step_id="flaky").attempts == 3


def test_retry__exhausted_attempts_fail_the_run_with_a_persisted_error(start_worker):
    start_worker()
    run = api.start("flaky", {"failures": 10})

    run = wait_for_run(run.id, "failed", timeout=60)

    assert executions_per_step(run.id) == {"flaky": 4}, "the retry policy allows 4 attempts in all"
    assert run.error == {"type": "RetryableError", "message": "flaky failure 4", "step": "flaky"}


def test_failure__permanent_error_stops_at_once(start_worker):
    start_worker()
    run = api.start("broken")

    run = wait_for_run(run.id, "failed", timeout=60)

    assert {k: run.error[k] for k in ("type", "message", "step")} == {
        "type": "ValueError",
        "message": "the order data is malformed",
        "step": "broken",
    }
    assert "in _permanent" in run.error["traceback"], "an unexpected error keeps its traceback"
    assert executions_per_step(run.id) == {"first": 1, "broken": 1}
    assert Step.objects.get(run=run, step_id="never").status == StepStatus.PENDING


def test_resume__failed_run_continues_from_the_failed_step(start_worker):
    start_worker()
    run = api.start("flaky", {"failures": 4})
    wait_for_run(run.id, "failed", timeout=60)

    api.resume(run.id, actor="ops@example.com")
    run = wait_for_run(run.id, "completed", timeout=60)

    assert executions_per_step(run.id) == {"flaky": 5, "after": 1}
    resumed = Event.objects.get(run=run, kind="resumed")
    assert resumed.actor == "ops@example.com" and resumed.detail["previous_status"] == "failed"


def test_cancel__running_run_stops_at_the_step_boundary(start_worker, tmp_path):
    start_worker()
    release = tmp_path / "release"  # the step runs until the test creates it: no race with a busy machine
    run = api.start("slow", {"until": str(release)})
    wait_for(lambda: Execution.objects.filter(run_id=run.id).exists(), timeout=30, what="the slow step to start")

    cancelled = api.cancel(run.id, "customer withdrew")
    assert cancelled.status == RunStatus.RUNNING and cancelled.cancel_requested_at is not None
    release.touch()

    run = wait_for_run(run.id, "cancelled", timeout=30)
    assert Step.objects.get(run=run, step_id="slow").status == StepStatus.DONE, "the running step checkpoints"
    time.sleep(1.0)
    assert executions_per_step(run.id) == {"slow": 1}, "a cancelled run never advances again"
    assert Event.objects.filter(run=run, kind="cancelled").count() == 1


def test_cancel__queued_run_never_advances(start_worker):
    run = api.start("record", {"steps": 3})
    api.cancel(run.id, "not needed")
    start_worker()

    advance_task.delay(str(run.id))
    time.sleep(1.5)

    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert not Execution.objects.filter(run_id=run.id).exists(), "a cancelled run executed a step"


def test_sweep__flushed_broker_loses_no_run(start_worker, broker_url):
    runs = [api.start("record", {"steps": 10, "sleep_ms": [20, 30]}) for _ in range(5)]
    redis.Redis.from_url(broker_url).flushdb()  # every wake-up message is gone
    start_worker(beat=True)
    time.sleep(0.3)
    redis.Redis.from_url(broker_url).flushdb()  # and again, mid-run

    for run in runs:
        wait_for_run(run.id, "completed", timeout=90)
        assert set(executions_per_step(run.id).values()) == {1}
    assert Event.objects.filter(kind="swept").exists(), "the sweep re-woke the runs"


# Celery retries a publish (task_publish_retry_policy), then raises kombu's OperationalError for the refused connection
# (Connection._reraise_as_library_errors, kombu/connection.py): the outage the line reports.
@pytest.mark.parametrize("started", [1, 3], ids=["one-run", "three-runs-in-one-transaction"])
def test_start__a_broker_outage_is_one_line_the_run_is_kept_and_the_sweep_wakes_it(start_worker, caplog, started):
    with broker_down() as url, caplog.at_level(logging.WARNING, logger="durable_agents"), transaction.atomic():
        runs = [api.start("record", {"steps": 2}) for _ in range(started)]  # several: one batched wake-up
    said = [r for r in caplog.records if r.name.startswith("durable_agents")]
    assert len(said) == 1, f"one line per failed send, not {[r.getMessage() for r in said]}"
    line = said[0].getMessage()
    assert said[0].levelno == logging.WARNING and not said[0].exc_info, "an outage is a warning line, no traceback"
    assert "\n" not in line and str(runs[0].id) in line and "broker" in line, line
    assert "kept" in line and "sweep" in line, f"the line must say the run is kept and the sweep wakes it: {line}"
    assert url.rsplit("/", 1)[0].removeprefix("redis://") in line, f"the line must say what failed: {line}"
    assert {r.status for r in Run.objects.all()} == {RunStatus.PENDING}, "the runs are committed, runnable"

    start_worker(beat=True)  # the broker is back: the sweep wakes the runs nobody was told about
    for run in runs:
        wait_for_run(run.id, "completed", timeout=120)
        assert set(executions_per_step(run.id).values()) == {1}


# --- Delays: a retry longer than MAX_COUNTDOWN_SECONDS parks the run; no broker message waits for it ---------------


def broker_holds(broker_url: str, run_id) -> bool:
    """Whether the Redis broker holds a message for the run: queued, or delivered and not acknowledged yet. Kombu's
    Redis transport keeps each delivered message in its `unacked` hash until the worker acknowledges it, and a worker
    acknowledges a countdown's message (acks_late) only once it has run it, when it is due."""
    broker = redis.Redis.from_url(broker_url)
    needle = str(run_id).encode()
    for key in broker.scan_iter():
        kind = broker.type(key)
        messages = broker.lrange(key, 0, -1) if kind == b"list" else broker.hvals(key) if kind == b"hash" else []
        if any(needle in message for message in messages):
            return True
    return False


def test_retry__a_long_backoff_parks_the_run_on_the_database_clock_and_leaves_no_message(start_worker, broker_url):
    # The engine's time is a day ahead of every machine's clock (SharedClock shifts it in the workers too): wake_at
    # must be the database's time plus the backoff, not a worker's.
    shared = SharedClock()
    shared.advance(timedelta(days=1))
    start_worker(beat=True, env=shared.env)
    before = clock.now()
    run = api.start("flaky_long_backoff", {"failures": 1})

    parked = wait_for(
        lambda: Run.objects.filter(pk=run.id, wake_at__isnull=False).first(), what="the failed attempt to park the run"
    )
    after = clock.now()

    # The backoff is 14-28 s (tests/testapp/workflows.py), beyond MAX_COUNTDOWN_SECONDS (2 s by default).
    assert before + timedelta(seconds=14) <= parked.wake_at <= after + timedelta(seconds=28), (
        f"wake_at {parked.wake_at} is not the database's time ({before}..{after}) plus the 14-28 s backoff"
    )
    # Once the (solo) worker has run a later message, the failed attempt's task is over and any countdown it sent is
    # in the broker: it would sit there, delivered and unacknowledged, until due. A parked run has no message at all.
    wait_for_run(api.start("record", {"steps": 1}).id, "completed", timeout=60)
    assert not broker_holds(broker_url, run.id), (
        f"the broker holds a message of run {run.id}: a countdown waiting out the backoff in a worker"
    )

    shared.advance(timedelta(seconds=30))  # past wake_at: the next sweep (beat, every 0.5 s) wakes it
    wait_for_run(run.id, "completed", timeout=60)
    assert executions_per_step(run.id) == {"flaky": 2, "after": 1}
    assert Event.objects.filter(run=run, kind="swept").exists(), "the sweep woke the parked run when it was due"


def test_retry__a_long_backoff_holds_no_worker_slot_on_rabbitmq(start_worker, monkeypatch):
    # Celery's docs ("Using RabbitMQ" > "Using Quorum Queues" > "Limitations"): with quorum queues "ETA/Countdown will
    # block the worker when received until the ETA arrives since we can no longer increase the prefetch count";
    # native delayed delivery, the way out, does not work on direct exchanges (celery/app/base.py send_task: "Direct
    # exchanges are not supported with native delayed delivery"). tests/settings.py declares exactly that on amqp: a
    # quorum queue on Celery's default direct exchange. A single-slot worker must still run another run while the
    # first waits out its backoff.
    require_rabbitmq()
    shared = SharedClock()  # on the test's Redis: the workers' broker is RabbitMQ
    with rabbit_vhost() as url:
        monkeypatch.setenv(WAKE_BROKER_ENV, url)
        waker = {**settings.DURABLE_AGENTS, "WAKER": "tests.chaos.services.wake"}  # this process publishes there too
        with override_settings(DURABLE_AGENTS=waker):
            start_worker(beat=True, concurrency=1, env={**shared.env, "CELERY_BROKER_URL": url})
            waiting = api.start("flaky_long_backoff", {"failures": 1})
            wait_for(
                lambda: Run.objects.filter(pk=waiting.id, wake_at__isnull=False).exists(),
                timeout=60,
                what="the failed attempt to park the run",
            )

            quick = wait_for_run(api.start("record", {"steps": 1}).id, "completed", timeout=90)

            due = Step.objects.get(run=waiting, step_id="flaky").next_attempt_at
            assert quick.finished_at < due, (
                f"the quick run finished at {quick.finished_at}, after the waiting run's retry was due ({due}): the "
                "worker's only slot held the retry's message until then"
            )
            assert executions_per_step(waiting.id) == {"flaky": 1}

            shared.advance(timedelta(seconds=30))
            wait_for_run(waiting.id, "completed", timeout=60)
            assert Event.objects.filter(run=waiting, kind="swept").exists(), "the sweep woke the parked run"


def test_retry__a_sub_second_backoff_rides_rabbitmqs_native_delayed_delivery(start_worker, monkeypatch):
    # On a topic exchange beside a quorum queue, Celery delays a countdown in RabbitMQ itself, in whole seconds:
    # send_task passes int(countdown) to kombu's calculate_routing_key, which raises ValueError below 1 s
    # (durable_agents/broker.py). The tests' backoff is 0.025-0.05 s. With no beat, nothing but that countdown's
    # message can wake the run.
    require_rabbitmq()
    monkeypatch.setenv("DURABLE_TEST_EXCHANGE_TYPE", "topic")  # tests/settings.py, for the worker and the publisher
    with rabbit_vhost() as url:
        monkeypatch.setenv(WAKE_BROKER_ENV, url)
        waker = {**settings.DURABLE_AGENTS, "WAKER": "tests.chaos.services.wake"}
        with override_settings(DURABLE_AGENTS=waker):
            start_worker(env={"CELERY_BROKER_URL": url})
            run = api.start("flaky", {"failures": 1})

            wait_for_run(run.id, "completed", timeout=60)

            assert executions_per_step(run.id) == {"flaky": 2, "after": 1}
