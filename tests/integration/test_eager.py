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
from durable_agents.engine.payloads import StoredResult
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus, Wait
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.workflows import call, workflow
from tests.celery import deliveries_key
from tests.integration.conftest import MODEL_QUEUE, ROUTED
from tests.integration.wakers import RECORDING, woken
from tests.testapp.models import Execution, LedgerEntry

ON = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 10}
OFF = {"EAGER_SLICE_MS": 0.0}
MODES = pytest.mark.parametrize("mode", [ON, OFF], ids=["slice_on", "slice_off"])


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": RECORDING["WAKER"], **changes})


# --- in this process: statements and wake-ups, exactly -------------------------------------------------------


@pytest.mark.django_db
def test_slice__a_run_completes_in_one_task_with_one_statement_per_step_and_no_wake_up():
    run = api.start("noop", {"steps": 10})
    with _in_process(**{**ON, "EAGER_MAX_STEPS": 50}), CaptureQueriesContext(connection) as queries:
        assert advance_slice(run.id) == Outcome.COMPLETED
    # The first claim; then each step's commit claims the next (its token, its attempt) in the same statement.
    assert len(queries.captured_queries) == 11, "a commit and the next claim are one statement"
    results = _results(run.id)
    assert [r["step"] for r in results] == [f"tick-{n}" for n in range(1, 11)]
    assert woken == [], "no wake-up is sent for a step this task claims itself"


@pytest.mark.django_db
@pytest.mark.parametrize(("changes", "steps"), [({"EAGER_MAX_STEPS": 3}, 4), (OFF, 1), ({"EAGER_MAX_STEPS": 0}, 1)])
def test_slice__ends_after_its_step_count_and_wakes_the_run_once(changes, steps):
    run = api.start("noop", {"steps": 10})
    with _in_process(**{**ON, **changes}), CaptureQueriesContext(connection) as queries:
        assert advance_slice(run.id) == Outcome.COMMITTED
    assert Run.objects.get(pk=run.id).cursor == steps
    # The first claim, one statement per step the slice went on from, then the last step's plain commit.
    assert len(queries.captured_queries) == steps + 1
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
def test_slice__a_commit_and_claim_whose_answer_is_lost_still_wakes_the_run(monkeypatch):
    run = api.start("noop", {"steps": 5})
    real, calls = transitions.checkpoint_and_claim, []

    def commit_then_lose_the_connection(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        raise OperationalError("the server closed the connection unexpectedly")

    monkeypatch.setattr(transitions, "checkpoint_and_claim", commit_then_lose_the_connection)
    with _in_process(**ON), pytest.raises(OperationalError):
        advance_slice(run.id)
    assert Run.objects.get(pk=run.id).cursor == 1 and calls[0].claimed is not None
    assert woken == [(str(run.id), {})], "a run whose next claim went unanswered must still be woken"


def _claimed(run_id) -> tuple:
    claimed = transitions.claim_run(run_id)
    assert claimed is not None
    return claimed


def _commit_and_claim(claimed: tuple, value: dict) -> transitions.Onward:
    claim, step = claimed
    return transitions.checkpoint_and_claim(claim, step, StoredResult(value), model_bound=True, plain=True)


def _row(run_id) -> dict:
    return Run.objects.filter(pk=run_id).values(
        "cursor", "lease_token", "attempt", "lease_owner", "lease_expires_at", "previous_lease_owner", "status"
    )[0]


@pytest.mark.django_db
def test_commit_and_claim__takes_the_next_step_with_the_next_token_and_a_first_attempt():
    run = api.start("noop", {"steps": 3})
    _claimed(run.id)
    Run.objects.filter(pk=run.id).update(lease_expires_at=None)  # that worker died: the step's second claim
    claim, step = claimed = _claimed(run.id)
    assert claim.attempt == 2
    onward = _commit_and_claim(claimed, {"one": 1})
    assert onward.committed is transitions.Committed.CHECKPOINTED and onward.kind == "call"
    following, next_step = onward.claimed
    assert (following.token, following.attempt, following.cursor) == (claim.token + 1, 1, 1)
    assert following.previous_owner == "" and following.previous_claimed_at == claim.claimed_at
    assert next_step.step_id == "tick-2" and next_step.run.input == {"steps": 3}
    row = _row(run.id)
    assert row["lease_token"] == claim.token + 1 and row["attempt"] == 1 and row["cursor"] == 1
    assert row["lease_owner"] == following.owner and row["lease_expires_at"] and row["previous_lease_owner"] == ""
    first = Step.objects.get(pk=step.pk)
    assert first.status == StepStatus.DONE and first.result == {"one": 1} and first.attempts == 2
    with _in_process(**ON):
        assert advance_slice(run.id) == Outcome.SKIPPED, "the next step is held by the claim just made"


@pytest.mark.django_db
def test_commit_and_claim__a_zombie_writes_nothing():
    run = api.start("noop", {"steps": 3})
    zombie = _claimed(run.id)
    Run.objects.filter(pk=run.id).update(lease_expires_at=None)  # its lease ran out and another worker took over
    holder, _ = _claimed(run.id)
    before = _row(run.id)
    onward = _commit_and_claim(zombie, {"late": True})
    assert onward == transitions.Onward(transitions.Committed.LOST)
    assert _row(run.id) == before and before["lease_token"] == holder.token
    assert Step.objects.get(pk=zombie[1].pk).status == StepStatus.PENDING, "the zombie's checkpoint was not written"


@pytest.mark.django_db
def test_commit_and_claim__a_cancel_requested_while_the_step_ran_is_settled_not_claimed():
    def requests_a_cancel(ctx):
        api.cancel(ctx.run.id, "enough")
        return {"step": ctx.step.step_id}

    workflow("cancelled_mid_step", steps=[call("a", requests_a_cancel), call("b", _never)], replace=True)
    run = api.start("cancelled_mid_step")
    with _in_process(**ON), CaptureQueriesContext(connection) as queries:
        assert advance_slice(run.id) == Outcome.CANCELLED
    assert any("AS go" in q["sql"] for q in queries.captured_queries), "the step was committed by commit_and_claim"
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.cursor == 1 and not run.lease_owner
    assert Step.objects.get(run=run, step_id="a").status == StepStatus.DONE
    assert Step.objects.get(run=run, step_id="b").status == StepStatus.PENDING
    kinds = list(Event.objects.filter(run_id=run.id).order_by("id").values_list("kind", flat=True))
    assert kinds[-2:] == ["cancel_requested", "cancelled"] and "lease_takeover" not in kinds
    assert woken == []


@pytest.mark.django_db
def test_commit_and_claim__a_refused_claim_leaves_the_run_as_a_plain_commit_does():
    run = api.start("noop", {"steps": 3})
    claimed = _claimed(run.id)
    api.cancel(run.id, "enough")
    onward = _commit_and_claim(claimed, {"one": 1})
    assert onward.committed is transitions.Committed.CHECKPOINTED and onward.claimed is None
    row = _row(run.id)
    assert row == {**row, "cursor": 1, "lease_token": claimed[0].token, "attempt": 0, "lease_owner": ""}
    assert row["lease_expires_at"] is None and row["status"] == RunStatus.RUNNING


def _never(ctx):
    raise AssertionError("a step after a cancel request ran")


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
