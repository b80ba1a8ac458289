"""Batched wake-ups (engine/wake.py): runs woken by one transaction go out WAKE_BATCH_SIZE to a message.

In-process tests record what the engine hands its wakers (a recording WAKER and BATCH_WAKER); worker tests run real
`celery worker` processes that count their deliveries per run and per batch (DURABLE_TEST_COUNT_DELIVERIES), and
SIGKILL them. What a batch must keep: each run is advanced as if it had a message of its own — a duplicate, a
redelivery after a death, a cancel and a spent slice do to each of its runs what they do to a lone run.
"""

from __future__ import annotations

import json
import threading
import uuid

import pytest
import redis
from django.conf import settings
from django.db import connection, connections, transaction
from django.db.models import Count
from django.test.utils import CaptureQueriesContext, override_settings

from durable_agents import api, tasks
from durable_agents.engine import sweep as engine_sweep
from durable_agents.engine import transitions
from durable_agents.engine.payloads import StoredResult
from durable_agents.models import Run, RunStatus, Step, StepStatus
from durable_agents.testing import wait_for, wait_for_run
from tests.celery import BATCHES_KEY, deliveries_key
from tests.integration.conftest import MODEL_QUEUE
from tests.integration.wakers import RECORDING, REFUSING, batches, woken
from tests.testapp.models import Execution, LedgerEntry


def _in_process(**changes: object):
    woken.clear()
    batches.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **RECORDING, "WAKE_BATCH_SIZE": 25, **changes})


def _start(count: int, workflow: str = "noop", data: dict | None = None) -> list[str]:
    return [str(api.start(workflow, data if data is not None else {"steps": 1}).id) for _ in range(count)]


# --- in this process: what is sent, exactly --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_runs_started_in_one_transaction_go_out_batch_size_to_a_message_in_order():
    with _in_process(), transaction.atomic():
        ids = _start(60)
        assert batches == [] and woken == [], "nothing is sent before the commit"
    assert [run_ids for run_ids, _ in batches] == [ids[:25], ids[25:50], ids[50:]]
    assert woken == [], "no run of a batch gets a message of its own too"


@pytest.mark.django_db(transaction=True)
def test_a_rollback_sends_nothing_and_a_rolled_back_savepoint_leaves_out_only_its_runs():
    with _in_process():
        with pytest.raises(RuntimeError), transaction.atomic():
            _start(5)
            raise RuntimeError("the caller's transaction fails")
        assert batches == [] and woken == []

        with transaction.atomic():
            kept = _start(3)
            with pytest.raises(RuntimeError), transaction.atomic():
                _start(4)
                raise RuntimeError("a savepoint rolls back")
            kept += _start(2)
    assert [run_ids for run_ids, _ in batches] == [kept], "the savepoint's runs are neither started nor woken"
    assert sorted(str(run_id) for run_id in Run.objects.values_list("id", flat=True)) == sorted(kept)


@pytest.mark.django_db(transaction=True)
def test_a_savepoint_that_commits_sends_its_runs_with_the_transaction():
    with _in_process(), transaction.atomic():
        outer = _start(2)
        with transaction.atomic():
            inner = _start(2)
        assert batches == [], "a released savepoint sends nothing before the transaction commits"
    sent = [run_id for run_ids, _ in batches for run_id in run_ids] + [run_id for run_id, _ in woken]
    assert sorted(sent) == sorted(outer + inner)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "changes",
    [
        {"WAKE_BATCH_SIZE": 1},
        {"EAGER_SLICE_MS": 0.0},
        {"BATCH_WAKER": ""},
        # A WAKER of the product's own is never bypassed by the default BATCH_WAKER.
        {"BATCH_WAKER": "durable_agents.tasks.wake_many"},
    ],
    ids=["size_1", "one_step_per_task", "no_batch_waker", "own_waker_default_batch_waker"],
)
def test_without_batches_each_run_gets_its_own_wake_up(changes):
    with _in_process(**changes), transaction.atomic():
        ids = _start(4)
    assert batches == []
    assert [run_id for run_id, _ in woken] == ids


