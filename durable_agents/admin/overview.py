"""The console's overview: runs by status, stuck runs, the oldest running and the oldest waiting run, and the
system's health (the sweep's lag, live workers and the verdict of health.system_health).

A fixed handful of indexed queries whatever the table size: counts stop at the exact-count limit and
are estimated beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

from durable_agents import clock
from durable_agents.admin.counting import RowCount, estimated_count
from durable_agents.admin.filters import stuck_runs
from durable_agents.health import Health, system_health
from durable_agents.models import Run, RunStatus, Wait

SUMMARY_FIELDS = ("id", "workflow", "workflow_version", "status", "created_at", "updated_at", "cursor", "step_count")


@dataclass(frozen=True)
class Overview:
    by_status: list[tuple[str, RowCount]]
    stuck: RowCount
    oldest_running: Run | None
    oldest_waiting: Run | None
    waits_past_deadline: RowCount
    health: Health


def build_overview() -> Overview:
    runs = Run.objects.only(*SUMMARY_FIELDS)
    return Overview(
        by_status=[(status, estimated_count(Run.objects.filter(status=status))) for status in RunStatus.values],
        stuck=estimated_count(stuck_runs(), selective=True),
        oldest_running=runs.filter(status=RunStatus.RUNNING).order_by("created_at").first(),
        # A waiting run last changed when it started waiting: the (status, updated_at) index answers this.
        oldest_waiting=runs.filter(status=RunStatus.WAITING).order_by("updated_at").first(),
        # The open-deadline partial index answers this; a run has at most one open wait.
        waits_past_deadline=estimated_count(Wait.objects.open().filter(deadline__lt=clock.now())),
        # The cards above count runs by status their own way (estimates past a limit): not again here.
        health=system_health(count_by_status=False),
    )
