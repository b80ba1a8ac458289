"""Wake-ups of runs started one per transaction, gathered by the starting process (engine/gather.py, WAKE_GATHER_MS).

What is kept: every committed start is woken, once, by the gathered message or — when the process never sent it
(killed in the window, a broker that refused it) — by the sweep; a process that exits normally sends what it
gathered; a forked child does not send its parent's. What is not promised: that the message has left when
`api.start` returns. By default (WAKE_GATHER_MS 0) each start sends its own wake-up at its commit; these tests
turn gathering on. A window of a minute with WAKE_BATCH_SIZE 5 makes a batch go out when it is full and never
because time passed, whatever the machine's speed; a test that needs what is held sent flushes instead of sleeping,
and what a test leaves held is flushed as it ends, under its own recording wakers.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import redis
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from durable_agents import api
from durable_agents.engine import gather
from durable_agents.engine import sweep as engine_sweep
from durable_agents.engine.gather import GATHERER, Gatherer
from durable_agents.models import Run, RunStatus
from durable_agents.testing import wait_for, wait_for_run
from tests.integration.conftest import MODEL_QUEUE
from tests.integration.wakers import RECORDING, REFUSING, batches, woken
from tests.testapp.models import Execution

WINDOW = {"WAKE_GATHER_MS": 60_000.0, "WAKE_BATCH_SIZE": 5}  # a batch leaves when 5 are in (or after a minute)


@pytest.fixture(autouse=True)
def _nothing_left_held():
    """What a test leaves held is sent to the recording wakers now, not later into another test's broker."""
    yield
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **RECORDING}):
        GATHERER.flush()


def _gathering(**changes: object):
    GATHERER.flush()
    woken.clear()
    batches.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **RECORDING, **WINDOW, **changes})


def _sent() -> list[str]:
    return [run_id for run_ids, _ in batches for run_id in run_ids] + [run_id for run_id, _ in woken]


@pytest.mark.django_db(transaction=True)
def test_runs_started_one_per_transaction_go_out_in_one_message_once_a_batch_is_in():
    with _gathering():
        ids = [str(api.start("noop", {"steps": 1}).id) for _ in range(5)]
        wait_for(lambda: batches, timeout=30, what="the gathered batch")
    assert batches == [(ids, {})], "five starts, one message, in the order they committed"
    assert woken == []


@pytest.mark.django_db(transaction=True)
def test_a_start_still_costs_one_statement_and_returns_before_its_wake_up_leaves():
    with _gathering():
        with CaptureQueriesContext(connection) as queries:
            run = api.start("noop", {"steps": 1})
        assert len(queries.captured_queries) == 1
        assert _sent() == [] and GATHERER.held() == 1, "held for the window: sent by the process's sender thread"
        GATHERER.flush()
    assert _sent() == [str(run.id)]


@pytest.mark.django_db(transaction=True)
def test_a_start_in_a_transaction_that_rolls_back_gathers_nothing():
    with _gathering():
        with pytest.raises(RuntimeError), transaction.atomic():
            api.start("noop", {"steps": 1})
            raise RuntimeError("the caller's transaction fails")
        assert GATHERER.held() == 0
        kept = api.start("noop", {"steps": 1})
        GATHERER.flush()
    assert _sent() == [str(kept.id)]


@pytest.mark.django_db(transaction=True)
def test_a_refused_batch_loses_nothing_the_sweep_wakes_the_runs(caplog):
    with _gathering(BATCH_WAKER=REFUSING):
        ids = [str(api.start("noop", {"steps": 1}).id) for _ in range(3)]
        GATHERER.flush()
        assert "could not wake 3 runs" in caplog.text, caplog.text
        assert Run.objects.filter(pk__in=ids, status=RunStatus.PENDING).count() == 3, "the runs are committed"
        assert GATHERER.held() == 0
    with _gathering(IDLE_RESWEEP_SECONDS=0, WAKE_GATHER_MS=0.0):
        engine_sweep.sweep()
    assert sorted(_sent()) == sorted(ids), "the sweep re-wakes them"


