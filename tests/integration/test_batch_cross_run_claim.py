"""The batch's cross-run claim (hotpath.commit_and_claim_next, eager.Batch, tasks.advance_many) and its
interactions with child runs, concurrency keys, cancels and retention.

The claim (engine/eager.py, DESIGN.md §2): the claim a run's last commit makes for the batch's next run is a claim
like any other — a new fencing token, an attempt counted, one claim and one fenced checkpoint per step; a LOST commit
claims nothing; a step body runs again only after a death or a lost lease, and a worker paused between a claim and
the step body proves its lease before running it; effects once; no run is left without a wake-up (or the sweep's);
concurrency keys never exceeded; no duplicate child.

In-process tests drive `tasks.advance_many` with a recording WAKER; worker tests run real `celery worker` processes.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import transaction
from django.test.utils import override_settings
from django.utils import timezone

from durable_agents import api, tasks
from durable_agents.engine import transitions
from durable_agents.engine.lease import lease_seconds
from durable_agents.engine.payloads import StoredResult
from durable_agents.models import Event, Run, RunStatus
from durable_agents.signals import run_finished, step_committed
from durable_agents.testing import wait_for_run
from tests.integration.test_concurrency_keys import _max_overlap
from tests.integration.test_wake_batches import _worker
from tests.testapp.models import Execution, LedgerEntry

woken: list[str] = []
batches: list[list[str]] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def record_batch(run_ids: list[str], **routed: str) -> None:
    """A BATCH_WAKER that only records what the engine asked for."""
    batches.append(list(run_ids))


RECORDING = {"WAKER": f"{__name__}.record_wake", "BATCH_WAKER": f"{__name__}.record_batch", "WAKE_BATCH_SIZE": 25}
LONG = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 50}  # a slice the machine's speed never ends


def _in_process(**changes: object):
    woken.clear()
    batches.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **RECORDING, **changes})


def _start_together(count: int, workflow: str = "eager", data: dict | None = None) -> list[str]:
    with _in_process(), transaction.atomic():
        return [str(api.start(workflow, data if data is not None else {"steps": 1}).id) for _ in range(count)]


def _taken_over(run_id: str) -> int:
    """Another worker took the run over (its holder paused past the lease): the lease expired, a new claim; the
    new holder's token."""
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
    claimed = transitions.claim_run(uuid.UUID(run_id))
    assert claimed is not None, "the run was not claimable once its lease expired"
    return claimed[0].token


def _paused() -> None:
    """The worker stops (SIGSTOP, a GC storm) long enough that a claim it made before must be proved again."""
    time.sleep(lease_seconds() / 3 + 0.3)


# --- a worker paused between the claim made for it and the step body ---------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_cross_claim__a_worker_paused_after_the_commit_that_claimed_the_next_run_proves_that_lease_first():
    """A's last commit claims B for this task; the task then pauses (here: in a run_finished receiver of A, as a
    slow pager would hold it) past B's lease, and another worker takes B over. The thawed task must prove B's lease
    before running B's step body, as it would for a claim of its own: B's body must not run a second time beside the
    new holder's."""
    first, following = _start_together(2)
    taker: dict[str, int] = {}

    def pause_after_first(sender, run_id, **kwargs) -> None:
        if str(run_id) == first:
            _paused()
            taker["token"] = _taken_over(following)

    run_finished.connect(pause_after_first, dispatch_uid="batch-claim-pause")
    try:
        with _in_process(**LONG):
            tasks.advance_many.run([first, following])
    finally:
        run_finished.disconnect(dispatch_uid="batch-claim-pause")
    assert "token" in taker, "the receiver did not run: A did not finish"
    assert not Execution.objects.filter(run_id=following).exists(), (
        "B's step body ran under a claim the worker had lost while paused: the claim made by A's commit must be "
        "proved again before the body runs, timed from when it was made"
    )
    assert Run.objects.get(pk=following).lease_token == taker["token"], "the new holder keeps B"
    assert Event.objects.filter(run_id=following, kind="zombie_commit_rejected").exists()


