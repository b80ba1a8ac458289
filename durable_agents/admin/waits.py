"""Pending approvals: open waits sorted by deadline, with their briefs, approved or rejected in bulk."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import F, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from durable_agents import api
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Wait, WaitKind, WaitStatus


class OpenApprovalFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pending", "Pending approvals"), ("overdue", "Past deadline"), ("all", "All waits")]

    def choices(self, changelist: Any) -> Any:
        # "Pending approvals" is the default view: an approver's queue.
        for choice in super().choices(changelist):
            if choice["query_string"] == changelist.get_query_string(remove=[self.parameter_name]):
                continue
            yield choice

    def queryset(self, request: HttpRequest, queryset: QuerySet[Wait]) -> QuerySet[Wait]:
        value = self.value() or "pending"
        if value == "all":
            return queryset
        pending = queryset.filter(status=WaitStatus.OPEN, kind=WaitKind.APPROVAL)
        if value == "overdue":
            from durable_agents import clock

            return pending.filter(deadline__lt=clock.now())
        return pending


def _decide_selected(request: HttpRequest, queryset: QuerySet[Wait], approved: bool) -> None:
    done, failures = 0, []
    for wait in queryset.filter(status=WaitStatus.OPEN)[:500]:
        try:
            api.decide(wait.pk, approved, by=request.user.get_username(), via="admin")
            done += 1
        except DurableAgentsError as exc:
            failures.append(str(exc))
    verb = "Approved" if approved else "Rejected"
    if done:
        messages.success(request, f"{verb} {done} wait{'s' if done != 1 else ''}; the runs resume.")
    for failure in failures[:10]:
        messages.error(request, failure)


@admin.action(description="Approve selected", permissions=["decide"])
def approve_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Wait]) -> None:
    _decide_selected(request, queryset, True)


@admin.action(description="Reject selected", permissions=["decide"])
def reject_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Wait]) -> None:
    _decide_selected(request, queryset, False)


@admin.register(Wait)
class WaitAdmin(admin.ModelAdmin):
    list_display = ("id", "run_link", "name", "question", "deadline", "reminders_sent", "created_at", "status")
    list_filter = (OpenApprovalFilter, "kind")
    list_select_related = ("run",)
    search_fields = ("=run__id", "name", "question")
    actions = [approve_selected, reject_selected]
    readonly_fields = [f.name for f in Wait._meta.fields]
    show_full_result_count = False
    # Soonest deadline first; waits without one after those that have one.
    ordering = (F("deadline").asc(nulls_last=True), "created_at")

    @admin.display(description="run")
    def run_link(self, wait: Wait) -> str:
        url = reverse("admin:durable_agents_run_change", args=[wait.run_id])
        return format_html('<a href="{}">{} {}</a>', url, str(wait.run_id)[:8], wait.run.workflow)

    def has_view_permission(self, request: HttpRequest, obj: Wait | None = None) -> bool:
        # Approvers see the queue they work from, even without the generic view permission.
        return super().has_view_permission(request, obj) or self.has_decide_permission(request)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) or self.has_decide_permission(request)

    def has_decide_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("durable_agents.decide_wait")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Wait | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Wait | None = None) -> bool:
        return False