def test_a_sender_whose_send_raises_logs_it_and_sends_the_next_batch(caplog):
    sent: list[list[str]] = []

    def send(run_ids, kinds):
        if not sent:
            sent.append([])
            raise RuntimeError("a bug in a waker")
        sent.append(list(run_ids))

    gatherer = Gatherer(send)
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKE_GATHER_MS": 1.0}):
        gatherer.add("a", None)
        wait_for(lambda: sent, timeout=30, what="the first send")
        gatherer.add("b", None)
        wait_for(lambda: len(sent) == 2, timeout=30, what="the second send")
    assert sent == [[], ["b"]]
    assert "could not wake 1 started runs now; the sweep will" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_forked_child_holds_none_of_its_parent_s_wake_ups():
    with _gathering():
        run = api.start("noop", {"steps": 1})
        pid = os.fork()
        if pid == 0:  # the child (a prefork pool's, a server's worker): its parent's run is not its to send
            os._exit(0 if GATHERER.held() == 0 else 1)
        _, status = os.waitpid(pid, 0)
        GATHERER.flush()
    assert os.waitstatus_to_exitcode(status) == 0, "the child held its parent's wake-up"
    assert _sent() == [str(run.id)], "the parent sends it, once"


def _start_in_a_process(*, then: str) -> str:
    """Start one run in a new Python process with gathering on (a window of 60 s), then `then` (Python); the run's
    id, which the process prints before `then`."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import django
        django.setup()
        from durable_agents import api
        run = api.start("noop", {{"steps": 1}})
        print(run.id, flush=True)
        {then}
        """
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": _database_url(),
        "DURABLE_TEST_SETTINGS": json.dumps({"WAKE_GATHER_MS": 60_000.0}),
    }
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip(), done.stderr
    return done.stdout.split()[0]


def _database_url() -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _queued_run_ids() -> list[str]:
    """The run ids of the advance messages waiting on the test broker's default queue."""
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    found = []
    for raw in reversed(broker.lrange("celery", 0, -1)):  # kombu pushes on the left
        message = json.loads(raw)
        args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        if message["headers"].get("task") == "durable_agents.advance":
            found.append(args[0])
        elif message["headers"].get("task") == "durable_agents.advance_many":
            found.extend(args[0])
    return found


@pytest.mark.django_db(transaction=True)
def test_a_process_that_exits_sends_what_it_gathered_first():
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("celery")
    run_id = _start_in_a_process(then="sys.exit(0)")
    assert _queued_run_ids() == [run_id], "sent at exit, though the window had a minute to go"


@pytest.mark.django_db(transaction=True)
def test_a_process_killed_in_the_window_loses_only_the_wake_up_the_sweep_wakes_the_run():
    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("celery")
    run_id = _start_in_a_process(then="os.kill(os.getpid(), signal.SIGKILL)")
    assert _queued_run_ids() == [], "killed before the window ended: nothing was sent"
    assert Run.objects.get(pk=run_id).status == RunStatus.PENDING, "the start is committed"
    with _gathering(IDLE_RESWEEP_SECONDS=0, WAKE_GATHER_MS=0.0):
        engine_sweep.sweep()
    assert run_id in _sent(), "the sweep wakes it"


@pytest.mark.django_db(transaction=True)
def test_workers__runs_started_one_per_transaction_complete_each_step_once(start_worker):
    start_worker()  # no beat: no sweep wakes a run the gathered messages did not
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKE_GATHER_MS": 10.0}):
        ids = [str(api.start("eager", {"steps": 2}).id) for _ in range(30)]
    for run_id in ids:
        wait_for_run(run_id, "completed", timeout=120)
    assert Execution.objects.filter(run_id__in=ids).count() == 60, "every step ran once"
    assert not Execution.objects.filter(run_id__in=ids, after_commit=True).exists(), "a committed step ran again"


class Interrupted(BaseException):
    """Not an Exception: a waker's sys.exit(), a gevent Timeout."""


