"""The sweep: re-wakes runs whose lease expired or whose message was lost, settles cancellations, runs waits,
and starts the due slots of schedules (engine/schedules.py), first syncing the schedules declared in code into their
rows (engine/declared.py); it admits runs queued on a concurrency key whose
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

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import DateTimeField, DurationField, ExpressionWrapper, F, OuterRef, Q, QuerySet, Subquery, Value
from django.db.models.lookups import LessThanOrEqual

from durable_agents import clock, tracing
from durable_agents.conf import settings
from durable_agents.engine.admission import admit_waiting
from durable_agents.engine.declared import sync_declared_schedules
from durable_agents.engine.family import sweep_children
from durable_agents.engine.heartbeats import prune_heartbeats, record_sweep
from durable_agents.engine.outbox import enqueue_due as enqueue_due_notifications
from durable_agents.engine.records import locked
from durable_agents.engine.runs import settle_cancellation
from durable_agents.engine.schedules import start_due_schedules
from durable_agents.engine.waits import sweep_waits
from durable_agents.engine.wake import MODEL_BOUND_KINDS, batch_waker_path, wake_on_commit
from durable_agents.models import ACTIVE_RUN_STATUSES, QUEUED, RUNNABLE_RUN_STATUSES, Event, Run, Step


def _runs_per_message() -> int:
    """How many runs one wake-up message of the default queue may carry: WAKE_BATCH_SIZE when wake-ups are batched."""
    return int(settings.WAKE_BATCH_SIZE) if batch_waker_path() else 1


def _not_recently_swept(now: datetime, idle: timedelta) -> Q:
    """Not re-woken by a sweep within `idle` — and, if the last re-wake brought no progress, not since then for as
    long as the run had been stalled when re-woken (capped at RESWEEP_BACKOFF_MAX_SECONDS): a run no worker takes
    (its queue is saturated, or nobody consumes it) gets a wake-up after idle, 2 idle, 4 idle, ... — a handful
    over ten minutes, not one per sweep period on top of the messages already queued for it."""
    cap = max(timedelta(seconds=float(settings.RESWEEP_BACKOFF_MAX_SECONDS)), idle)
    progressed_since = Q(swept_at__lt=F("updated_at"))
    stalled_when_swept = ExpressionWrapper(F("swept_at") - F("updated_at"), output_field=DurationField())
    since_swept = ExpressionWrapper(
        Value(now, output_field=DateTimeField()) - F("swept_at"), output_field=DurationField()
    )
    backed_off = Q(LessThanOrEqual(stalled_when_swept, since_swept)) | Q(swept_at__lt=now - cap)
    return Q(swept_at__isnull=True) | (Q(swept_at__lt=now - idle) & (progressed_since | backed_off))


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


def _by_queue(runs: QuerySet[Run]) -> list[tuple[str | None, QuerySet[Run]]]:
    """`runs` split by the queue their wake-up goes to (wake.queue_for): REPLAY_QUEUE (if set) for replay runs,
    MODEL_QUEUE for those whose next step waits on the model, None (the default queue) for the rest; one group
    without a MODEL_QUEUE."""
    replay_queue = settings.REPLAY_QUEUE
    if replay_queue:
        return [(replay_queue, runs.exclude(replay_lane="")), *_by_queue_of_real(runs.filter(replay_lane=""))]
    return _by_queue_of_real(runs)


def _by_queue_of_real(runs: QuerySet[Run]) -> list[tuple[str | None, QuerySet[Run]]]:
    model_queue = settings.MODEL_QUEUE
    if not model_queue:
        return [(None, runs)]
    next_kind = Step.objects.live().filter(run_id=OuterRef("pk"), position=OuterRef("cursor")).values("kind")[:1]
    runs = runs.alias(next_kind=Subquery(next_kind))
    model_bound = Q(next_kind__in=MODEL_BOUND_KINDS)
    # A run with no step under its cursor (an empty plan) has no next kind: NULL, which NOT IN would leave out.
    return [(model_queue, runs.filter(model_bound)), (None, runs.filter(~model_bound | Q(next_kind__isnull=True)))]


def sweep(*, backlog: Mapping[str | None, int] | None = None, queued: Mapping[str, int] | None = None) -> SweepReport:
    """One pass: wake lost runs, finish cancellations nobody is left to finish, run due waits, queue notices.

    `backlog`: the messages waiting on each of the broker's run queues, keyed None for the default queue
    (broker.backlog(); None: unknown). Of the runs whose message may just be waiting on their queue (no progress for
    IDLE_RESWEEP_SECONDS), only those beyond its depth are re-woken, the oldest first: a queue is served in order, so
    nothing that waits is lost — once the queue drains below them they are re-woken, and at the latest after
    RESWEEP_BACKOFF_MAX_SECONDS. Runs whose holder died (lease expired) are re-woken all the same.

    `queued`: the same measurement by queue name (broker.queue_depths()), recorded on the sweep's heartbeat row as
    measured when the pass began, for the console (None: unknown).

    Traced as a span `durable_agents.sweep` with what the pass did (`durable_agents.sweep.<count>`)."""
    with tracing.span("durable_agents.sweep") as traced:
        report = _sweep(backlog, queued)
        traced.set({f"durable_agents.sweep.{name}": count for name, count in report.as_dict().items()})
        return report


def _sweep(backlog: Mapping[str | None, int] | None, queued: Mapping[str, int] | None) -> SweepReport:
    now = clock.now()
    idle = timedelta(seconds=float(settings.IDLE_RESWEEP_SECONDS))
    lease_free = Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now)
    due = Q(wake_at__isnull=True) | Q(wake_at__lte=now)
    # Not re-woken again too soon (_not_recently_swept) — unless the run was parked since with a wake time that has now
    # come (swept before its wake_at): a run parked beyond MAX_COUNTDOWN_SECONDS has no message, and the sweep is its
    # only wake-up.
    parked_since_swept = Q(swept_at__lt=F("wake_at"))
    runnable = Run.objects.filter(
        lease_free,
        due,
        _not_recently_swept(now, idle) | parked_since_swept,
        status__in=RUNNABLE_RUN_STATUSES,
        cancel_requested_at__isnull=True,
    ).exclude(QUEUED)
    batch = int(settings.SWEEP_BATCH)
    cap = max(timedelta(seconds=float(settings.RESWEEP_BACKOFF_MAX_SECONDS)), idle)
    # Re-woken whatever the backlog: a dead worker's lease expired; a retry's wake time has come (parked, it has no
    # message); or the run's last wake-up (its last progress, the sweep's last re-wake) is older than the backoff's
    # cap — under a backlog that never drains, a lost message is still found within it. Perhaps lost: no progress
    # for `idle` — or its message still waits behind a backlog.
    overdue = Q(updated_at__lt=now - cap) & (Q(swept_at__isnull=True) | Q(swept_at__lt=now - cap))
    certain = Q(lease_expires_at__lt=now) | Q(wake_at__isnull=False) | overdue
    certain_lost = runnable.filter(certain)
    perhaps_lost = runnable.filter(updated_at__lt=now - idle).exclude(certain)
    with transaction.atomic():
        rows = list(locked(certain_lost.order_by("updated_at")).values_list("id", "lease_owner")[:batch])
        for queue, runs in _by_queue(perhaps_lost):
            # As many of them as the messages queued on their queue could be wake-ups for may just be waiting their
            # turn: re-wake only the rest, the oldest first (a queue is served in order: theirs were sent longest
            # ago). A default-queue message may wake WAKE_BATCH_SIZE runs at once (wake.wake_many). Counted past
            # that only as far as a batch, so a deep queue costs a bounded count.
            depth = (backlog or {}).get(queue, 0) * (_runs_per_message() if queue is None else 1)
            room = batch - len(rows) if not depth else max(0, runs[: depth + batch].count() - depth)
            room = min(room, batch - len(rows))
            if room:
                rows += locked(runs.order_by("updated_at")).values_list("id", "lease_owner")[:room]
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
    # Synced first, so a declaration deployed a moment ago is timed, and a removed one starts nothing more.
    sync_declared_schedules(now)
    scheduled = start_due_schedules(now)
    prune_heartbeats(now)
    # Last, so the row says when a pass last completed: a sweep that fails every time shows as late.
    record_sweep(queued, measured_at=now)
    return SweepReport(
        woken=len(ids),
        cancelled=cancelled,
        notifications=notifications,
        scheduled=scheduled,
        admitted=admitted,
        **waits,
        **family,
    )
