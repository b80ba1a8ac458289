"""Pending approvals: open waits sorted by deadline, with their briefs, approved or rejected in bulk after a
confirmation page that lists exactly the waits decided."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import F, QuerySet
from django.http import HttpRequest
from django.template.defaultfilters import pluralize
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from durable_agents import api
from durable_agents.admin.actions import BULK_LIMIT
from durable_agents.clock import DbNow
from durable_agents.decisions import describe_closed, wait_label
from durable_agents.errors import DurableAgentsError, WaitClosedError
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
            return pending.filter(deadline__lt=DbNow())
        return pending


class BulkDecisionForm(forms.Form):
    """The confirmation's one input: a comment recorded with every wait it decides."""

    comment = forms.CharField(
        required=False,
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        help_text="Recorded with each decision, with your name.",
    )


def _decide_selected(
    model_admin: Any, request: HttpRequest, queryset: QuerySet[Wait], approved: bool
) -> TemplateResponse | None:
    """A confirmation page listing exactly the selected open waits; confirmed, each listed wait is decided.

    The confirmation posts back the ids it listed (never "select all" again), so a wait opened after the
    page was shown is not decided; a listed wait closed meanwhile is reported, not decided.
    """
    verb = "Approve" if approved else "Reject"
    form = BulkDecisionForm(request.POST if request.POST.get("confirm") == "yes" else None)
    if request.POST.get("confirm") == "yes" and form.is_valid():
        # All of the listed waits, the closed ones too: the changelist's "pending" filter would drop those silently.
        listed = _posted_ids(request)
        if len(listed) > BULK_LIMIT:
            messages.error(request, f"Decide at most {BULK_LIMIT} waits at once (filter the list first).")
            return None
        waits = {w.pk: w for w in model_admin.get_queryset(request).filter(pk__in=listed)}
        done, failures = 0, []
        for pk in listed:
            wait = waits.get(pk)
            if wait is None:
                failures.append(f"Wait {pk} no longer exists; nothing was decided.")
                continue
            try:
                api.decide(
                    pk, approved, by=request.user.get_username(), comment=form.cleaned_data["comment"], via="admin"
                )
            except WaitClosedError:
                failures.append(describe_closed(wait))
            except DurableAgentsError as exc:
                failures.append(f"{wait_label(wait)}: {exc}")
            else:
                done += 1
        if done:
            done_verb = "Approved" if approved else "Rejected"
            messages.success(
                request, f"{done_verb} {done} wait{pluralize(done)}; the runs resume, each recorded in its events."
            )
        _report_failures(request, failures)
        return None

    if request.POST.get("select_across") == "1":
        selection, closed = queryset, []
    else:
        # The ticked ids, not the filtered queryset: a ticked wait that closed meanwhile is reported, not dropped.
        selection = model_admin.get_queryset(request).filter(pk__in=_posted_ids(request))
        closed = list(selection.exclude(status=WaitStatus.OPEN).order_by("pk")[:20])
    waits = list(selection.filter(status=WaitStatus.OPEN).select_related("run").order_by("pk")[: BULK_LIMIT + 1])
    if len(waits) > BULK_LIMIT:
        messages.error(request, f"Select at most {BULK_LIMIT} waits at once (filter the list first).")
        return None
    _report_failures(request, [describe_closed(wait) for wait in closed])
    if not waits:
        messages.error(request, "None of the selected waits is open; nothing was decided.")
        return None
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{verb} {len(waits)} wait{pluralize(len(waits))}?",
        "opts": Wait._meta,
        "waits": waits,
        "form": form,
        "approved": approved,
        "verb": verb,
        "action_name": "approve_selected" if approved else "reject_selected",
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
    }
    return TemplateResponse(request, "admin/durable_agents/wait/bulk_decide.html", context)


def _posted_ids(request: HttpRequest) -> list[int]:
    return [int(pk) for pk in request.POST.getlist(ACTION_CHECKBOX_NAME) if pk.isdecimal()][: BULK_LIMIT + 1]


def _report_failures(request: HttpRequest, failures: list[str]) -> None:
    for failure in failures[:10]:
        messages.error(request, failure)
    if len(failures) > 10:
        messages.error(request, f"… and {len(failures) - 10} more waits were not decided.")


@admin.action(description="Approve selected…", permissions=["decide"])
def approve_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Wait]) -> TemplateResponse | None:
    return _decide_selected(model_admin, request, queryset, True)


@admin.action(description="Reject selected…", permissions=["decide"])
def reject_selected(model_admin: Any, request: HttpRequest, queryset: QuerySet[Wait]) -> TemplateResponse | None:
    return _decide_selected(model_admin, request, queryset, False)


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