def test_a_send_interrupted_by_a_base_exception_does_not_stop_the_sender(caplog):
    sent: list[str] = []
    gatherer = Gatherer(lambda run_ids, kinds: None)

    def send(run_ids, kinds):
        sent.extend(run_ids)
        if run_ids == ["a"]:
            gatherer.add("b", None)  # handed over while the sender is still alive: it is the one to send it
            raise Interrupted

    gatherer._send = send
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKE_GATHER_MS": 1.0}):
        gatherer.add("a", None)
        wait_for(lambda: "b" in sent, timeout=10, what="the run handed over after the interrupted send")
    assert sent == ["a", "b"]
    assert gatherer.held() == 0
    assert "a wake-up batch was interrupted; the sweep wakes its runs" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_sender_whose_database_connection_was_dropped_still_routes_the_next_runs():
    # With a REPLAY_QUEUE, routing a run asks the database whether it is a replay's: the sender thread queries.
    with _gathering(REPLAY_QUEUE="replay"):
        first = [str(api.start("noop", {"steps": 1}).id) for _ in range(5)]
        wait_for(lambda: batches, timeout=30, what="the first gathered batch")
        with connection.cursor() as cursor:  # a database restart, as the sender's connection sees it
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        second = [str(api.start("noop", {"steps": 1}).id) for _ in range(5)]
        wait_for(lambda: len(batches) == 2, timeout=10, what="the second gathered batch")
    assert batches == [(first, {}), (second, {})]


def test_a_sender_that_cannot_keep_up_holds_a_bounded_number_of_wake_ups():
    # The sender stuck in a send (a broker that hangs), or never run (uWSGI without enable-threads): the starts
    # do not pile up in memory; past a bound, a start sends what is held itself, as it did before gathering.
    stuck = threading.Event()
    sent: list[str] = []

    def send(run_ids, kinds):
        if threading.current_thread().name == "durable-agents-wake":
            stuck.wait(30)
        sent.extend(run_ids)

    gatherer = Gatherer(send)
    try:
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKE_GATHER_MS": 1.0}):
            gatherer.add("first", None)
            wait_for(lambda: gatherer.held() == 1 and not gatherer._pending, timeout=10, what="the stuck send")
            for n in range(10_000):
                gatherer.add(str(n), None)
            assert gatherer.held() <= 1_001, "a few batches' worth at most, not every start since the sender stuck"
            assert len(sent) + gatherer.held() == 10_001
    finally:
        stuck.set()


@pytest.mark.django_db(transaction=True)
def test_a_prefork_pool_process_that_exits_sends_what_it_gathered_first():
    # Billiard ends a pool process (max_tasks_per_child, a warm shutdown) with os._exit: atexit does not run, but
    # worker_process_shutdown is sent first. A step's child run started just before is woken, not left to the sweep.
    from celery.signals import worker_process_shutdown

    with _gathering():
        run = api.start("noop", {"steps": 1})
        worker_process_shutdown.send(sender="celery@test", pid=os.getpid(), exitcode=0)
        assert _sent() == [str(run.id)]


def test_a_start_whose_sender_thread_cannot_start_sends_its_own_wake_up(monkeypatch):
    # Python 3.12+ refuses a new thread at interpreter shutdown (a start in an atexit handler), any version when the
    # process has no threads left. The start has committed: its hook must neither raise nor drop the wake-up.
    class Refused(threading.Thread):
        def start(self):
            raise RuntimeError("can't create new thread at interpreter shutdown")

    sent: list[str] = []
    gatherer = Gatherer(lambda run_ids, kinds: sent.extend(run_ids))
    monkeypatch.setattr(gather.threading, "Thread", Refused)
    gatherer.add("a", None)
    assert sent == ["a"]
    assert gatherer.held() == 0


@pytest.mark.django_db(transaction=True)
def test_starts_in_one_transaction_gather_those_kept_and_not_those_of_a_savepoint_rolled_back():
    with _gathering():
        with transaction.atomic():  # a request under ATOMIC_REQUESTS
            first = api.start("noop", {"steps": 1})
            with pytest.raises(RuntimeError), transaction.atomic():
                api.start("noop", {"steps": 1})
                raise RuntimeError("a savepoint rolled back")
            second = api.start("noop", {"steps": 1})
            assert GATHERER.held() == 0, "nothing is handed over before the commit"
        GATHERER.flush()
    assert _sent() == [str(first.id), str(second.id)]