@pytest.mark.django_db(transaction=True)
def test_a_lone_run_and_a_run_started_outside_a_transaction_get_the_plain_wake_up():
    with _in_process():
        lone = _start(1)
        with transaction.atomic():
            alone_in_its_transaction = _start(1)
    assert batches == []
    assert [run_id for run_id, _ in woken] == lone + alone_in_its_transaction


@pytest.mark.django_db(transaction=True)
def test_a_refused_batch_loses_nothing_the_sweep_wakes_the_runs_again(caplog):
    with _in_process(BATCH_WAKER=REFUSING, IDLE_RESWEEP_SECONDS=0):
        with transaction.atomic():
            ids = _start(3)
        assert "could not wake 3 runs" in caplog.text and "the sweep wakes them" in caplog.text, caplog.text
        assert Run.objects.filter(pk__in=ids, status=RunStatus.PENDING).count() == 3, "the runs are committed"
    with _in_process(IDLE_RESWEEP_SECONDS=0):
        engine_sweep.sweep()
    assert sorted(run_id for run_ids, _ in batches for run_id in run_ids) == sorted(ids), "the sweep re-wakes them"


@pytest.mark.django_db(transaction=True)
def test_with_a_model_queue_a_batch_holds_the_default_queue_s_runs_only():
    with _in_process(MODEL_QUEUE=MODEL_QUEUE), transaction.atomic():
        plain = _start(2, "eager", {"steps": 1})
        model_bound = _start(2, "approve_briefed", {})
        plain += _start(1, "eager", {"steps": 1})
    assert batches == [(plain, {})]
    # Model-bound runs each get a message of their own (tests/integration/test_wake_batches_as_single_deliveries.py).
    assert woken == [(run_id, {"queue": MODEL_QUEUE}) for run_id in model_bound]


# --- in this process: a run's last commit claims the batch's next run --------------------------------------------


LONG = {"EAGER_SLICE_MS": 600_000.0}  # a slice the machine's speed never ends


def _claimed(run_id) -> tuple:
    claimed = transitions.claim_run(run_id)
    assert claimed is not None
    return claimed


def _finish_and_claim(claimed: tuple, next_id, *, model_bound: bool = True, plain: bool = True):
    claim, step = claimed
    return transitions.checkpoint_and_claim_next(
        claim, step, StoredResult({"done": True}), next_id, model_bound=model_bound, plain=plain
    )


@pytest.mark.django_db(transaction=True)
def test_batch__one_statement_per_one_step_run_after_the_first_claim():
    with _in_process(), transaction.atomic():
        ids = _start(30)
    with _in_process(**LONG), CaptureQueriesContext(connection) as queries:
        assert tasks.advance_many.run(ids) == "30 advanced"
    assert Run.objects.filter(pk__in=ids, status=RunStatus.COMPLETED).count() == 30
    assert len(queries.captured_queries) == 31, "each run's last commit claims the next run in the same statement"
    assert woken == [] and batches == []


@pytest.mark.django_db(transaction=True)
def test_batch__the_next_run_s_claim_is_a_claim_like_any_other():
    first, following = _start(2)
    before = Run.objects.get(pk=following)
    committed, claimed = _finish_and_claim(_claimed(first), uuid.UUID(following))
    assert committed is transitions.Committed.FINISHED
    assert claimed is not None
    claim, step = claimed
    after = Run.objects.get(pk=following)
    assert after.status == RunStatus.RUNNING and claim.token == after.lease_token == before.lease_token + 1
    assert claim.attempt == after.attempt == 1 and step.position == 0 and step.run.input == {"steps": 1}
    assert after.lease_owner == claim.owner and after.lease_expires_at is not None


@pytest.mark.django_db(transaction=True)
def test_batch__a_lost_commit_writes_nothing_and_claims_nothing():
    first, following = _start(2)
    zombie = _claimed(first)
    Run.objects.filter(pk=first).update(lease_expires_at=None)
    _claimed(first)  # another worker took the run over
    untouched = Run.objects.filter(pk=following).values()[0]
    committed, claimed = _finish_and_claim(zombie, uuid.UUID(following))
    assert (committed, claimed) == (transitions.Committed.LOST, None)
    assert Run.objects.filter(pk=following).values()[0] == untouched


