"""Driving runs and notifications in-process, without a broker or worker: for unit tests of workflows."""

from __future__ import annotations

import time
import uuid
from typing import Any

from durable_agents import clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.lease import Claim
from durable_agents.engine.outbox import Delivery, deliver
from durable_agents.engine.transitions import claim_run
from durable_agents.models import Effect, EffectKind, EffectStatus, Run


def drive(run_id: uuid.UUID | str, *, max_advances: int = 10_000) -> Run:
    """Advance a run in this process until it stops being runnable; waits out retry backoffs.

    Example::

        run = api.start("noop", {"steps": 3})
        assert drive(run.id).status == "completed"
    """
    outcomes: list[Outcome] = []
    for _ in range(max_advances):
        run: Any = Run.objects.get(pk=run_id)
        if run.status not in ("pending", "running"):
            return run
        wait = (run.wake_at - clock.now()).total_seconds() if run.wake_at is not None else 0
        if wait > 0:
            time.sleep(wait)
        outcomes.append(advance(run_id))
        if outcomes[-1] is Outcome.SKIPPED and len(outcomes) > 1 and outcomes[-2] is Outcome.SKIPPED:
            raise AssertionError(f"run {run_id} is not claimable (lease held elsewhere?): {run.lease_owner}")
    raise AssertionError(f"run {run_id} did not finish within {max_advances} advances")


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
