"""The schedules: what each starts and when, its last run, and pausing or resuming it (through the public API).

Schedules are defined in code (`api.schedule`), so the console neither adds, edits nor deletes them: it pauses
and resumes, the operator's two levers, and a pause survives the app re-declaring the schedule at start-up.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.utils.html import format_html

from durable_agents import api
from durable_agents.admin.guards import refuse_nul, show_direction_controls
from durable_agents.display import when_html
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Schedule

PAUSE_PERMISSION = "durable_agents.pause_schedule"


def _toggle(request: HttpRequest, queryset: QuerySet[Schedule], pause: bool) -> None:
    verb = api.pause_schedule if pause else api.resume_schedule
    done = 0
    for name in queryset.values_list("name", flat=True):
        try:
            verb(name)
        except DurableAgentsError as exc:  # deleted meanwhile (a deploy dropped it)
            messages.error(request, f"Schedule {name}: {exc}")
        else:
            done += 1
    if done:
        what = "paused: no slot starts until resumed" if pause else "resumed from the next slot after now"
        messages.success(request, f"{done} schedule{pluralize(done)} {what}.")


@admin.action(description="Pause selected schedules", permissions=["pause"])
def pause_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
    _toggle(request, queryset, pause=True)


@admin.action(description="Resume selected schedules", permissions=["pause"])
def resume_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
    _toggle(request, queryset, pause=False)


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "workflow",
        "cron_column",
        "next_slot_column",
        "last_run_link",
        "overlap_column",
        "paused",
        "error",
    )
    list_filter = ("paused", "workflow", "missed", "overlap")
    search_fields = ("name", "workflow")
    actions = [pause_selected, resume_selected]
    readonly_fields = [f.name for f in Schedule._meta.fields]

    @admin.display(description="cron")
    def cron_column(self, schedule: Schedule) -> str:
        return format_html("<code>{}</code> {} · missed: {}", schedule.cron, schedule.timezone, schedule.missed)

    @admin.display(description="overlap", ordering="overlap_skipped")
    def overlap_column(self, schedule: Schedule) -> str:
        # How many slots were passed over because the last run was still live: a schedule too tight for its runs.
        return format_html("{} · skipped: {}", schedule.overlap, schedule.overlap_skipped)

    @admin.display(description="next slot", ordering="next_slot")
    def next_slot_column(self, schedule: Schedule) -> str:
        return "paused" if schedule.paused else when_html(schedule.next_slot)

    @admin.display(description="last run")
    def last_run_link(self, schedule: Schedule) -> str:
        if schedule.last_run_id is None:
            return "—"
        url = reverse("admin:durable_agents_run_change", args=[schedule.last_run_id])
        return format_html('<a href="{}">{}</a> {}', url, str(schedule.last_run_id)[:8], when_html(schedule.last_slot))

    @admin.display(description="cannot start")
    def error(self, schedule: Schedule) -> str:
        return schedule.last_error

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        refused = refuse_nul(request)
        if refused is not None:
            return refused
        return show_direction_controls(super().changelist_view(request, extra_context))

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PAUSE_PERMISSION)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False
