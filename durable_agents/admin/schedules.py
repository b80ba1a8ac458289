"""The schedules: what each starts and when, its last run, and pausing, resuming or triggering it now (through the
public API), from the list (bulk) or the schedule's own page; each is recorded in the admin's log.

Schedules are defined in code (declared in DURABLE_AGENTS["SCHEDULES"] or on a workflow, or made with
`api.schedule`), so the console neither adds, edits nor deletes them: it pauses, resumes and starts a run now, the
operator's levers, and a pause survives every sweep re-syncing a declared schedule and the app re-declaring one. The
"defined in" column says where each is defined: a declared one is removed by removing its declaration.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.defaultfilters import pluralize
from django.urls import path, reverse
from django.utils.html import format_html

from durable_agents import api
from durable_agents.admin.audit import record, record_each
from durable_agents.admin.forbidden import forbidden
from durable_agents.admin.guards import refuse_nul, show_direction_controls
from durable_agents.display import when_html, when_text
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Declared, Schedule

PAUSE_PERMISSION = "durable_agents.pause_schedule"
TRIGGER_PERMISSION = "durable_agents.trigger_schedule"
PAUSED = "Paused: no slot starts until resumed"
RESUMED = "Resumed from the next slot after now"


def _toggle(request: HttpRequest, queryset: QuerySet[Schedule], pause: bool) -> None:
    verb = api.pause_schedule if pause else api.resume_schedule
    done = []
    for pk, name in queryset.values_list("pk", "name"):
        try:
            verb(name, actor=request.user.get_username())
        except DurableAgentsError as exc:  # deleted meanwhile (a deploy dropped it)
            messages.error(request, f"Schedule {name}: {exc}")
        else:
            done.append(pk)
    record_each(request, Schedule, done, PAUSED if pause else RESUMED)
    if done:
        what = "paused: no slot starts until resumed" if pause else "resumed from the next slot after now"
        messages.success(request, f"{len(done)} schedule{pluralize(len(done))} {what}.")


def _trigger(request: HttpRequest, schedule: Schedule, token: str) -> bool:
    """Start the schedule's run now (the same token starts one); recorded, and reported as a message."""
    try:
        run = api.trigger_schedule(schedule.name, actor=request.user.get_username(), token=token)
    except DurableAgentsError as exc:
        messages.error(request, f"Schedule {schedule.name} started nothing: {exc}")
        return False
    record(request, schedule, f"Triggered now: started run {run.pk}")
    url = reverse("admin:durable_agents_run_change", args=[run.pk])
    messages.success(
        request, format_html('Schedule {} started run <a href="{}">{}</a> now.', schedule.name, url, str(run.pk)[:8])
    )
    return True


@admin.action(description="Pause selected schedules", permissions=["pause"])
def pause_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
    _toggle(request, queryset, pause=True)


@admin.action(description="Resume selected schedules", permissions=["pause"])
def resume_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
    _toggle(request, queryset, pause=False)


@admin.action(description="Trigger selected schedules now", permissions=["trigger"])
def trigger_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
    for schedule in queryset.order_by("name"):
        _trigger(request, schedule, uuid.uuid4().hex)