@pytest.mark.django_db(transaction=True)
def test_eager__a_worker_paused_after_the_commit_that_claimed_the_next_step_proves_that_lease_first():
    """The same pause inside one run's slice: step 1's commit claims step 2 for this task (commit_and_claim), the
    task pauses in a step_committed receiver past the lease, another worker takes the run over; the thawed task
    must not run step 2's body beside the new holder."""
    (run_id,) = _start_together(1, data={"steps": 2})
    taker: dict[str, int] = {}

    def pause_after_step_one(sender, run_id: object, step_id: str, **kwargs) -> None:
        if step_id == "s001" and "token" not in taker:
            _paused()
            taker["token"] = _taken_over(str(run_id))

    step_committed.connect(pause_after_step_one, dispatch_uid="batch-claim-pause-eager")
    try:
        with _in_process(**LONG):
            tasks.advance.run(run_id)
    finally:
        step_committed.disconnect(dispatch_uid="batch-claim-pause-eager")
    assert "token" in taker, "the receiver did not run: step 1 did not commit"
    assert not Execution.objects.filter(run_id=run_id, step_id="s002").exists(), (
        "step 2's body ran under a claim the worker had lost while paused"
    )
    assert Run.objects.get(pk=run_id).lease_token == taker["token"]


# --- the next run: not admitted, cancelled once claimed ----------------------------------------------------------


def _finish_and_claim(run_id: str, next_id: str):
    claimed = transitions.claim_run(uuid.UUID(run_id))
    assert claimed is not None
    claim, step = claimed
    return transitions.checkpoint_and_claim_next(
        claim, step, StoredResult({"done": True}), uuid.UUID(next_id), model_bound=True, plain=True
    )


@pytest.mark.django_db(transaction=True)
def test_cross_claim__a_keyed_run_not_admitted_is_never_claimed():
    with _in_process(), transaction.atomic():
        first = str(api.start("eager", {"steps": 1}).id)
        holder = api.start("keyed", {"customer": "k1"})
        queued = api.start("keyed", {"customer": "k1"})
    assert Run.objects.get(pk=holder.id).admitted_at is not None and Run.objects.get(pk=queued.id).admitted_at is None
    committed, claimed = _finish_and_claim(first, str(queued.id))
    assert committed is transitions.Committed.FINISHED and claimed is None, "a queued run was claimed"
    assert Run.objects.get(pk=queued.id).status == RunStatus.PENDING and Run.objects.get(pk=queued.id).attempt == 0


@pytest.mark.django_db(transaction=True)
def test_cross_claim__a_cancel_requested_after_the_next_run_was_claimed_is_settled_after_its_step():
    """B is claimed by A's commit, then cancelled before this task runs it: B's step (already claimed) may run, but
    B never completes — its last commit checkpoints and the cancel is settled."""
    first, following = _start_together(2)

    def cancel_following(sender, run_id, **kwargs) -> None:
        if str(run_id) == first:
            api.cancel(following, "not wanted")

    run_finished.connect(cancel_following, dispatch_uid="batch-claim-cancel")
    try:
        with _in_process(**LONG):
            tasks.advance_many.run([first, following])
    finally:
        run_finished.disconnect(dispatch_uid="batch-claim-cancel")
    after = Run.objects.get(pk=following)
    assert after.status == RunStatus.CANCELLED, f"a cancel requested of a claimed run was lost: {after.status}"
    assert after.lease_owner == "" and Execution.objects.filter(run_id=following).count() <= 1


# --- a death between the commit that claimed the next run and that run's step (real workers) ---------------------


