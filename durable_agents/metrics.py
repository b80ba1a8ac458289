"""Prometheus metrics, computed from the database at scrape time: runs by status, stuck runs, the oldest
running and waiting runs, step latency and retries — per workflow; the sweep's lag, the live workers and how busy
each is (durable_worker_slots_busy, durable_worker_slots, durable_worker_pool_waiting, labelled by worker hostname).

Postgres is the source of truth and workers are many short-lived processes, so nothing is counted in
process memory: a custom collector runs a handful of aggregate queries when Prometheus scrapes. Step
latency and retries cover steps finished in the last DURABLE_AGENTS['METRICS_WINDOW_SECONDS'] and are
read through the recently progressed runs only (the (status, updated_at) index), never the whole history.

Serving: `project/urls.py` routes `/metrics` to `metrics_view`. Access is granted to

* a request with `Authorization: Bearer <DURABLE_AGENTS['METRICS_TOKEN']>` (for Prometheus), and
* a logged-in active staff user (for a human with a browser).

Anything else gets 401 (anonymous) or 403 (logged in, not staff). Without a token set, only staff can read.

Example scrape config::

    - job_name: durable_agents
      metrics_path: /metrics
      authorization: {type: Bearer, credentials: "<METRICS_TOKEN>"}
      static_configs: [{targets: ["web:8000"]}]
"""

from __future__ import annotations

import hmac
import math
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.db.models import Count, DurationField, ExpressionWrapper, F, Min
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

try:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.exposition import choose_encoder
    from prometheus_client.registry import Collector
except ImportError as missing:  # an optional extra: say which
    raise ImproperlyConfigured(
        'durable_agents.metrics needs prometheus_client: pip install "durable-agents[metrics]"'
    ) from missing

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.batches import in_flight_summary
from durable_agents.health import Presence, read_backlog, read_presence
from durable_agents.models import Event, Run, RunStatus, Step
from durable_agents.workflows import registry

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Figures:
    """What one scrape read from the database."""

    by_status: dict[tuple[str, str], int]
    stuck: dict[str, int]
    oldest_waiting: dict[str, float]
    oldest_running: dict[str, float]
    latency: dict[str, tuple[int, tuple[float, ...]]]
    retries: dict[str, int]


def read_figures(now: datetime, since: datetime) -> Figures:
    """Six aggregate queries, each served by an index; none reads the whole history of any run."""
    with transaction.atomic():
        if connection.vendor == "postgresql":
            # JIT compilation costs ~100 ms on these plans and never pays off for short aggregates.
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL jit = off")
        stuck_after = timedelta(seconds=float(settings.STUCK_AFTER_SECONDS))
        # COUNT(*), not COUNT(id): the (workflow, status) index alone answers it (an index-only scan).
        by_status = Run.objects.values("workflow", "status").annotate(n=Count("*")).order_by()
        # Replay runs are not the system's work: subtracted, from their own (small) index.
        replays = Run.objects.exclude(replay_lane="").values("workflow", "status").annotate(n=Count("*")).order_by()
        stuck = (
            Run.objects.stuck(now=now, stuck_after=stuck_after)
            .filter(replay_lane="")
            .values("workflow")
            .annotate(n=Count("*"))
        )
        retries = (
            Event.objects.filter(
                kind="step_retry", created_at__gte=since, run__replay_lane="", **_recent_runs("run__", since)
            )
            .values("run__workflow")
            .annotate(n=Count("*"))
            .order_by()
            .values_list("run__workflow", "n")
        )
        counts = Counter({(row["workflow"], row["status"]): row["n"] for row in by_status})
        counts.subtract({(row["workflow"], row["status"]): row["n"] for row in replays})
        return Figures(
            by_status={key: n for key, n in counts.items() if n > 0},
            stuck=dict(stuck.order_by().values_list("workflow", "n")),
            oldest_waiting=_oldest(RunStatus.WAITING, "updated_at", now),
            oldest_running=_oldest(RunStatus.RUNNING, "created_at", now),
            latency=_step_latency(since),
            retries=dict(retries),
        )


