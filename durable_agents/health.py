"""System health: is the sweep running, which workers are alive, are runs stuck, and if so the likely cause.

One computation for the three places that show it: `durable_status`, the metrics (durable_sweep_lag_seconds,
durable_live_workers, durable_worker_slots_busy...) and the console's overview. It reads the ProcessHeartbeat rows (a
tiny table, written by engine/heartbeats.py) and counts stuck runs; times are compared on the database's clock.

Under load: the backlog is the broker's queue depths and the oldest runnable run's wait. `durable_status` and the
metrics ask the broker; the console never does (a slow broker must not hold its page) and reads what the sweep
measured at its last pass, from the sweep's row — unknown when the sweep could not ask or measured too long ago, never
0. Each worker's row says how busy it is (slots busy of its concurrency, tasks waiting for a pooled connection).

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

from django.db.models import Count, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce, Greatest

from durable_agents import clock
from durable_agents.broker import queue_depths
from durable_agents.conf import settings
from durable_agents.display import coarse_duration
from durable_agents.models import QUEUED, RUNNABLE_RUN_STATUSES, ProcessHeartbeat, Run, RunStatus

# Stuck runs are counted up to this many: a verdict needs no exact figure past it, and the count stays cheap.
STUCK_COUNT_CAP = 10_000


@dataclass(frozen=True)
class WorkerLoad:
    """How busy a worker was at its last beat: tasks executing of its concurrency, and its database pool (None: no
    pool in the worker's main process, e.g. prefork, or none opened yet)."""

    slots_busy: int | None
    slots: int | None
    pool_size: int | None = None
    pool_max: int | None = None
    pool_waiting: int | None = None
    pool_errors: int | None = None

    @classmethod
    def from_row(cls, load: dict[str, Any] | None) -> WorkerLoad | None:
        """None for a row with nothing measured (a worker of the previous release): unknown, not idle."""
        if not load or load.get("slots") is None:
            return None
        pool = load.get("pool") or {}
        return cls(
            load.get("slots_busy"),
            load.get("slots"),
            pool.get("size"),
            pool.get("max"),
            pool.get("waiting"),
            pool.get("errors"),
        )

    @property
    def is_saturated(self) -> bool:
        """Every slot busy, or tasks waiting for a database connection."""
        full = bool(self.slots) and (self.slots_busy or 0) >= (self.slots or 0)
        return full or bool(self.pool_waiting)

    @property
    def text(self) -> str:
        """E.g. "8 of 8 slots busy, 40 tasks waiting for a database connection (pool of 8)"."""
        busy = f"{self.slots_busy or 0:,} of {self.slots or 0:,} slots busy"
        if self.pool_max is None:
            return busy
        tasks = "task" if self.pool_waiting == 1 else "tasks"
        return f"{busy}, {self.pool_waiting or 0:,} {tasks} waiting for a database connection (pool of {self.pool_max})"

    def as_dict(self) -> dict[str, Any]:
        pool = None
        if self.pool_max is not None:
            pool = {
                "size": self.pool_size,
                "max": self.pool_max,
                "waiting": self.pool_waiting,
                "errors": self.pool_errors,
            }
        return {"slots_busy": self.slots_busy, "slots": self.slots, "pool": pool}


@dataclass(frozen=True)
class WorkerSeen:
    """A worker's row: who, what it consumes, how long ago it was last heard from, and how busy it was then."""

    hostname: str
    pid: int | None
    queues: tuple[str, ...]
    started_at: datetime
    last_seen: datetime
    seconds_ago: float
    load: WorkerLoad | None = None

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
            "load": None if self.load is None else self.load.as_dict(),
        }


@dataclass(frozen=True)
class Measured:
    """What the sweep measured of the broker's queues at its last pass, and at the pass before (None: not asked, or
    no answer)."""

    queued: dict[str, int] | None
    measured_at: datetime | None
    previous: dict[str, int] | None

    @classmethod
    def from_row(cls, load: dict[str, Any] | None) -> Measured | None:
        if not load or "measured_at" not in load:
            return None
        at = load.get("measured_at")
        previous = (load.get("previous") or {}).get("queued")
        return cls(load.get("queued"), datetime.fromisoformat(at) if at else None, previous)


