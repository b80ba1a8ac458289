"""System health: is the sweep running, which workers are alive, are runs stuck, and if so the likely cause.

One computation for the three places that show it: `durable_status`, the metrics (durable_sweep_lag_seconds,
durable_live_workers) and the console's overview. It reads the ProcessHeartbeat rows (a tiny table, written
by engine/heartbeats.py) and counts stuck runs; times are compared on the database's clock.

Example::

    from durable_agents.health import system_health

    health = system_health()
    health.ok        # False
    health.verdict   # "the sweep has not run for 9 min — is celery beat up? (3 runs stuck)"
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Q
from django.db.models.functions import Coalesce, Greatest

from durable_agents import clock
from durable_agents.broker import queue_depths
from durable_agents.conf import settings
from durable_agents.models import QUEUED, RUNNABLE_RUN_STATUSES, ProcessHeartbeat, Run, RunStatus

# Stuck runs are counted up to this many: a verdict needs no exact figure past it, and the count stays cheap.
STUCK_COUNT_CAP = 10_000


@dataclass(frozen=True)
class WorkerSeen:
    """A worker's row: who, what it consumes, and how long ago it was last heard from."""

    hostname: str
    pid: int | None
    queues: tuple[str, ...]
    started_at: datetime
    last_seen: datetime
    seconds_ago: float

    @property
    def seen_ago(self) -> str:
        return ago(self.seconds_ago)

    def as_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "pid": self.pid,
            "queues": list(self.queues),
            "started_at": self.started_at.isoformat(),
            "last_seen": self.last_seen.isoformat(),
            "seconds_ago": round(self.seconds_ago, 1),
        }


@dataclass(frozen=True)
class Presence:
    """What the heartbeat rows say: when the sweep last completed and which workers are alive."""

    now: datetime
    last_sweep: datetime | None
    live_workers: tuple[WorkerSeen, ...]
    # The latest a worker was heard from, live or gone: "no worker has been seen for 2 min".
    last_worker_seen: datetime | None

    @property
    def sweep_lag(self) -> float | None:
        """Seconds since the sweep last completed a pass; None if it never has."""
        return None if self.last_sweep is None else max(0.0, (self.now - self.last_sweep).total_seconds())

    @property
    def sweep_ago(self) -> str:
        """E.g. "4 s ago", or "never"."""
        return "never" if self.sweep_lag is None else f"{ago(self.sweep_lag)} ago"


@dataclass(frozen=True)
class Backlog:
    """How far the workers are behind: the wake-ups waiting on each run queue (None: the broker could not be
    asked), and how long the oldest run a worker could take now has waited for one (None: none waits)."""

    queued: dict[str, int] | None
    oldest_runnable_seconds: float | None

    @property
    def behind(self) -> bool:
        return (self.oldest_runnable_seconds or 0.0) > float(settings.BEHIND_AFTER_SECONDS)

    def as_dict(self) -> dict[str, Any]:
        oldest = self.oldest_runnable_seconds
        return {"queued": self.queued, "oldest_runnable_seconds": None if oldest is None else round(oldest, 1)}


@dataclass(frozen=True)
class Health:
    """Presence, the runs, and the verdict: `problems` names each likely cause with its next action."""

    presence: Presence
    stuck: int
    by_status: dict[str, int] | None
    problems: tuple[str, ...]
    backlog: Backlog | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        """One line: OK and why, or the likely causes and what to check."""
        if self.problems:
            return "; ".join(self.problems)
        p = self.presence
        workers = f"{len(p.live_workers)} worker{'' if len(p.live_workers) == 1 else 's'} alive"
        return f"OK: the sweep ran {ago(p.sweep_lag or 0.0)} ago, {workers}, no stuck runs"

    def as_dict(self) -> dict[str, Any]:
        p = self.presence
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "now": p.now.isoformat(),
            "last_sweep": p.last_sweep.isoformat() if p.last_sweep else None,
            "sweep_lag_seconds": None if p.sweep_lag is None else round(p.sweep_lag, 1),
            "live_workers": [w.as_dict() for w in p.live_workers],
            "last_worker_seen": p.last_worker_seen.isoformat() if p.last_worker_seen else None,
            "stuck": self.stuck,
            "runs_by_status": self.by_status,
            "backlog": None if self.backlog is None else self.backlog.as_dict(),
        }


def read_presence(now: datetime | None = None) -> Presence:
    """One query of the heartbeat table (a row for the sweep, one per worker seen lately)."""
    now = clock.now() if now is None else now
    gone_after = timedelta(seconds=float(settings.WORKER_GONE_AFTER_SECONDS))
    last_sweep = None
    workers: list[WorkerSeen] = []
    last_worker_seen = None
    for row in ProcessHeartbeat.objects.all():
        if row.kind == ProcessHeartbeat.Kind.SWEEP:
            last_sweep = row.last_seen
            continue
        last_worker_seen = max(last_worker_seen or row.last_seen, row.last_seen)
        if row.last_seen >= now - gone_after:
            seen = max(0.0, (now - row.last_seen).total_seconds())
            workers.append(WorkerSeen(row.hostname, row.pid, tuple(row.queues), row.started_at, row.last_seen, seen))
    workers.sort(key=lambda w: (w.hostname, w.pid or 0))
    return Presence(now, last_sweep, tuple(workers), last_worker_seen)