class DatabaseCollector(Collector):
    """Gauges read from the database on every scrape (a few aggregate queries, none per run)."""

    def describe(self) -> list[Metric]:
        return []  # registering must not touch the database (it may not be migrated yet)

    def collect(self) -> Iterator[Metric]:
        began = time.perf_counter()
        now = clock.now()
        since = now - timedelta(seconds=float(settings.METRICS_WINDOW_SECONDS))
        figures = read_figures(now, since)
        workflows = sorted({w for w, _ in figures.by_status} | set(registry.names()))

        runs = GaugeMetricFamily("durable_runs", "Runs by workflow and status.", labels=["workflow", "status"])
        for workflow in workflows:
            for status in RunStatus.values:
                runs.add_metric([workflow, status], figures.by_status.get((workflow, status), 0))
        yield runs
        yield _per_workflow(
            "durable_runs_stuck",
            "Runs running with an expired lease, or runnable with no progress for STUCK_AFTER_SECONDS.",
            workflows,
            figures.stuck,
        )
        yield _per_workflow(
            "durable_run_oldest_waiting_age_seconds",
            "Seconds the longest-waiting run of the workflow has waited (0: none waiting).",
            workflows,
            figures.oldest_waiting,
        )
        yield _per_workflow(
            "durable_run_oldest_running_age_seconds",
            "Age in seconds of the oldest running run of the workflow (0: none running).",
            workflows,
            figures.oldest_running,
        )
        window = f"in the last {float(settings.METRICS_WINDOW_SECONDS):g} seconds"
        latency = GaugeMetricFamily(
            "durable_step_latency_seconds",
            f"Step duration (started to finished) quantiles over steps finished {window}.",
            labels=["workflow", "quantile"],
        )
        for workflow, (_, quantiles) in sorted(figures.latency.items()):
            for q, value in zip(QUANTILES, quantiles, strict=True):
                latency.add_metric([workflow, str(q)], value)
        yield latency
        finished = {w: n for w, (n, _) in figures.latency.items()}
        yield _per_workflow("durable_steps_finished_recent", f"Steps finished {window}.", workflows, finished)
        yield _per_workflow(
            "durable_step_retries_recent", f"Step retries scheduled {window}.", workflows, figures.retries
        )
        yield from _health_gauges(now)
        yield from _batch_gauges(now)
        scrape = GaugeMetricFamily("durable_metrics_scrape_seconds", "Time the database queries of this scrape took.")
        scrape.add_metric([], time.perf_counter() - began)
        yield scrape


def _batch_gauges(now: datetime) -> Iterator[GaugeMetricFamily]:
    """Model turns in Message Batches (agents/batching.py): waiting for the batcher, at the API, and the oldest."""
    summary = in_flight_summary()
    turns = GaugeMetricFamily(
        "durable_batch_turns",
        "Model turns sent with delivery='batch' and not answered yet: queued (waiting for the batcher) or submitted.",
        labels=["status"],
    )
    turns.add_metric(["queued"], summary["queued"])
    turns.add_metric(["submitted"], summary["turns"] - summary["queued"])
    yield turns
    batches = GaugeMetricFamily("durable_batches_in_flight", "Message Batches sent and not yet collected.")
    batches.add_metric([], summary["batches"])
    yield batches
    oldest = GaugeMetricFamily(
        "durable_batch_oldest_age_seconds", "Age of the oldest Message Batch in flight (0: none); the API expires 24 h."
    )
    started = summary["oldest_batch_at"]
    oldest.add_metric([], max((now - started).total_seconds(), 0.0) if started else 0.0)
    yield oldest


def _health_gauges(now: datetime) -> Iterator[GaugeMetricFamily]:
    """The sweep's lag and the live workers (the heartbeat table), the oldest runnable run and the queue depths."""
    presence = read_presence(now)
    lag = GaugeMetricFamily(
        "durable_sweep_lag_seconds",
        "Seconds since the sweep last completed a pass (+Inf: never); beat runs it every few seconds.",
    )
    lag.add_metric([], math.inf if presence.sweep_lag is None else presence.sweep_lag)
    yield lag
    workers = GaugeMetricFamily(
        "durable_live_workers", "Workers heard from in the last DURABLE_AGENTS['WORKER_GONE_AFTER_SECONDS']."
    )
    workers.add_metric([], len(presence.live_workers))
    yield workers
    yield from _worker_gauges(presence)
    measured = presence.measured
    measured_at = None if measured is None or measured.queued is None else measured.measured_at
    measured_age = GaugeMetricFamily(
        "durable_queue_depth_measured_seconds",
        "Seconds since the sweep last measured the broker's queue depths, which the console shows (+Inf: never, or "
        "the broker did not answer it).",
    )
    measured_age.add_metric([], math.inf if measured_at is None else max(0.0, (now - measured_at).total_seconds()))
    yield measured_age
    backlog = read_backlog(now, presence)
    oldest = GaugeMetricFamily(
        "durable_oldest_runnable_seconds",
        "How long the oldest run a worker could take now has waited for one (0: none waits); workers are behind "
        "past DURABLE_AGENTS['BEHIND_AFTER_SECONDS'].",
    )
    oldest.add_metric([], backlog.oldest_runnable_seconds or 0.0)
    yield oldest
    if backlog.queued is not None:  # unknown (the broker could not be asked) is no sample, never 0
        queued = GaugeMetricFamily(
            "durable_queue_depth",
            "Wake-up messages waiting on each run queue, as the broker counts them.",
            labels=["queue"],
        )
        for queue, depth in sorted(backlog.queued.items()):
            queued.add_metric([queue], depth)
        yield queued