@pytest.mark.django_db(transaction=True)
def test_a_start_that_finds_its_key_s_run_wakes_nothing_as_before():
    with _gathering():
        run = api.start("noop", {"steps": 1}, idempotency_key="once")
        GATHERER.flush()
        again = api.start("noop", {"steps": 1}, idempotency_key="once")
        GATHERER.flush()
    assert again.id == run.id
    assert _sent() == [str(run.id)], "the run was woken by its own start"


@pytest.mark.django_db(transaction=True)
def test_gathered_model_bound_runs_each_get_a_message_and_keyed_runs_are_admitted_not_gathered():
    with _gathering(MODEL_QUEUE=MODEL_QUEUE):
        plain = [str(api.start("eager", {"steps": 1}).id) for _ in range(2)]
        model_bound = [str(api.start("approve_briefed", {}).id) for _ in range(2)]
        plain += [str(api.start("eager", {"steps": 1}).id)]
        wait_for(lambda: batches, timeout=30, what="the gathered batch")
        keyed = api.start("noop", {"steps": 1}, concurrency_key="tenant-1")
        assert GATHERER.held() == 0, "a keyed run is admitted at its commit, and woken then"
    assert batches == [(plain, {})]
    assert woken == [(run_id, {"queue": MODEL_QUEUE}) for run_id in model_bound] + [(str(keyed.id), {})]


def test_a_start_wakes_the_sender_only_for_the_first_run_of_a_batch_and_the_one_that_fills_it():
    # In between there is nothing to send: waking the sender thread at every start cost each start a thread switch
    # (and the GIL back) — a sixth of the starts a second one request thread made beside two busy workers.
    sent: list[list[str]] = []
    gatherer = Gatherer(lambda run_ids, kinds: sent.append(list(run_ids)))
    woke_at: list[int] = []  # how many runs were held at each wake-up of the sender
    notify = gatherer._arrived.notify
    gatherer._arrived.notify = lambda n=1: (woke_at.append(len(gatherer._pending)), notify(n))
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **WINDOW}):
        for batch in range(2):
            for n in range(5):
                gatherer.add(f"{batch}-{n}", None)
            wait_for(lambda batch=batch: len(sent) == batch + 1, timeout=30, what="the full batch")
    assert woke_at == [1, 5, 1, 5] and sent == [[f"{b}-{n}" for n in range(5)] for b in range(2)]


def test_flush_returns_once_a_batch_the_sender_took_meanwhile_is_out():
    # At exit, a batch still in the sender's hands when flush returns dies with the daemon thread. The sender may
    # take what is held between flush's look at what is in flight and its own take: here it is made to.
    sent: list[str] = []

    def send(run_ids, kinds):
        if threading.current_thread().name == "durable-agents-wake":
            time.sleep(0.5)
        sent.extend(run_ids)

    class TakenMeanwhile(Gatherer):
        def _send_gathered(self):
            if threading.current_thread() is threading.main_thread() and not sent and self.held() < 5:
                for n in range(4):  # the fifth run: a full batch, which the sender takes at once
                    self.add(str(n), None)
                wait_for(lambda: self._in_flight, timeout=10, what="the sender's take")
            super()._send_gathered()

    gatherer = TakenMeanwhile(send)
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **WINDOW}):
        gatherer.add("a", None)
        gatherer.flush()
        assert gatherer.held() == 0, "flush returned with a batch in flight"
    assert sorted(sent) == ["0", "1", "2", "3", "a"]


def test_a_fork_while_another_thread_holds_the_gatherer_s_lock_leaves_the_child_free_to_gather():
    holding, release = threading.Event(), threading.Event()

    def hold():
        with GATHERER._lock:  # the sender, mid-take, as the process forks
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    holding.wait(10)
    try:
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)  # a deadlocked child dies of it, and fails the test
            sent: list[str] = []
            GATHERER._send = lambda run_ids, kinds: sent.extend(run_ids)
            GATHERER.add("child's", None)
            GATHERER.flush()
            os._exit(0 if sent == ["child's"] and GATHERER.held() == 0 else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        holder.join(10)
    assert os.waitstatus_to_exitcode(status) == 0