@admin.register(Schedule)
class ScheduleAdmin(admin.ModelAdmin):
    change_list_template = "admin/durable_agents/schedule/change_list.html"
    list_display = (
        "name",
        "workflow",
        "cron_column",
        "next_slot_column",
        "last_run_link",
        "overlap_column",
        "state",
        "origin",
        "error",
    )
    list_filter = ("paused", "declared", "workflow", "missed", "overlap")
    search_fields = ("name", "workflow")
    actions = [pause_selected, resume_selected, trigger_selected]
    change_form_template = "admin/durable_agents/schedule/change_form.html"
    readonly_fields = [f.name for f in Schedule._meta.fields]

    @admin.display(description="cron")
    def cron_column(self, schedule: Schedule) -> str:
        return format_html("<code>{}</code> {} · missed: {}", schedule.cron, schedule.timezone, schedule.missed)

    @admin.display(description="overlap", ordering="overlap_skipped")
    def overlap_column(self, schedule: Schedule) -> str:
        # How many slots were passed over because the last run was still live: a schedule too tight for its runs.
        return format_html("{} · skipped: {}", schedule.overlap, schedule.overlap_skipped)

    @admin.display(description="state", ordering="paused")
    def state(self, schedule: Schedule) -> str:
        """Paused or active, in words: Django's boolean icon showed a paused schedule as a green tick."""
        word = "paused" if schedule.paused else "active"
        return format_html('<span class="durable-badge durable-{}">{}</span>', word, word)

    @admin.display(description="next slot", ordering="next_slot")
    def next_slot_column(self, schedule: Schedule) -> str:
        if schedule.paused:
            return format_html('<span class="durable-quiet">{}</span>', "none while paused")
        return when_html(schedule.next_slot)

    @admin.display(description="last run")
    def last_run_link(self, schedule: Schedule) -> str:
        if schedule.last_run_id is None:
            return "—"
        url = reverse("admin:durable_agents_run_change", args=[schedule.last_run_id])
        return format_html('<a href="{}">{}</a> {}', url, str(schedule.last_run_id)[:8], when_html(schedule.last_slot))

    @admin.display(description="defined in", ordering="declared")
    def origin(self, schedule: Schedule) -> str:
        """Where the code defines it: a declared schedule comes back at each sweep until its declaration goes."""
        if schedule.declared == Declared.SETTING:
            return format_html("<code>{}</code>", 'DURABLE_AGENTS["SCHEDULES"]')
        if schedule.declared == Declared.WORKFLOW:
            return format_html("workflow <code>{}</code> (cron)", schedule.workflow)
        return "api.schedule"

    @admin.display(description="cannot start")
    def error(self, schedule: Schedule) -> str:
        return schedule.last_error or "—"

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        refused = refuse_nul(request)
        if refused is not None:
            return refused
        return show_direction_controls(super().changelist_view(request, extra_context))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # A fresh token per page: the trigger button posted twice (a double click, a resent form) starts one run.
        context = {
            "may_pause": self.has_pause_permission(request),
            "may_trigger": self.has_trigger_permission(request),
            "trigger_token": uuid.uuid4().hex,
            **(extra_context or {}),
        }
        return show_direction_controls(super().change_view(request, object_id, form_url, context))

    def get_urls(self) -> list[Any]:
        operate = self.admin_site.admin_view(self.operate_view)
        return [
            path("<path:object_id>/operate/<slug:verb>/", operate, name="durable_agents_schedule_operate"),
            *super().get_urls(),
        ]

    def operate_view(self, request: HttpRequest, object_id: str, verb: str) -> HttpResponse:
        """POST only: pause, resume or trigger the schedule through the public API, recorded; then back to it."""
        if verb not in ("pause", "resume", "trigger"):
            raise Http404(f"no schedule operation {verb!r}")
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        schedule = self.get_object(request, object_id)
        if schedule is None:
            raise Http404("no schedule has that id")
        permission = TRIGGER_PERMISSION if verb == "trigger" else PAUSE_PERMISSION
        if not request.user.has_perm(permission):
            return forbidden(request, permission, f"{verb} schedules", site=self.admin_site)
        page = reverse("admin:durable_agents_schedule_change", args=[schedule.pk])
        if verb == "trigger":
            _trigger(request, schedule, str(request.POST.get("token", "")))
            return HttpResponseRedirect(page)
        try:
            toggle = api.pause_schedule if verb == "pause" else api.resume_schedule
            after = toggle(schedule.name, actor=request.user.get_username())
        except DurableAgentsError as exc:
            messages.error(request, f"Schedule {schedule.name}: {exc}")
            return HttpResponseRedirect(page)
        record(request, schedule, PAUSED if verb == "pause" else RESUMED)
        state = "paused" if after.paused else f"active, next slot {when_text(after.next_slot)}"
        messages.success(request, f"Schedule {schedule.name}: {state}.")
        return HttpResponseRedirect(page)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PAUSE_PERMISSION)

    def has_trigger_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(TRIGGER_PERMISSION)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Schedule | None = None) -> bool:
        return False