def _worker_gauges(presence: Presence) -> Iterator[GaugeMetricFamily]:
    """How busy each live worker was at its last beat; a worker that measured nothing (the previous release) has no
    sample, never 0."""
    measured = [(w, w.load) for w in presence.live_workers if w.load is not None]
    busy = GaugeMetricFamily(
        "durable_worker_slots_busy", "Tasks the worker was executing at its last heartbeat.", labels=["worker"]
    )
    slots = GaugeMetricFamily(
        "durable_worker_slots", "The worker's concurrency (pool processes or greenlets).", labels=["worker"]
    )
    waiting = GaugeMetricFamily(
        "durable_worker_pool_waiting",
        "Tasks of the worker waiting for a connection of its database pool at its last heartbeat (only workers whose "
        "pool is in their main process: gevent, threads, solo).",
        labels=["worker"],
    )
    for worker, load in measured:
        busy.add_metric([worker.hostname], float(load.slots_busy or 0))
        slots.add_metric([worker.hostname], float(load.slots or 0))
        if load.pool_waiting is not None:
            waiting.add_metric([worker.hostname], float(load.pool_waiting))
    yield busy
    yield slots
    yield waiting


def _per_workflow(name: str, documentation: str, workflows: list[str], values: dict[str, float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=["workflow"])
    for workflow in sorted(set(workflows) | set(values)):
        family.add_metric([workflow], float(values.get(workflow, 0)))
    return family


def _oldest(status: str, field: str, now: Any) -> dict[str, float]:
    rows = Run.objects.filter(status=status, replay_lane="").values("workflow").annotate(oldest=Min(field)).order_by()
    return {row["workflow"]: max(0.0, (now - row["oldest"]).total_seconds()) for row in rows}


def _recent_runs(prefix: str, since: Any) -> dict[str, Any]:
    # Naming every status lets Postgres range-scan the (status, updated_at) index once per status.
    return {f"{prefix}status__in": RunStatus.values, f"{prefix}updated_at__gte": since}


def _step_latency(since: Any) -> dict[str, tuple[int, tuple[float, ...]]]:
    """Per workflow: (steps finished since `since`, their duration quantiles in seconds)."""
    if connection.vendor == "postgresql":
        step, run = (connection.ops.quote_name(m._meta.db_table) for m in (Step, Run))
        duration = "EXTRACT(EPOCH FROM s.finished_at - s.started_at)"
        # Steps have no time index (it would tax every step commit), so the query starts from the runs that
        # progressed in the window and probes each one's steps by run_id. The LATERAL ... OFFSET 0 keeps
        # the planner from flattening it into a join that scans the whole step table instead.
        sql = (
            f"SELECT r.workflow, COUNT(*), PERCENTILE_CONT(%s) WITHIN GROUP (ORDER BY x.seconds) FROM {run} r "
            f"CROSS JOIN LATERAL (SELECT {duration} AS seconds FROM {step} s WHERE s.run_id = r.id "
            "AND s.finished_at >= %s AND s.started_at IS NOT NULL OFFSET 0) x "
            "WHERE r.status = ANY(%s) AND r.updated_at >= %s AND r.replay_lane = '' GROUP BY r.workflow"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, [list(QUANTILES), since, list(RunStatus.values), since])
            return {workflow: (n, tuple(float(v) for v in values)) for workflow, n, values in cursor.fetchall()}
    # Other databases (the embedded SQLite default) have no PERCENTILE_CONT: compute it here.
    durations: dict[str, list[float]] = defaultdict(list)
    rows = (
        Step.objects.filter(
            finished_at__gte=since, started_at__isnull=False, run__replay_lane="", **_recent_runs("run__", since)
        )
        .annotate(took=ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField()))
        .values_list("run__workflow", "took")
    )
    for workflow, took in rows:
        durations[workflow].append(took.total_seconds())
    return {w: (len(v), tuple(_quantile(sorted(v), q) for q in QUANTILES)) for w, v in durations.items()}


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of sorted values, as PERCENTILE_CONT does."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


metrics_registry = CollectorRegistry(auto_describe=False)
metrics_registry.register(DatabaseCollector())


def _authorized(request: HttpRequest) -> int:
    """200 if the request may read the metrics, else the status to answer (401 or 403)."""
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    if token and header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), str(token).encode()):
        return 200
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return 200 if user.is_active and user.is_staff else 403
    return 401


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus exposition of DatabaseCollector; see the module docstring for who may read it."""
    status = _authorized(request)
    if status == 401:
        response = HttpResponse("metrics need a bearer token or a staff login\n", status=401, content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="durable_agents metrics"'
        return response
    if status == 403:
        return HttpResponse("metrics are for staff users\n", status=403, content_type="text/plain")
    # Content negotiation as prometheus_client's own exporters do: OpenMetrics if asked, else text 0.0.4.
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encoder(metrics_registry), content_type=content_type)
