"""Attacks on the batch's cross-run claim (hotpath.commit_and_claim_next, eager.Batch, tasks.advance_many) and its
interactions with child runs, concurrency keys, cancels and retention.

The claim under attack (engine/eager.py, DESIGN.md §2): the claim a run's last commit makes for the batch's next run
is a claim like any other — a new fencing token, an attempt counted, one claim and one fenced checkpoint per step; a
LOST commit claims nothing; a step body runs again only after a death or a lost lease, and a worker paused between a
claim and the step body proves its lease before running it; effects once; no run is left without a wake-up (or the
sweep's); concurrency keys never exceeded; no duplicate child.

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
from durable_agents.models import Event, Run
from durable_agents.signals import run_finished, step_committed
from tests.testapp.models import Execution

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

    run_finished.connect(pause_after_first, dispatch_uid="attacks-batches2-pause")
    try:
        with _in_process(**LONG):
            tasks.advance_many.run([first, following])
    finally:
        run_finished.disconnect(dispatch_uid="attacks-batches2-pause")
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

    step_committed.connect(pause_after_step_one, dispatch_uid="attacks-batches2-pause-eager")
    try:
        with _in_process(**LONG):
            tasks.advance.run(run_id)
    finally:
        step_committed.disconnect(dispatch_uid="attacks-batches2-pause-eager")
    assert "token" in taker, "the receiver did not run: step 1 did not commit"
    assert not Execution.objects.filter(run_id=run_id, step_id="s002").exists(), (
        "step 2's body ran under a claim the worker had lost while paused"
    )
    assert Run.objects.get(pk=run_id).lease_token == taker["token"]