@dataclass(frozen=True)
class Presence:
    """What the heartbeat rows say: when the sweep last completed and which workers are alive."""

    now: datetime
    last_sweep: datetime | None
    live_workers: tuple[WorkerSeen, ...]
    # The latest a worker was heard from, live or gone: "no worker has been seen for 2 min".
    last_worker_seen: datetime | None
    # The sweep's last measurement of the queues (None: none recorded).
    measured: Measured | None = None
    # When the oldest runnable run began waiting (None: none waits), read in the same statement; unknown (False)
    # when the heartbeat table had no row to read it with.
    oldest_runnable_since: datetime | None = None
    oldest_runnable_read: bool = False

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
    """How far the workers are behind: the wake-ups waiting on each run queue (None: unknown, `unknown_why` says
    why), and how long the oldest run a worker could take now has waited for one (None: none waits; unknown if not
    `oldest_known`). `measured_seconds_ago`: the depths are the sweep's, measured that long ago (None: the broker was
    asked just now). `growing`: (queue, depth, depth a pass before) of each queue the sweep found deeper at its last
    pass than at the one before, deepest first."""

    queued: dict[str, int] | None
    oldest_runnable_seconds: float | None
    measured_seconds_ago: float | None = None
    growing: tuple[tuple[str, int, int], ...] = ()
    unknown_why: str = "the broker did not answer"
    oldest_known: bool = True

    @property
    def behind(self) -> bool:
        return (self.oldest_runnable_seconds or 0.0) > float(settings.BEHIND_AFTER_SECONDS)

    @property
    def queued_text(self) -> str:
        """E.g. "queued wake-ups, as of the sweep's last pass 4 s ago: model 4,549 (up from 3,100), celery 0", or
        "queued wake-ups: unknown (the broker did not answer)"."""
        if self.queued is None:
            return f"queued wake-ups: unknown ({self.unknown_why})"
        up = {q: before for q, _, before in self.growing}
        depths = ", ".join(
            f"{q} {n:,}" + (f" (up from {up[q]:,})" if q in up else "")
            for q, n in sorted(self.queued.items(), key=lambda kv: -kv[1])
        )
        if self.measured_seconds_ago is None:
            return f"queued wake-ups: {depths or 'none'}"
        return f"queued wake-ups, as of the sweep's last pass {ago(self.measured_seconds_ago)} ago: {depths or 'none'}"

    @property
    def oldest_text(self) -> str:
        """E.g. "oldest runnable run waiting: 6 min"."""
        if not self.oldest_known:
            return "oldest runnable run waiting: unknown"
        oldest = self.oldest_runnable_seconds
        return f"oldest runnable run waiting: {'none' if oldest is None else ago(oldest)}"

    def as_dict(self) -> dict[str, Any]:
        oldest = self.oldest_runnable_seconds
        measured = self.measured_seconds_ago
        return {
            "queued": self.queued,
            "oldest_runnable_seconds": None if oldest is None else round(oldest, 1),
            "measured_seconds_ago": None if measured is None else round(measured, 1),
            "growing": [{"queue": q, "queued": n, "a_pass_before": before} for q, n, before in self.growing],
            "unknown_why": None if self.queued is not None else self.unknown_why,
        }


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
    """One query of the heartbeat table (a row for the sweep, one per worker seen lately), which also reads when the
    oldest runnable run began waiting (an uncorrelated subquery: one index probe, evaluated once)."""
    now = clock.now() if now is None else now
    gone_after = timedelta(seconds=float(settings.WORKER_GONE_AFTER_SECONDS))
    last_sweep = None
    measured = None
    workers: list[WorkerSeen] = []
    last_worker_seen = None
    oldest: datetime | None = None
    read = False
    rows = ProcessHeartbeat.objects.annotate(oldest_runnable=Subquery(_waiting_since(now).values("since")[:1]))
    for row in rows:
        oldest, read = row.oldest_runnable, True
        if row.kind == ProcessHeartbeat.Kind.SWEEP:
            last_sweep, measured = row.last_seen, Measured.from_row(row.load)
            continue
        last_worker_seen = max(last_worker_seen or row.last_seen, row.last_seen)
        if row.last_seen >= now - gone_after:
            seen = max(0.0, (now - row.last_seen).total_seconds())
            load = WorkerLoad.from_row(row.load)
            workers.append(
                WorkerSeen(row.hostname, row.pid, tuple(row.queues), row.started_at, row.last_seen, seen, load)
            )
    workers.sort(key=lambda w: (w.hostname, w.pid or 0))
    return Presence(now, last_sweep, tuple(workers), last_worker_seen, measured, oldest, read)