@pytest.mark.django_db(transaction=True)
def test_batch__a_next_run_locked_elsewhere_is_skipped_not_waited_for():
    first, following = _start(2)
    claimed = _claimed(first)
    locked, release, done = threading.Event(), threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with transaction.atomic():
            list(Run.objects.select_for_update().filter(pk=following))
            locked.set()
            release.wait(timeout=120)
        connections.close_all()
        done.set()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        assert locked.wait(timeout=60)
        committed, next_claim = _finish_and_claim(claimed, uuid.UUID(following))
    finally:
        release.set()
        holder.join(timeout=60)
    assert committed is transitions.Committed.FINISHED and next_claim is None
    assert Run.objects.get(pk=following).status == RunStatus.PENDING, "left for its own claim"


@pytest.mark.django_db(transaction=True)
def test_batch__a_next_run_with_a_cancel_requested_is_not_claimed_and_its_cancel_is_settled():
    with _in_process(), transaction.atomic():
        ids = _start(3)
    api.cancel(ids[1], "not wanted")  # pending, nobody holds it: cancelled at once
    with _in_process(**LONG):
        tasks.advance_many.run(ids)
    statuses = dict(Run.objects.filter(pk__in=ids).values_list("id", "status"))
    assert [statuses[uuid.UUID(i)] for i in ids] == ["completed", "cancelled", "completed"]


@pytest.mark.django_db(transaction=True)
def test_batch__a_next_run_whose_step_another_queue_runs_is_not_claimed():
    first = _start(1)[0]
    model_bound = _start(1, "approve_briefed", {})[0]
    committed, claimed = _finish_and_claim(_claimed(first), uuid.UUID(model_bound), model_bound=False, plain=True)
    assert committed is transitions.Committed.FINISHED and claimed is None
    assert Run.objects.get(pk=model_bound).status == RunStatus.PENDING


@pytest.mark.django_db(transaction=True)
def test_batch__a_run_twice_in_one_batch_and_ids_that_name_no_run_are_advanced_as_deliveries_are():
    with _in_process(), transaction.atomic():
        first, second = _start(2)
    with _in_process(**LONG):
        outcome = tasks.advance_many.run([first, first, str(uuid.uuid4()), second, "not-a-uuid", second])
    assert outcome == "5 advanced", "the id that is no UUID is left out, with a log"
    assert Run.objects.filter(pk__in=[first, second], status=RunStatus.COMPLETED).count() == 2


# --- real workers -------------------------------------------------------------------------------------------------

ON = {"WAKE_BATCH_SIZE": 10, "EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 10}


def _worker(start_worker, changes: dict, *, beat: bool = False):
    env = {"DURABLE_TEST_SETTINGS": json.dumps(changes), "DURABLE_TEST_COUNT_DELIVERIES": "1"}
    return start_worker(beat=beat, env=env)


def _counter() -> redis.Redis:
    return redis.Redis.from_url(settings.CELERY_BROKER_URL)


def _deliveries(run_id: str) -> int:
    return int(_counter().get(deliveries_key(run_id)) or 0)


def _start_together(count: int, data: dict, changes: dict) -> list[str]:
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **changes}), transaction.atomic():
        return _start(count, "eager", data)


def _assert_each_step_once(ids: list[str], steps: int = 1) -> None:
    done = Step.objects.filter(run_id__in=ids, status=StepStatus.DONE).count()
    assert done == len(ids) * steps, "every step committed exactly once"
    assert not Execution.objects.filter(run_id__in=ids, after_commit=True).exists(), "a committed step ran again"


@pytest.mark.django_db(transaction=True)
def test_workers__forty_runs_started_together_take_four_messages_and_each_runs_once(start_worker):
    _counter().delete(BATCHES_KEY)
    _worker(start_worker, ON)
    _worker(start_worker, ON)
    ids = _start_together(40, {"steps": 2}, ON)
    for run_id in ids:
        wait_for_run(run_id, "completed", timeout=120)
    _assert_each_step_once(ids, steps=2)
    assert Execution.objects.filter(run_id__in=ids).count() == 80
    assert int(_counter().get(BATCHES_KEY) or 0) == 4, "40 runs, 10 to a message"
    assert [_deliveries(run_id) for run_id in ids] == [1] * 40, "each run was delivered once, in its batch"