def system_health(*, count_by_status: bool = True, stuck: int | None = None, backlog: bool = True) -> Health:
    """Presence, stuck runs, the backlog and the verdict. `count_by_status=False` skips counting every run by
    status, and `stuck` is the number of stuck runs when the caller counted them already (the console's overview).
    With `backlog` the broker is asked for its queues' depths (at most broker.ANSWER_WITHIN_SECONDS) and the oldest
    runnable run is looked up (one query)."""
    presence = read_presence()
    if stuck is None:
        stuck_after = timedelta(seconds=float(settings.STUCK_AFTER_SECONDS))
        stuck = Run.objects.stuck(now=presence.now, stuck_after=stuck_after)[:STUCK_COUNT_CAP].count()
    by_status = None
    if count_by_status:
        counted = dict(Run.objects.values_list("status").annotate(n=Count("*")).order_by())
        by_status = {status: counted.get(status, 0) for status in RunStatus.values}
    behind = read_backlog(presence.now) if backlog else None
    return Health(presence, stuck, by_status, _problems(presence, stuck, behind), behind)


def read_backlog(now: datetime) -> Backlog:
    """The broker's queue depths and the age of the oldest run waiting for a worker: runnable, due, held by no
    live lease, not queued behind its concurrency key (one indexed query)."""
    waiting = (
        Run.objects.filter(status__in=RUNNABLE_RUN_STATUSES, cancel_requested_at__isnull=True)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=now))
        .exclude(QUEUED)
    )
    # Waiting since it became runnable: its last change, or the time its retry became due, whichever is later.
    since = Greatest("updated_at", Coalesce("wake_at", "updated_at"))
    oldest = waiting.annotate(since=since).order_by("since").values_list("since", flat=True).first()
    age = None if oldest is None else max(0.0, (now - oldest).total_seconds())
    return Backlog(queue_depths(), age)


def _problems(presence: Presence, stuck: int, backlog: Backlog | None = None) -> tuple[str, ...]:
    """The likely causes, most likely first. Workers run the sweep's task too: with none alive, a late sweep is
    a consequence, not a second cause."""
    runs = f" ({_runs(stuck)} stuck)" if stuck else ""
    if not presence.live_workers:
        if presence.last_worker_seen is None:
            return (f"no worker has reported in — are the workers up?{runs}",)
        silent = ago((presence.now - presence.last_worker_seen).total_seconds())
        return (f"no worker has been seen for {silent} — are the workers up?{runs}",)
    unserved = _unserved_queues(presence.live_workers)
    if unserved:
        return tuple(
            f"no live worker consumes the queue {queue!r} ({key}) — start one with `--queues {queue}`{runs}"
            for key, queue in unserved
        )
    lag = presence.sweep_lag
    if backlog is not None and backlog.behind and any((backlog.queued or {}).values()):
        # Messages wait and runs wait for them: overload. The sweep's own task may wait in the same queue, so a late
        # sweep is its consequence here, not a sign that beat is down.
        late = lag is None or lag > float(settings.SWEEP_LATE_AFTER_SECONDS)
        return (_behind(backlog, runs) + ("; the sweep is late too (its task waits in the queue)" if late else ""),)
    if lag is None:
        return (f"the sweep has never run — is celery beat up, with durable_agents.sweep scheduled?{runs}",)
    if lag > float(settings.SWEEP_LATE_AFTER_SECONDS):
        return (f"the sweep has not run for {ago(lag)} — is celery beat up?{runs}",)
    if backlog is not None and backlog.behind:
        return (_behind(backlog, runs),)
    if stuck:
        return (
            f"{_runs(stuck)} stuck while the sweep and workers are alive — see "
            "`durable_runs --stuck`: does a worker consume each run's queue, does a step never finish?",
        )
    return ()


def _behind(backlog: Backlog, runs: str) -> str:
    """Workers alive, the sweep on time, and runs waiting longer than BEHIND_AFTER_SECONDS for a worker: overload."""
    waited = ago(backlog.oldest_runnable_seconds or 0.0)
    queued = backlog.queued or {}
    deep = [f"{n:,} messages queued on {queue!r}" for queue, n in sorted(queued.items(), key=lambda kv: -kv[1]) if n]
    where = f" ({', '.join(deep)})" if deep else ""
    return (
        f"workers are behind: a runnable run has waited {waited} for a worker{where} — add workers or concurrency "
        f"for the busiest queue, or lower the load{runs}"
    )


def _unserved_queues(workers: tuple[WorkerSeen, ...]) -> list[tuple[str, str]]:
    """The configured queues (QUEUE, MODEL_QUEUE, NOTIFY_QUEUE) no live worker consumes, as (setting, queue).
    Only when every live worker said what it consumes; a queue left empty means Celery's default (not known here)."""
    if not workers or not all(w.queues for w in workers):
        return []
    consumed = {queue for w in workers for queue in w.queues}
    configured = [(key, getattr(settings, key)) for key in ("QUEUE", "MODEL_QUEUE", "NOTIFY_QUEUE")]
    return [(key, queue) for key, queue in configured if queue and queue not in consumed]


def _runs(stuck: int) -> str:
    if stuck >= STUCK_COUNT_CAP:
        return f"{STUCK_COUNT_CAP}+ runs"
    return f"{stuck} run{'' if stuck == 1 else 's'}"


def ago(seconds: float) -> str:
    """A duration as on-call reads it: "4 s", "9 min", "3 h", "2 d"."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"