def system_health(
    *, count_by_status: bool = True, stuck: int | None = None, ask_broker: bool = True, now: datetime | None = None
) -> Health:
    """Presence, stuck runs, the backlog and the verdict. `count_by_status=False` skips counting every run by
    status, and `stuck` is the number of stuck runs when the caller counted them already (the console's overview).
    With `ask_broker` the broker is asked for its queues' depths (at most broker.ANSWER_WITHIN_SECONDS); without it
    (the console) they are the sweep's last measurement, and no query is added to the heartbeat table's. `now`: the
    database's time, when the caller read it already."""
    presence = read_presence(now)
    if stuck is None:
        stuck_after = timedelta(seconds=float(settings.STUCK_AFTER_SECONDS))
        stuck = (
            Run.objects.stuck(now=presence.now, stuck_after=stuck_after)
            .filter(replay_lane="")[:STUCK_COUNT_CAP]
            .count()
        )
    by_status = None
    if count_by_status:
        # Replay runs (replays.py) are not the system's work: they never count in its health.
        counted = dict(Run.objects.filter(replay_lane="").values_list("status").annotate(n=Count("*")).order_by())
        by_status = {status: counted.get(status, 0) for status in RunStatus.values}
    behind = read_backlog(presence.now, presence, ask_broker=ask_broker)
    return Health(presence, stuck, by_status, _problems(presence, stuck, behind), behind)


def read_backlog(now: datetime, presence: Presence | None = None, *, ask_broker: bool = True) -> Backlog:
    """The queue depths (the broker's now, or the sweep's last measurement) and the age of the oldest run waiting for
    a worker: runnable, due, held by no live lease, not queued behind its concurrency key — read with `presence`, or
    here (one indexed query) when it has not been; without `ask_broker` it is unknown then, not looked up."""
    if presence is not None and presence.oldest_runnable_read:
        oldest, known = presence.oldest_runnable_since, True
    elif ask_broker:
        oldest, known = _waiting_since(now).values_list("since", flat=True).first(), True
    else:
        oldest, known = None, False
    age = None if oldest is None else max(0.0, (now - oldest).total_seconds())
    measured = presence.measured if presence is not None else None
    fresh = measured is not None and measured.measured_at is not None and measured.queued is not None
    measured_ago = max(0.0, (now - measured.measured_at).total_seconds()) if fresh else None
    if measured_ago is not None and measured_ago > float(settings.SWEEP_LATE_AFTER_SECONDS):
        fresh = False
    growing = _growth(measured.queued, measured.previous) if fresh else ()
    if ask_broker:
        return Backlog(queue_depths(), age, growing=growing, oldest_known=known)
    if measured is None or measured.measured_at is None:
        return Backlog(None, age, unknown_why="the sweep has not measured it yet", oldest_known=known)
    if measured.queued is None:
        return Backlog(None, age, unknown_why="the broker did not answer the sweep", oldest_known=known)
    if not fresh:
        why = f"the sweep's last measurement is {ago(measured_ago or 0.0)} old"
        return Backlog(None, age, unknown_why=why, oldest_known=known)
    return Backlog(measured.queued, age, measured_ago, growing, oldest_known=known)


def _growth(queued: dict[str, int] | None, before: dict[str, int] | None) -> tuple[tuple[str, int, int], ...]:
    if not queued or not before:
        return ()
    grew = [(q, n, before[q]) for q, n in queued.items() if q in before and n > before[q]]
    return tuple(sorted(grew, key=lambda g: -g[1]))


