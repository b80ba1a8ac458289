"""Driving runs and notifications in-process, without a broker or worker: for unit tests of workflows."""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.db import connection

from durable_agents import clock
from durable_agents.engine.admission import admit, holders, queue_position
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.lease import Claim
from durable_agents.engine.outbox import Delivery, deliver
from durable_agents.engine.transitions import claim_run
from durable_agents.models import Effect, EffectKind, EffectStatus, Run


def drive(run_id: uuid.UUID | str, *, max_advances: int = 10_000) -> Run:
    """Advance a run in this process until it stops being runnable; waits out retry backoffs.

    Works under pytest-django's `db` (the test in one transaction that never commits) as under
    `transactional_db`: a run with a concurrency key is admitted when its start commits, which inside a test's
    transaction never happens, so drive admits it in-process through the engine's admission, as the commit
    would have. Raises AssertionError naming what is in the way when the run cannot go on: the run holding its
    key (drive that one first), or the worker holding its lease, until when. Example::

        run = api.start("noop", {"steps": 3})
        assert drive(run.id).status == "completed"
    """
    outcomes: list[Outcome] = []
    for _ in range(max_advances):
        run: Any = Run.objects.get(pk=run_id)
        if run.status not in ("pending", "running"):
            return run
        if run.is_queued and run.cancel_requested_at is None:
            _admit(run)
        wait = (run.wake_at - clock.now()).total_seconds() if run.wake_at is not None else 0
        if wait > 0:
            time.sleep(wait)
        outcomes.append(advance(run_id))
        if outcomes[-1] is Outcome.SKIPPED and len(outcomes) > 1 and outcomes[-2] is Outcome.SKIPPED:
            raise AssertionError(_not_claimable(Run.objects.get(pk=run_id)))
    raise AssertionError(f"run {run_id} did not finish within {max_advances} advances")


def _admit(run: Any) -> None:
    """Admit a queued run, or say which runs hold its key."""
    if connection.in_atomic_block:
        # The start (or the finish that freed the key) hands the key on when its transaction commits; inside a
        # test's transaction (pytest-django's `db`) that commit never comes. Do now what it would have done.
        admit(run.concurrency_key)
        run.refresh_from_db()
        if not run.is_queued:
            return
    held = holders(run.concurrency_key)
    if held:
        names = ", ".join(str(holder) for holder in held)
        raise AssertionError(
            f"run {run.id} cannot be driven: it waits for concurrency key {run.concurrency_key!r} "
            f"(limit {run.concurrency_limit}, position {queue_position(run)} in its queue), held by run(s) {names}; "
            f"drive the holder first (drive({str(held[0])!r})), cancel it, or start this run with another key"
        )
    raise AssertionError(
        f"run {run.id} cannot be driven: it waits for concurrency key {run.concurrency_key!r}, which no run holds: "
        "the hand-off that admits it has not run (it runs when the transaction that freed the key commits; the "
        "sweep admits it otherwise): commit first, or call durable_agents.engine.sweep.sweep()"
    )


def _not_claimable(run: Any) -> str:
    """Why drive cannot claim the run, and what the test can do about it."""
    now = clock.now()
    if run.lease_expires_at is not None and run.lease_expires_at > now:
        left = (run.lease_expires_at - now).total_seconds()
        return (
            f"run {run.id} cannot be driven: its lease is held by {run.lease_owner!r} until "
            f"{run.lease_expires_at.isoformat()} ({left:.0f}s from now on the engine's clock), a worker executing "
            "its step (or take_lease). Let that worker finish (wait_for_run), or lapse the lease with "
            f"durable_agents.clock.advance(timedelta(seconds={int(left) + 1})) to take the run over as the sweep "
            "would; a test sharing runs with worker processes needs @pytest.mark.django_db(transaction=True)"
        )
    return (
        f"run {run.id} cannot be driven: it is not claimable (status {run.status}, lease owner "
        f"{run.lease_owner or 'none'}, wake_at {run.wake_at}, cancel requested at {run.cancel_requested_at}); "
        "its row may be locked by another transaction"
    )


def take_lease(run_id: uuid.UUID | str) -> Claim | None:
    """Claim a run as a worker would at the start of a step, without executing it (a worker mid-step);
    None if it is not claimable. For tests of races with a lease holder."""
    claimed = claim_run(uuid.UUID(str(run_id)))
    return claimed[0] if claimed else None


def deliver_notifications() -> list[Delivery]:
    """Deliver every pending notification in this process, as `durable_agents.deliver_notification` would.

    Rows backing off are left alone (their outcome is NOT_DUE). Example::

        sweep()
        deliver_notifications()
        assert mail.outbox[-1].subject.startswith("Reminder 1")
    """
    pending = Effect.objects.filter(kind=EffectKind.NOTIFICATION, status=EffectStatus.PENDING).order_by("id")
    return [deliver(effect_id) for effect_id in pending.values_list("id", flat=True)]