@pytest.mark.django_db(transaction=True)
def test_workers__a_spent_slice_passes_the_rest_of_its_batch_on_and_every_run_completes(start_worker):
    # Each step sleeps 20 ms and the slice is 1 ms: whatever the machine's speed, a batch's task runs one run and
    # passes each of the others on in a message of its own, so none waits behind more than one spent slice (passed
    # on as one batch, the n-th run would wait behind n - 1 of them: the model queue's runs one model call each).
    short = {**ON, "EAGER_SLICE_MS": 1.0}
    _counter().delete(BATCHES_KEY)
    _worker(start_worker, short)
    ids = _start_together(5, {"steps": 1, "sleep_ms": [20, 20]}, short)
    for run_id in ids:
        wait_for_run(run_id, "completed", timeout=120)
    _assert_each_step_once(ids)
    assert int(_counter().get(BATCHES_KEY) or 0) == 1, "5 runs: one batch, then a message each for the 4 left"
    assert [_deliveries(run_id) for run_id in ids] == [1, 2, 2, 2, 2]


@pytest.mark.django_db(transaction=True)
def test_workers__a_batch_delivered_twice_runs_each_step_once(start_worker):
    _worker(start_worker, ON)
    _worker(start_worker, ON)
    ids = _start_together(10, {"steps": 3, "sleep_ms": [5, 15]}, ON)
    tasks.wake_many(ids)
    tasks.wake_many(list(reversed(ids)))
    for run_id in ids:
        wait_for_run(run_id, "completed", timeout=120)
    _assert_each_step_once(ids, steps=3)
    assert Execution.objects.filter(run_id__in=ids).count() == 30, "a step body ran twice"


@pytest.mark.django_db(transaction=True)
def test_workers__a_run_cancelled_before_its_turn_in_a_batch_runs_nothing(start_worker):
    ids = _start_together(6, {"steps": 1}, ON)  # no worker yet: the batch waits in the broker
    api.cancel(ids[3], "not wanted")
    _worker(start_worker, ON)
    for index, run_id in enumerate(ids):
        wait_for_run(run_id, "cancelled" if index == 3 else "completed", timeout=120)
    assert not Execution.objects.filter(run_id=ids[3]).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_workers__sigkill_mid_batch_every_run_completes_and_no_effect_repeats(start_worker):
    changes = {**ON, "WAKE_BATCH_SIZE": 20, "LEASE_SECONDS": 5}
    workers = [_worker(start_worker, changes, beat=True), _worker(start_worker, changes)]
    ids = _start_together(40, {"steps": 1, "sleep_ms": [30, 60], "effects": True}, changes)
    kills = 0
    for threshold in (5, 25):
        wait_for(lambda t=threshold: Execution.objects.filter(run_id__in=ids).count() >= t, timeout=120, what="steps")
        held = Run.objects.filter(pk__in=ids, status=RunStatus.RUNNING).exclude(lease_owner="")
        owners = list(held.values_list("lease_owner", flat=True))
        victims = [w for w in workers if any(w.owns(owner) for owner in owners)]
        if not victims:
            continue
        victim = victims[0]
        victim.kill()
        kills += 1
        workers[workers.index(victim)] = _worker(start_worker, changes, beat="--beat" in victim.args)
    for run_id in ids:
        wait_for_run(run_id, "completed", timeout=180)
    assert kills >= 1, "no worker was killed mid-batch; lengthen the steps"
    _assert_each_step_once(ids)
    counts = dict(Execution.objects.filter(run_id__in=ids).values_list("run_id").annotate(n=Count("id")))
    assert len(counts) == 40, "no run was skipped"
    # DESIGN.md §2: a plain step body is at-least-once (again only after a death); an effect is exactly once.
    assert sum(counts.values()) - 40 <= kills, f"more re-executions than kills: {counts}"
    entries = LedgerEntry.objects.filter(kind="eager")
    assert entries.count() == 40 and len(set(entries.values_list("idempotency_key", flat=True))) == 40


def test_a_message_that_is_not_a_list_of_run_ids_is_dropped_with_a_log(caplog):
    assert tasks.advance_many.run("not-a-list") == "rejected"
    assert tasks.advance_many.run([1, 2]) == "rejected"
    assert "advance_many takes a list of run ids" in caplog.text