def _waiting_since(now: datetime) -> QuerySet[Run]:
    """The runs a worker could take now, by when each began waiting (`since`), the longest-waiting first."""
    waiting = (
        Run.objects.filter(status__in=RUNNABLE_RUN_STATUSES, cancel_requested_at__isnull=True, replay_lane="")
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lt=now))
        .filter(Q(wake_at__isnull=True) | Q(wake_at__lte=now))
        .exclude(QUEUED)
    )
    # Waiting since it became runnable: its last change, or the time its retry became due, whichever is later.
    since = Greatest("updated_at", Coalesce("wake_at", "updated_at"))
    return waiting.annotate(since=since).order_by("since")


def _problems(presence: Presence, stuck: int, backlog: Backlog | None = None) -> tuple[str, ...]:
    """The likely causes, most likely first. Workers run the sweep's task too: with none alive, a late sweep is
    a consequence, not a second cause. Under overload a saturated worker comes first, then how fast the backlog
    grows, then how long runs wait."""
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
        behind = _behind(backlog, runs) + ("; the sweep is late too (its task waits in the queue)" if late else "")
        return (*_saturated(presence.live_workers), *_growing(backlog), behind)
    if lag is None:
        return (f"the sweep has never run — is celery beat up, with durable_agents.sweep scheduled?{runs}",)
    if lag > float(settings.SWEEP_LATE_AFTER_SECONDS):
        return (f"the sweep has not run for {ago(lag)} — is celery beat up?{runs}",)
    if backlog is not None and backlog.behind:
        return (*_saturated(presence.live_workers), *_growing(backlog), _behind(backlog, runs))
    # Tasks waiting for a database connection are overload even before a run waits long: the pool is too small.
    starved = _saturated(presence.live_workers, waiting_for_the_pool=True)
    if starved:
        return starved
    if stuck:
        return (
            f"{_runs(stuck)} stuck while the sweep and workers are alive — see "
            "`durable_runs --stuck`: does a worker consume each run's queue, does a step never finish?",
        )
    return ()


def _saturated(workers: tuple[WorkerSeen, ...], *, waiting_for_the_pool: bool = False) -> tuple[str, ...]:
    """For each saturated worker (`waiting_for_the_pool`: only those whose tasks wait for a connection), e.g. "the
    worker celery@m-1 (model) is saturated: 8 of 8 slots busy, 40 tasks waiting for a database connection (pool of
    8) — add workers or concurrency for its queue, or a bigger database pool"."""
    return tuple(
        f"the worker {w.hostname} ({', '.join(w.queues) or '-'}) is saturated: {w.load.text} — add workers or "
        "concurrency for its queue" + (", or a bigger database pool" if w.load.pool_waiting else "")
        for w in workers
        if w.load is not None and w.load.is_saturated and (w.load.pool_waiting or not waiting_for_the_pool)
    )


def _growing(backlog: Backlog) -> tuple[str, ...]:
    """E.g. "backlog growing: 4,549 wake-ups on 'model', up from 3,100 a pass ago"."""
    return tuple(
        f"backlog growing: {now:,} wake-ups on {queue!r}, up from {before:,} a pass ago"
        for queue, now, before in backlog.growing
    )


def _behind(backlog: Backlog, runs: str) -> str:
    """Workers alive, the sweep on time, and runs waiting longer than BEHIND_AFTER_SECONDS for a worker: overload."""
    waited = ago(backlog.oldest_runnable_seconds or 0.0)
    queued = backlog.queued or {}
    deep = [f"{n:,} messages queued on {queue!r}" for queue, n in sorted(queued.items(), key=lambda kv: -kv[1]) if n]
    where = f" ({', '.join(deep)})" if deep else ""
    if backlog.queued is None:
        where = f" (queue depths unknown: {backlog.unknown_why})"
    elif not deep:
        # No message waits, yet a run does: no worker is too slow; its wake-ups are taken and not acted on, or lost.
        return (
            f"runs are not picked up: a runnable run has waited {waited}, and no wake-up waits on the broker — the "
            "sweep re-sends them each pass: see `durable_runs --stuck` and the run's events (a worker that takes "
            f"a wake-up and runs nothing logs why){runs}"
        )
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
    """A duration as on-call reads it: "4 s", "9 min", "3 h", "2 d" (the console's one style for ages)."""
    return coarse_duration(seconds)