@pytest.mark.django_db(transaction=True)
def test_workers__the_claimer_dies_after_the_commit_that_claimed_the_next_run_the_run_is_taken_over_once(
    start_worker,
):
    """This process plays the worker that dies: it commits A's last step, which claims B, and never runs B (as after
    a SIGKILL right after that statement). The batch is delivered again to a real worker: A is finished, B's lease
    is held by the dead claimer until it expires, then the sweep's re-wake takes B over (a claim: new token,
    attempt 2); C runs. Each body runs once; no run is left behind."""
    ids = _start_together(3, data={"steps": 1, "effects": True})
    first, following, last = ids
    dead_token = None
    with _in_process(**LONG):
        committed, claimed = _finish_and_claim(first, following)
        assert committed is transitions.Committed.FINISHED and claimed is not None
        dead_token = claimed[0].token
    on = {"WAKE_BATCH_SIZE": 10, "EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 10}
    _worker(start_worker, on, beat=True)
    tasks.wake_many(ids)  # the dead worker's batch, delivered again
    for run_id in ids:
        wait_for_run(run_id, "completed", timeout=120)
    assert not Execution.objects.filter(run_id=first).exists(), "A's committed step ran again"
    assert [Execution.objects.filter(run_id=run_id).count() for run_id in (following, last)] == [1, 1]
    taken = Event.objects.get(run_id=following, kind="lease_takeover")
    assert taken.detail["token"] > dead_token and taken.detail["attempt"] == 1, "the dead claim's attempt is counted"
    assert LedgerEntry.objects.filter(kind="eager").count() == 2, "an effect repeated or was lost"


@pytest.mark.django_db(transaction=True)
def test_workers__keyed_and_plain_runs_in_batches_delivered_twice_in_opposite_orders_never_exceed_the_key(
    start_worker,
):
    """Keyed runs (limit 1) and plain ones woken in one batch, then the batch delivered twice more, once reversed, to
    two workers: a cross-claim takes only admitted runs, so the key's runs never overlap, and each step runs once."""
    on = {"WAKE_BATCH_SIZE": 20, "EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 10}
    _worker(start_worker, on, beat=True)
    _worker(start_worker, on)
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **on}), transaction.atomic():
        keyed, plain = [], []
        for _ in range(6):
            keyed.append(str(api.start("keyed", {"customer": "race", "sleep_ms": [5, 20]}).id))
            plain.append(str(api.start("eager", {"steps": 2, "sleep_ms": [5, 20]}).id))
    everything = [run_id for pair in zip(keyed, plain, strict=True) for run_id in pair]
    tasks.wake_many(everything)
    tasks.wake_many(list(reversed(everything)))
    for run_id in everything:
        wait_for_run(run_id, "completed", timeout=180)
    assert _max_overlap(keyed) == 1, "two runs of a key with limit 1 were in flight at once"
    assert Execution.objects.filter(run_id__in=everything).count() == 24, "a step body ran twice or not at all"
    assert not Execution.objects.filter(run_id__in=everything, after_commit=True).exists(), "a committed step ran again"


# --- a parent's join met while its children are being batch-advanced ----------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_children__a_join_met_while_the_children_s_batch_runs_cancels_the_rest_even_the_cross_claimed_one():
    """A fan-out (join "any") starts four children, woken as one batch. Child 0's last commit claims child 1 for this
    task; child 0's end meets the join and the parent runs (here: in child 0's run_finished receiver), cancelling the
    children still live — child 1 while this task holds it. Child 1's step may run (it was claimed before the
    cancel), but it never completes; children 2 and 3 never run; no child is left held; the parent completes."""
    with _in_process(**LONG):
        parent = str(api.start("fan_any", {"items": [{"item": i} for i in range(4)]}).id)
        tasks.advance.run(parent)
        kids = [run_id for batch in batches for run_id in batch]
    assert len(kids) == 4, f"the children were not woken as one batch: {batches} {woken}"
    ran_parent: list[str] = []

    def parent_runs(sender, run_id, **kwargs) -> None:
        if str(run_id) == kids[0] and not ran_parent:
            ran_parent.append(tasks.advance.run(parent))

    run_finished.connect(parent_runs, dispatch_uid="batch-claim-join")
    try:
        with _in_process(**LONG):
            tasks.advance_many.run(kids)
    finally:
        run_finished.disconnect(dispatch_uid="batch-claim-join")
    assert ran_parent, "child 0's end did not reach the receiver"
    statuses = dict(Run.objects.filter(pk__in=kids).values_list("id", "status"))
    assert [statuses[uuid.UUID(k)] for k in kids] == ["completed", "cancelled", "cancelled", "cancelled"]
    assert not Run.objects.filter(pk__in=kids).exclude(lease_owner="").exists(), "a child was left held"
    assert not Execution.objects.filter(run_id__in=kids[2:], step_id="work").exists(), "a cancelled child ran"
    assert Execution.objects.filter(run_id=kids[1], step_id="work").count() <= 1
    assert Run.objects.get(pk=parent).status == RunStatus.COMPLETED
