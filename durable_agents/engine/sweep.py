"""The sweep: re-wakes runs whose lease expired or whose message was lost, settles cancellations, runs waits,
and starts the due slots of schedules (engine/schedules.py); it admits runs queued on a concurrency key whose
hand-off was lost (engine/admission.py).

It also enqueues due notifications (engine/outbox.py) but never sends one: a slow receiver must not hold
the sweep, nor the worker slot it runs in.

Safe to run concurrently and repeatedly: rows are picked with SKIP LOCKED, each run is re-woken at most
once per IDLE_RESWEEP_SECONDS, and a duplicate wake-up is harmless (the claim lets one worker in). A run parked until
its wake_at (a retry's backoff longer than MAX_COUNTDOWN_SECONDS) has no message: the first pass after its wake time
wakes it, however recently an earlier pass did, and a pass after an outage wakes every due run, SWEEP_BATCH at a time.

Each completed pass records itself (engine/heartbeats.py), so `durable_status` can tell that beat is down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta

from django.db import transaction
from django.db.models import F, Q

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.admission import admit_waiting
from durable_agents.engine.family import sweep_children
from durable_agents.engine.heartbeats import prune_heartbeats, record_sweep
from durable_agents.engine.outbox import enqueue_due as enqueue_due_notifications
from durable_agents.engine.records import locked
from durable_agents.engine.runs import settle_cancellation
from durable_agents.engine.schedules import start_due_schedules
from durable_agents.engine.waits import sweep_waits
from durable_agents.engine.wake import wake_on_commit
from durable_agents.models import ACTIVE_RUN_STATUSES, QUEUED, RUNNABLE_RUN_STATUSES, Event, Run


@dataclass(frozen=True)
class SweepReport:
    """What one sweep pass did."""

    woken: int
    cancelled: int
    fired: int = 0
    expired: int = 0
    warned: int = 0
    reminded: int = 0
    notifications: int = 0  # due notifications handed to their delivery task
    scheduled: int = 0  # runs started for due schedule slots
    joined: int = 0  # parents woken whose children's wake-up was lost
    orphans_cancelled: int = 0  # live children of cancelled parents, cancelled
    family_undone: int = 0  # finished children of a compensated parent that started undoing what they did
    admitted: int = 0  # queued runs admitted on their concurrency key (a lost hand-off)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def sweep() -> SweepReport:
    """One pass: wake lost runs, finish cancellations nobody is left to finish, run due waits, queue notices."""
    now = clock.now()
    idle = timedelta(seconds=float(settings.IDLE_RESWEEP_SECONDS))
    lease_free = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    due = Q(wake_at__isnull=True) | Q(wake_at__lte=now)
    # Lost: a dead worker's lease expired, a due retry was not picked up, or no progress for `idle`.
    lost = Q(lease_expires_at__lt=now) | Q(wake_at__isnull=False) | Q(updated_at__lt=now - idle)
    # Not again within `idle` of its last sweep (a lost message's wake-up, repeated) — unless the run was parked since
    # with a wake time that has now come (swept before its wake_at): a run parked beyond MAX_COUNTDOWN_SECONDS has no
    # message, and the sweep is its only wake-up.
    not_recently_swept = Q(swept_at__isnull=True) | Q(swept_at__lt=now - idle) | Q(swept_at__lt=F("wake_at"))
    candidates = (
        Run.objects.filter(
            lease_free,
            due,
            lost,
            not_recently_swept,
            status__in=RUNNABLE_RUN_STATUSES,
            cancel_requested_at__isnull=True,
        )
        .exclude(QUEUED)
        .order_by("updated_at")
    )
    with transaction.atomic():
        rows = list(locked(candidates).values_list("id", "lease_owner")[: int(settings.SWEEP_BATCH)])
        ids = [run_id for run_id, _ in rows]
        if ids:
            Run.objects.filter(pk__in=ids).update(swept_at=now)
            Event.objects.bulk_create(
                Event(run_id=run_id, kind="swept", detail={"expired_lease_owner": owner} if owner else {})
                for run_id, owner in rows
            )
            for run_id in ids:
                wake_on_commit(run_id)

    pending_cancels = Run.objects.filter(
        lease_free, status__in=ACTIVE_RUN_STATUSES, cancel_requested_at__isnull=False
    ).values_list("id", flat=True)[: int(settings.SWEEP_BATCH)]
    cancelled = sum(bool(settle_cancellation(run_id)) for run_id in list(pending_cancels))
    # A slot freed by a run whose process died between its end and the hand-off: its key's queue moves on.
    admitted = admit_waiting(int(settings.SWEEP_BATCH))
    waits = sweep_waits(now)
    family = sweep_children(now)
    notifications = enqueue_due_notifications()
    scheduled = start_due_schedules(now)
    prune_heartbeats(now)
    # Last, so the row says when a pass last completed: a sweep that fails every time shows as late.
    record_sweep()
    return SweepReport(
        woken=len(ids),
        cancelled=cancelled,
        notifications=notifications,
        scheduled=scheduled,
        admitted=admitted,
        **waits,
        **family,
    )
