"""The console's overview: runs by status, stuck runs, the oldest running and the oldest waiting run, and the
system's health (the sweep's lag, live workers and how busy each is, the backlog the sweep measured, the oldest
runnable run's wait, and the verdict of health.system_health), and the Message Batches in flight with the oldest.

A fixed handful of indexed queries whatever the table size: the statuses are counted in one statement (each
stopping at the exact-count limit, estimated beyond it), stuck runs once for the card and the verdict.
Each card links to the list filtered by the list's own filter parameter, so a card's link highlights the
filter in the sidebar and a later click there replaces it instead of contradicting it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from datetime import datetime
from urllib.parse import urlencode

from django.db import connections
from django.db.models import F, IntegerField, QuerySet
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce

from durable_agents import clock
from durable_agents.admin.counting import RowCount, counts_by_value, estimated_count, exact_count_limit
from durable_agents.admin.filters import STATUS_PARAMETER, StuckFilter, WaitDeadlineFilter, stuck_runs
from durable_agents.clock import DbNow
from durable_agents.engine.batches import BATCHES_IN_FLIGHT
from durable_agents.health import Health, system_health
from durable_agents.models import BatchTurn, MessageBatch, Run, RunStatus, Wait
from durable_agents.states import BatchTurnStatus

SUMMARY_FIELDS = (
    "id",
    "workflow",
    "workflow_version",
    "status",
    "created_at",
    "started_at",
    "updated_at",
    "cursor",
    "step_count",
)


@dataclass(frozen=True)
class Card:
    """A count and the run list's query string that shows what it counts."""

    label: str
    count: RowCount
    link: str


@dataclass(frozen=True)
class Batches:
    """The Message Batches in flight (the oldest first made), the turns they still process, and the turns queued for
    the next batch (the oldest first journaled)."""

    in_flight: RowCount
    oldest_at: datetime | None
    oldest_provider_id: str
    turns_processing: int
    queued: RowCount
    oldest_queued_at: datetime | None

    @property
    def any(self) -> bool:
        return bool(self.in_flight.value or self.queued.value)


@dataclass(frozen=True)
class Overview:
    by_status: list[Card]
    stuck: Card
    oldest_running: Run | None
    oldest_waiting: Run | None
    waits_past_deadline: Card
    health: Health
    # Replay runs (replays.py), left out of every card: the run list hides them by default and says how many.
    replay_runs: RowCount = RowCount(0, exact=True)
    batches: Batches | None = None


def build_overview() -> Overview:
    # Real runs: replay runs (replays.py) are not the system's work, and the run list the cards link to hides them.
    runs = Run.objects.only(*SUMMARY_FIELDS).filter(replay_lane="")
    counts = counts_by_value(Run, "status", list(RunStatus.values))
    # Subtracted, read on their own index up to the console's count limit (past it, the cards are estimates).
    limit = exact_count_limit()
    seen = list(Run.objects.exclude(replay_lane="").values_list("status", flat=True)[: limit + 1])
    replays, beyond = Counter(seen[:limit]), len(seen) > limit
    counts = {
        status: replace(count, value=max(0, count.value - replays[status]), exact=count.exact and not beyond)
        for status, count in counts.items()
    }
    stuck = estimated_count(stuck_runs(Run.objects.filter(replay_lane="")), selective=True)
    batches, now = batches_in_flight(limit)
    # One statement, two index probes. A waiting run last changed when it started waiting: the
    # (status, updated_at) index answers "waiting the longest".
    running = runs.filter(status=RunStatus.RUNNING).order_by("created_at")[:1]
    waiting = runs.filter(status=RunStatus.WAITING).order_by("updated_at")[:1]
    if connections[Run.objects.db].features.supports_slicing_ordering_in_compound:
        oldest = {run.status: run for run in running.union(waiting, all=True)}
    else:  # SQLite refuses a LIMIT inside a UNION: two statements there
        oldest = {run.status: run for run in [*running, *waiting]}
    return Overview(
        by_status=[Card(status, counts[status], _link(STATUS_PARAMETER, status)) for status in RunStatus.values],
        stuck=Card("stuck", stuck, _link(StuckFilter.parameter_name, "yes")),
        oldest_running=oldest.get(RunStatus.RUNNING),
        oldest_waiting=oldest.get(RunStatus.WAITING),
        # The open-deadline partial index answers this; a run has at most one open wait.
        waits_past_deadline=Card(
            "waits past deadline",
            estimated_count(Wait.objects.open().filter(deadline__lt=DbNow())),
            _link(WaitDeadlineFilter.parameter_name, "overdue"),
        ),
        # The cards above count runs by status and stuck runs their own way: not again here. The page never waits on
        # a slow broker: the queue depths are what the sweep measured at its last pass, and the oldest runnable run
        # is read with the heartbeat rows (no query of its own: the run list's query budget holds).
        health=system_health(count_by_status=False, stuck=stuck.value, ask_broker=False, now=now),
        replay_runs=RowCount(len(seen), exact=not beyond, at_least=beyond),
        batches=batches,
    )


