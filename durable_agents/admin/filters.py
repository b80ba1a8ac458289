"""The run list's filters: the operator's questions (stuck? aging? which error?) as cheap, indexed queries.

No filter's choices are computed from the whole table: workflows come from the registry, error types
from the most recent failed runs only.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.fields.json import KT
from django.http import HttpRequest

from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.health import ago, system_health
from durable_agents.models import ACTIVE_RUN_STATUSES, RUNNABLE_RUN_STATUSES, Run, RunStatus, WaitStatus
from durable_agents.operations import drifted_runs
from durable_agents.workflows import registry

AGING = {
    "1h": ("open > 1 hour", timedelta(hours=1)),
    "1d": ("open > 1 day", timedelta(days=1)),
    "3d": ("open > 3 days", timedelta(days=3)),
}
# The run list's filter on the status field (list_filter "status"): Django's own parameter for it. Links to
# the list by status use it, so they highlight that filter and compose with the sidebar's other links.
STATUS_PARAMETER = "status__exact"
# Error types are offered from this many most recent failed runs (an index range, not a table scan).
ERROR_TYPE_SAMPLE = 2000


def stuck_after() -> timedelta:
    return timedelta(seconds=float(settings.STUCK_AFTER_SECONDS))


def stuck_runs(queryset: QuerySet[Run] | None = None) -> QuerySet[Run]:
    """Running with an expired lease, or runnable with no progress for STUCK_AFTER_SECONDS.

    Compared with the database's time inside the statement (DbNow): no round trip to read the clock first.
    """
    runs = Run.objects.all() if queryset is None else queryset
    return runs.stuck(now=DbNow(), stuck_after=stuck_after())


def stuck_reason(run: Run, now: datetime) -> str:
    """Why `run` is stuck ("" if it is not), as on-call reads it: "lease expired 4 min ago (worker w-3)",
    "runnable but not picked up for 9 min", "wake time passed 12 min ago, not picked up". The rule of
    Run.objects.stuck(), for a loaded row (no query)."""
    if run.status == RunStatus.RUNNING and run.lease_expires_at is not None and run.lease_expires_at < now:
        holder = run.lease_owner or "unknown"
        return f"lease expired {ago((now - run.lease_expires_at).total_seconds())} ago (worker {holder})"
    if run.status not in RUNNABLE_RUN_STATUSES or run.updated_at >= now - stuck_after() or run.is_queued:
        return ""  # a run queued behind its concurrency key waits its turn: not stuck
    idle = ago((now - run.updated_at).total_seconds())
    if run.status == RunStatus.RUNNING:
        return f"running but no progress for {idle} (worker {run.lease_owner or 'unknown'})"
    if run.wake_at is not None and run.wake_at < now:
        return f"wake time passed {ago((now - run.wake_at).total_seconds())} ago, not picked up"
    return f"runnable but not picked up for {idle}"


def stuck_cause(now: datetime) -> str:
    """What the system's health says keeps runs from being picked up, and what Resume does: for a stuck run's page
    (one query of the heartbeat table; the broker is not asked)."""
    problems = system_health(count_by_status=False, stuck=0, ask_broker=False, now=now).problems
    if not problems:
        return (
            "no system-wide cause (the sweep is on time and workers are up): its wake-up was lost or waits behind "
            "others on the broker. Resume sends its wake-up again."
        )
    cause = problems[0]
    return f"likely cause: {cause}{'' if cause.endswith(('?', '.')) else '.'} Resume sends its wake-up again."


def is_stuck(run: Run, now: datetime) -> bool:
    return bool(stuck_reason(run, now))


class WorkflowFilter(admin.SimpleListFilter):
    title = "workflow"
    parameter_name = "workflow"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        names = set(registry.names())
        if self.value():
            names.add(self.value())  # a retired workflow's runs stay filterable by URL
        return [(name, name) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        return queryset.filter(workflow=self.value()) if self.value() else queryset


class ConcurrencyFilter(admin.SimpleListFilter):
    title = "concurrency key"
    parameter_name = "concurrency"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("queued", "waiting for its key"), ("holding", "holding its key")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() == "queued":
            return queryset.queued()
        if self.value() == "holding":
            return queryset.filter(
                concurrency_key__isnull=False, admitted_at__isnull=False, status__in=ACTIVE_RUN_STATUSES
            )
        return queryset


class StuckFilter(admin.SimpleListFilter):
    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("yes", "stuck now (expired lease or no progress)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        return stuck_runs(queryset) if self.value() == "yes" else queryset


class AgingFilter(admin.SimpleListFilter):
    title = "aging (open runs)"
    parameter_name = "aging"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [(key, label) for key, (label, _) in AGING.items()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() not in AGING:
            return queryset
        return queryset.filter(status__in=ACTIVE_RUN_STATUSES, created_at__lt=DbNow(-AGING[self.value()][1]))


class ErrorTypeFilter(admin.SimpleListFilter):
    title = "failed by error type"
    parameter_name = "error_type"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        # ->> yields text: thousands of short strings come back, not JSON values to decode one by one.
        recent = (
            Run.objects.filter(status=RunStatus.FAILED)
            .order_by("-updated_at")
            .annotate(error_type=KT("error__type"))
            .values_list("error_type", flat=True)[:ERROR_TYPE_SAMPLE]
        )
        types = {t for t in recent if t}
        if self.value():
            types.add(self.value())
        return [(t, t) for t in sorted(types)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if not self.value():
            return queryset
        return queryset.filter(status=RunStatus.FAILED, error__type=self.value())


class WaitDeadlineFilter(admin.SimpleListFilter):
    title = "waits"
    parameter_name = "wait"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("overdue", "waiting past deadline")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() != "overdue":
            return queryset
        # A run has at most one open wait (a unique constraint), so the join cannot duplicate rows.
        return queryset.filter(waits__status=WaitStatus.OPEN, waits__deadline__lt=DbNow())


# Version drift: not offered yet (issue 8 defers it).


class VersionDriftFilter(admin.SimpleListFilter):
    """Active runs pinned to a workflow version this deployment no longer registers."""

    title = "version"
    parameter_name = "drift"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [("yes", "version drift")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() != "yes":
            return queryset
        return queryset.filter(pk__in=drifted_runs().values("pk"))


# The run list hides replay runs unless this filter asks for them: a replay of 2,000 runs must not drown the
# stuck-run view. The list says how many it hides, with a link that shows them.
REPLAY_PARAMETER = "replay"


class ReplayFilter(admin.SimpleListFilter):
    title = "replay runs"
    parameter_name = REPLAY_PARAMETER

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin) -> list[tuple[str, str]]:
        return [
            ("all", "Real and replay runs"),
            ("only", "Replay runs only"),
            ("baseline", "Replay · baseline lane"),
            ("candidate", "Replay · candidate lane"),
        ]

    def choices(self, changelist: Any) -> Any:
        for choice in super().choices(changelist):
            if choice["query_string"] == changelist.get_query_string(remove=[self.parameter_name]):
                choice["display"] = "Real runs only"
            yield choice

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        value = self.value()
        if value == "all":
            return queryset
        if value == "only":
            return queryset.exclude(replay_lane="")
        if value in ("baseline", "candidate"):
            return queryset.filter(replay_lane=value)
        return queryset.filter(replay_lane="")
