"""Eager continuation (engine/eager.py): a task that committed a step claims and runs the next one itself.

In-process tests count statements and wake-ups exactly (a recording WAKER); worker tests run real `celery worker`
processes that count their deliveries (DURABLE_TEST_COUNT_DELIVERIES) and SIGKILL them. Each worker test runs
with the slice on and, where the guarantee is the same, with it off (EAGER_SLICE_MS=0: one step per task). The
slices are made long (minutes) so what ends one is never the machine's speed.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import redis
from django.conf import settings
from django.db import OperationalError, connection
from django.db.models import Count
from django.test.utils import CaptureQueriesContext, override_settings

from durable_agents import api, tasks
from durable_agents.engine import transitions
from durable_agents.engine.advance import Outcome, advance_slice
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus, Wait
from durable_agents.testing import wait_for, wait_for_run
from tests.celery import deliveries_key
from tests.integration.conftest import MODEL_QUEUE, ROUTED
from tests.testapp.models import Execution, LedgerEntry

ON = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 10}
OFF = {"EAGER_SLICE_MS": 0.0}
MODES = pytest.mark.parametrize("mode", [ON, OFF], ids=["slice_on", "slice_off"])
woken: list[tuple[str, dict]] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append((str(run_id), routed))


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_wake", **changes})


# --- in this process: statements and wake-ups, exactly -------------------------------------------------------


@pytest.mark.django_db
def test_slice__a_run_completes_in_one_task_with_two_statements_per_step_and_no_wake_up():
    run = api.start("noop", {"steps": 10})
    with _in_process(**{**ON, "EAGER_MAX_STEPS": 50}), CaptureQueriesContext(connection) as queries:
        assert advance_slice(run.id) == Outcome.COMPLETED
    assert len(queries.captured_queries) == 20, "each step is still one claim and one fenced checkpoint"
    assert woken == [], "no wake-up is sent for a step this task claims itself"


@pytest.mark.django_db
@pytest.mark.parametrize(("changes", "steps"), [({"EAGER_MAX_STEPS": 3}, 4), (OFF, 1), ({"EAGER_MAX_STEPS": 0}, 1)])
def test_slice__ends_after_its_step_count_and_wakes_the_run_once(changes, steps):
    run = api.start("noop", {"steps": 10})
    with _in_process(**{**ON, **changes}), CaptureQueriesContext(connection) as queries:
        assert advance_slice(run.id) == Outcome.COMMITTED
    assert Run.objects.get(pk=run.id).cursor == steps
    assert len(queries.captured_queries) == 2 * steps
    assert woken == [(str(run.id), {})], "the slice hands the run to the broker exactly as one step per task does"


@pytest.mark.django_db
def test_slice__a_model_bound_next_step_goes_to_the_model_queue_unless_this_worker_serves_it():
    run = api.start("eager_model")
    with _in_process(**ON, MODEL_QUEUE=MODEL_QUEUE):
        assert advance_slice(run.id) == Outcome.COMMITTED
        assert Run.objects.get(pk=run.id).cursor == 2, "a and b ran; the approval did not"
        assert woken == [(str(run.id), {"queue": MODEL_QUEUE})]
        assert advance_slice(run.id, serves=frozenset({MODEL_QUEUE})) == Outcome.WAITING


@pytest.mark.django_db
def test_slice__a_claim_that_raises_sends_the_wake_up_it_replaced(monkeypatch):
    run = api.start("noop", {"steps": 5})
    real_claim, calls = transitions.claim_run, []

    def claim_then_lose_the_database(run_id):
        calls.append(run_id)
        if len(calls) == 2:
            raise OperationalError("the server closed the connection unexpectedly")
        return real_claim(run_id)

    monkeypatch.setattr(transitions, "claim_run", claim_then_lose_the_database)
    with _in_process(**ON), pytest.raises(OperationalError):
        advance_slice(run.id)
    assert Run.objects.get(pk=run.id).cursor == 1
    assert woken == [(str(run.id), {})], "a kept run whose claim failed must still be woken"


# --- real workers ----------------------------------------------------------------------------------------------


def _worker(start_worker, mode: dict, *, beat: bool = False, **kwargs):
    env = {"DURABLE_TEST_SETTINGS": json.dumps(mode), "DURABLE_TEST_COUNT_DELIVERIES": "1"}
    return start_worker(beat=beat, env={**env, **kwargs.pop("env", {})}, **kwargs)


def _deliveries(run_id) -> int:
    return int(redis.Redis.from_url(settings.CELERY_BROKER_URL).get(deliveries_key(run_id)) or 0)


def _results(run_id) -> list[dict]:
    steps = Step.objects.filter(run_id=run_id, status=StepStatus.DONE).order_by("position")
    return [step.result for step in steps]


def _assert_once_each_under_increasing_tokens(run_id, steps: int) -> list[dict]:
    results = _results(run_id)
    assert len(results) == steps, "every step committed exactly once"
    tokens = [r["token"] for r in results]
    assert all(a < b for a, b in zip(tokens, tokens[1:], strict=False)), f"tokens not increasing: {tokens}"
    assert not Execution.objects.filter(run_id=run_id, after_commit=True).exists(), "a committed step ran again"
    return results


@pytest.mark.django_db(transaction=True)
@MODES
def test_deliveries__a_20_step_run_takes_two_tasks_with_the_slice_and_twenty_without(start_worker, mode):
    _worker(start_worker, mode)
    run = api.start("eager", {"steps": 20})
    wait_for_run(run.id, "completed", timeout=60)
    results = _assert_once_each_under_increasing_tokens(run.id, 20)
    assert Execution.objects.filter(run_id=run.id).count() == 20
    tasks_run = [r["task"] for r in results]
    if mode is ON:
        # EAGER_MAX_STEPS=10: the first task runs its step and 10 more, the second the 9 left.
        assert _deliveries(run.id) == 2 and len(set(tasks_run)) == 2
        assert len(set(tasks_run[:11])) == 1 and tasks_run[11] != tasks_run[10]
    else:
        assert _deliveries(run.id) == 20 and len(set(tasks_run)) == 20


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@MODES
def test_sigkill__mid_slice_the_run_completes_and_no_step_is_skipped_or_its_effect_repeated(start_worker, mode):
    rng = random.Random(17)
    workers = [_worker(start_worker, mode, beat=True), _worker(start_worker, mode)]
    steps, kills = 40, 0
    run = api.start("eager", {"steps": steps, "sleep_ms": [20, 60], "effects": True})
    for threshold in (5, 15, 25):
        wait_for(
            lambda t=threshold: Execution.objects.filter(run_id=run.id).count() >= t, timeout=60, what=f"{threshold}"
        )
        current = Run.objects.get(pk=run.id)
        if current.status != RunStatus.RUNNING:
            break
        holders = [w for w in workers if current.lease_owner and w.owns(current.lease_owner)]
        victim = holders[0] if holders else rng.choice(workers)
        victim.kill()
        kills += 1
        workers[workers.index(victim)] = _worker(start_worker, mode, beat="--beat" in victim.args)
        time.sleep(rng.uniform(0.0, 0.2))

    wait_for_run(run.id, "completed", timeout=120)
    assert kills == 3, "the run finished before the kills; lengthen its steps"
    _assert_once_each_under_increasing_tokens(run.id, steps)
    counts = dict(Execution.objects.filter(run_id=run.id).values_list("step_id").annotate(n=Count("id")))
    assert len(counts) == steps, "no step was skipped"
    # DESIGN.md §2: a plain step body is at-least-once (again only after a death); an effect is exactly once.
    assert sum(counts.values()) - steps <= kills, f"more re-executions than kills: {counts}"
    entries = LedgerEntry.objects.filter(kind="eager")
    assert sorted(entries.values_list("order_id", flat=True)) == sorted(counts), "each step's effect exactly once"


@pytest.mark.django_db(transaction=True)
@MODES
def test_duplicates__deliveries_sent_while_a_slice_runs_run_nothing_twice(start_worker, mode):
    _worker(start_worker, mode)
    _worker(start_worker, mode)
    run = api.start("eager", {"steps": 30, "sleep_ms": [10, 20]})
    for at_least in (3, 10, 20):
        wait_for(lambda n=at_least: Execution.objects.filter(run_id=run.id).count() >= n, timeout=60, what="steps")
        tasks.wake(str(run.id))
    wait_for_run(run.id, "completed", timeout=60)
    _assert_once_each_under_increasing_tokens(run.id, 30)
    assert Execution.objects.filter(run_id=run.id).count() == 30, "a step body ran twice"
    wait_for(lambda: _deliveries(run.id) >= 4, timeout=30, what="the duplicate deliveries to be consumed")


@pytest.mark.django_db(transaction=True)
@MODES
def test_cancel__requested_mid_slice_stops_it_at_the_next_step_boundary_and_is_settled(start_worker, mode):
    _worker(start_worker, {**mode, "EAGER_MAX_STEPS": 1000})
    run = api.start("eager", {"steps": 100, "sleep_ms": [20, 30]})
    wait_for(lambda: Execution.objects.filter(run_id=run.id).count() >= 5, timeout=60, what="five steps")
    api.cancel(run.id, "enough")
    # Requested while a worker held the run (mid-step), or cancelled at once if it fell between a commit and
    # the slice's next claim, when nobody holds it: either way no step may finish after it.
    asked = Event.objects.filter(run_id=run.id, kind__in=("cancel_requested", "cancelled")).earliest("id")
    requested_at = asked.created_at
    run = wait_for_run(run.id, "cancelled", timeout=60)
    done = Step.objects.filter(run_id=run.id, status=StepStatus.DONE)
    assert done.filter(finished_at__gt=requested_at).count() <= 1, "steps ran past the cancel request"
    assert done.count() < 100
    if mode is ON:
        assert _deliveries(run.id) == 1, "the run was advanced and cancelled within one task"


@pytest.mark.django_db(transaction=True)
def test_wait__a_park_ends_the_slice_and_the_signal_starts_a_new_one(start_worker):
    _worker(start_worker, ON)
    run = api.start("eager_wait")
    wait_for_run(run.id, "waiting", timeout=60)
    assert _deliveries(run.id) == 1 and Wait.objects.filter(run_id=run.id, status="open").count() == 1
    api.send_signal(run.id, "go")
    wait_for_run(run.id, "completed", timeout=60)
    a, b, _, c = _results(run.id)
    assert a["task"] == b["task"] != c["task"], "the park ended the first task's slice"


@pytest.mark.django_db(transaction=True)
def test_retry__a_delayed_retry_ends_the_slice_and_its_delivery_goes_on(start_worker):
    _worker(start_worker, ON)
    run = api.start("eager_retry")
    wait_for_run(run.id, "completed", timeout=60)
    a, flaky, c = _results(run.id)
    assert a["task"] != flaky["task"] == c["task"], "the retry went through the broker, then continued eagerly"
    assert _deliveries(run.id) == 2


@pytest.mark.django_db(transaction=True)
def test_model_queue__a_plain_worker_hands_a_model_bound_next_step_to_the_model_queue(start_worker, routed):
    _worker(start_worker, {**ON, **ROUTED})
    run = api.start("eager_model")
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    wait_for(lambda: broker.llen(MODEL_QUEUE) == 1, timeout=60, what="the approval's wake-up on the model queue")
    current = Run.objects.get(pk=run.id)
    assert current.status == RunStatus.RUNNING and current.cursor == 2 and not current.lease_owner
    assert not Wait.objects.filter(run_id=run.id).exists(), "the plain worker ran the model-bound step"
    a, b = _results(run.id)
    assert a["task"] == b["task"]
    _worker(start_worker, {**ON, **ROUTED}, extra_args=["--queues", MODEL_QUEUE])
    wait_for_run(run.id, "waiting", timeout=60)
    assert Wait.objects.filter(run_id=run.id, status="open").count() == 1