def batches_in_flight(limit: int) -> tuple[Batches, datetime]:
    """The batches card and the database's time, read in one statement on Postgres (the time is read anyway, for the
    health line: the run list's query budget holds). Its subqueries each stop at `limit` + 1 rows on a partial index:
    the in-flight batches (few: the API answers within a day) and the queued turns. Not
    engine.batches.in_flight_summary: its COUNTs are not capped, and the console's never run unbounded."""
    in_flight = MessageBatch.objects.filter(status__in=BATCHES_IN_FLIGHT).order_by()
    queued = BatchTurn.objects.filter(status=BatchTurnStatus.QUEUED).order_by()
    oldest = in_flight.order_by("created_at", "id")[:1]
    # Before its first poll a batch's counts are empty: all of its requests are still processing.
    left = Coalesce(Cast(KT("counts__processing"), IntegerField()), F("request_count"), output_field=IntegerField())
    parts: list[tuple[str, QuerySet]] = [
        ("SELECT COUNT(*) FROM ({}) capped", in_flight.values("pk")[: limit + 1]),
        ("{}", oldest.values("created_at")),
        ("{}", oldest.values("provider_id")),
        ("SELECT SUM(n) FROM ({}) capped", in_flight.annotate(n=left).values("n")[: limit + 1]),
        ("SELECT COUNT(*) FROM ({}) capped", queued.values("pk")[: limit + 1]),
        ("{}", queued.order_by("created_at").values("created_at")[:1]),
    ]
    connection = connections[MessageBatch.objects.db]
    if connection.vendor == "postgresql":
        sql, params = ["STATEMENT_TIMESTAMP() + %s"], [clock.offset()]
        for shape, queryset in parts:
            inner, inner_params = queryset.query.get_compiler(connection=connection).as_sql()
            sql.append(f"({shape.format(inner)})")
            params.extend(inner_params)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {', '.join(sql)}", params)
            now, batches, oldest_at, provider_id, processing, waiting, oldest_queued_at = cursor.fetchone()
    else:  # the embedded SQLite: a statement each, its clock this process's
        now = clock.now()
        batches = in_flight.values("pk")[: limit + 1].count()
        first = oldest.values_list("created_at", "provider_id").first()
        oldest_at, provider_id = first or (None, None)
        processing = sum(in_flight.annotate(n=left).values_list("n", flat=True)[: limit + 1])
        waiting = queued.values("pk")[: limit + 1].count()
        oldest_queued_at = queued.order_by("created_at").values_list("created_at", flat=True).first()
    summary = Batches(
        in_flight=_capped(batches, limit),
        oldest_at=oldest_at,
        oldest_provider_id=provider_id or "",
        turns_processing=int(processing or 0),
        queued=_capped(waiting, limit),
        oldest_queued_at=oldest_queued_at,
    )
    return summary, now


def _capped(read: int, limit: int) -> RowCount:
    """Rows read up to `limit` + 1: exact, or "more than `limit`"."""
    return RowCount(read, exact=read <= limit, at_least=read > limit)


def _link(parameter: str, value: str) -> str:
    return "?" + urlencode({parameter: value})
