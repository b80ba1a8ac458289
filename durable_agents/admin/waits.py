"""The approvals queue: open waits sorted by deadline, each question as its tool and arguments with the brief,
decided one at a time on the wait's own page or in bulk after a confirmation page that lists exactly the
waits decided. Every form decides exactly the wait (and the call) it showed."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import F, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.defaultfilters import pluralize
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.views.decorators.http import require_POST

from durable_agents import api, clock
from durable_agents.admin.action_forms import comment_field, stale_decision
from durable_agents.admin.actions import BULK_LIMIT
from durable_agents.admin.audit import noted, record
from durable_agents.admin.forbidden import forbidden
from durable_agents.admin.guards import refuse_nul, show_direction_controls
from durable_agents.admin.questions import asks
from durable_agents.admin.statuses import join_outcome, wait_badge, wait_status_text
from durable_agents.clock import DbNow
from durable_agents.decisions import asked_again, describe_closed, stale_before_approved, stale_text, wait_label
from durable_agents.display import ago_text, when_html, when_text
from durable_agents.errors import DurableAgentsError, WaitClosedError
from durable_agents.models import Wait, WaitKind, WaitStatus

DECIDE_PERMISSION = "durable_agents.decide_wait"


class OpenApprovalFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"
    # The queue an approver works from, shown (and highlighted) when no state is chosen.
    default = "open"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("open", "Open approvals"), ("overdue", "Past deadline"), ("all", "All waits")]

    def current(self) -> str:
        # "pending": what the default was called before; old bookmarks keep working.
        value = self.value()
        return self.default if value in (None, "pending") else str(value)

    def choices(self, changelist: Any) -> Any:
        # No "All" entry of Django's: "All waits" is one of the lookups, and the default is highlighted as chosen.
        for lookup, title in self.lookup_choices:
            yield {
                "selected": self.current() == lookup,
                "query_string": changelist.get_query_string({self.parameter_name: lookup}),
                "display": title,
            }

    def queryset(self, request: HttpRequest, queryset: QuerySet[Wait]) -> QuerySet[Wait]:
        value = self.current()
        if value == "all":
            return queryset
        pending = queryset.filter(status=WaitStatus.OPEN, kind=WaitKind.APPROVAL)
        if value == "overdue":
            return pending.filter(deadline__lt=DbNow())
        return pending


class WaitDecisionForm(forms.Form):
    """The wait page's decision: approve or reject, a comment, and the call the page showed (its args hash)."""

    decision = forms.ChoiceField(choices=[("approve", "Approve"), ("reject", "Reject")])
    args_hash = forms.CharField(required=False, widget=forms.HiddenInput)
    comment = comment_field("Recorded with the decision, with your name.")


class BulkDecisionForm(forms.Form):
    """The confirmation's one input: a comment recorded with every wait it decides."""

    comment = comment_field("Recorded with each decision, with your name.")


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
                record(
                    request,
                    wait.run,
                    noted(
                        f"{'Approved' if approved else 'Rejected'} {wait_label(wait)} (bulk action)",
                        "comment",
                        form.cleaned_data["comment"],
                    ),
                )
        if done:
            done_verb = "Approved" if approved else "Rejected"
            messages.success(
                request,
                f"{done_verb} {done} wait{pluralize(done)}; each run is scheduled to resume (a worker picks it up), "
                "each decision recorded in its events.",
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
        "waits": [(wait, asks(wait, look_further=False)) for wait in waits],
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


def _now(wait: Wait) -> Any:
    """The database's time as read with the row (the list's queryset annotates it), else read now."""
    return getattr(wait, "db_now", None) or clock.now()


@admin.register(Wait)
class WaitAdmin(admin.ModelAdmin):
    list_display = ("id", "asks_column", "run_link", "age", "deadline_column", "reminders_sent", "status_column")
    list_display_links = ("id",)
    list_filter = (OpenApprovalFilter, "kind")
    list_select_related = ("run",)
    search_fields = ("=run__id", "name", "question")
    actions = [approve_selected, reject_selected]
    readonly_fields = [f.name for f in Wait._meta.fields]
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Wait]:
        # The database's time read with the rows: ages and overdue marks without a query per row.
        return super().get_queryset(request).annotate(db_now=DbNow())

    # Soonest deadline first; waits without one after those that have one.
    ordering = (F("deadline").asc(nulls_last=True), "created_at")
    change_list_template = "admin/durable_agents/wait/change_list.html"

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        changelist = super().get_changelist_instance(request)
        # Why a request is asked again, read for the whole page at once (the rows are the ones rendered).
        rows = list(changelist.result_list)
        found = asked_again(rows)
        for wait in rows:
            wait.asked_again = found.get(wait.pk)
        return changelist

    @admin.display(description="asks")
    def asks_column(self, wait: Wait) -> SafeString:
        context = {
            "asks": asks(wait, look_further=False),
            "wait": wait,
            "show_brief": True,
            "again": getattr(wait, "asked_again", None),
        }
        return render_to_string("admin/durable_agents/wait/_asks.html", context)

    @admin.display(description="run")
    def run_link(self, wait: Wait) -> str:
        url = reverse("admin:durable_agents_run_change", args=[wait.run_id])
        return format_html('<a href="{}">{} {}</a>', url, str(wait.run_id)[:8], wait.run.workflow)

    @admin.display(description="status", ordering="status")
    def status_column(self, wait: Wait) -> str:
        # The words the run page uses: a met join is joined, not "Approved".
        return wait_status_text(wait)

    @admin.display(description="age", ordering="created_at")
    def age(self, wait: Wait) -> str:
        return format_html(
            '<span title="opened {}">{}</span>', when_text(wait.created_at), ago_text(wait.created_at, _now(wait))
        )

    @admin.display(description="deadline", ordering="deadline")
    def deadline_column(self, wait: Wait) -> str:
        if wait.deadline is None:
            return when_html(None)
        overdue = wait.is_open and wait.deadline < _now(wait)
        return format_html('<span class="{}">{}</span>', "durable-overdue" if overdue else "", when_html(wait.deadline))

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        refused = refuse_nul(request)
        if refused is not None:
            return refused
        context = {"title": "Approvals and waits", **(extra_context or {})}
        return show_direction_controls(super().changelist_view(request, context))

    def get_urls(self) -> list[URLPattern]:
        decide = self.admin_site.admin_view(require_POST(self.decide_view))
        return [path("<path:object_id>/decide/", decide, name="durable_agents_wait_decide"), *super().get_urls()]

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The wait's page: what it asks (tool and arguments), its brief and run, and the decision form."""
        wait = self._wait(request, object_id)
        if not self.has_view_permission(request, wait):
            return forbidden(request, "durable_agents.view_wait", "view waits", site=self.admin_site)
        may_decide = self.has_decide_permission(request)
        decidable = wait.is_open and wait.kind == WaitKind.APPROVAL
        context = {
            **self.admin_site.each_context(request),
            "title": f"Wait {wait.pk} · {wait.kind}: {Truncator(wait.question or wait.name).chars(80)}",
            "opts": Wait._meta,
            "wait": wait,
            "asks": asks(wait),
            "status_text": wait_status_text(wait),
            "status_badge": wait_badge(wait_status_text(wait), wait),
            "outcome": join_outcome(wait),
            "again": asked_again([wait]).get(wait.pk),
            "may_decide": may_decide,
            "decide_permission": DECIDE_PERMISSION,
            "form": WaitDecisionForm(initial={"args_hash": wait.args_hash}) if may_decide and decidable else None,
            "decide_url": reverse("admin:durable_agents_wait_decide", args=[wait.pk]),
            "overdue": wait.is_open and wait.deadline is not None and wait.deadline < clock.now(),
            "now": clock.now(),
        }
        return show_direction_controls(TemplateResponse(request, "admin/durable_agents/wait/wait_page.html", context))

    def decide_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """Approve or reject exactly the wait (and call) the page showed, with the comment; then back to it."""
        if not self.has_decide_permission(request):
            return forbidden(request, DECIDE_PERMISSION, "decide approvals", site=self.admin_site)
        wait = self._wait(request, object_id)
        page = reverse("admin:durable_agents_wait_change", args=[wait.pk])
        form = WaitDecisionForm(request.POST)
        if not form.is_valid():
            problems = "; ".join(f"{field}: {' '.join(errors)}" for field, errors in form.errors.items())
            messages.error(request, f"Nothing was decided: {problems}.")
            return HttpResponseRedirect(page)
        stale = stale_decision(wait, form.cleaned_data["args_hash"])
        if stale:
            messages.error(request, stale)
            return HttpResponseRedirect(page)
        approved = form.cleaned_data["decision"] == "approve"
        gone_stale = stale_before_approved(wait) if approved else None
        try:
            api.decide(
                wait.pk, approved, by=request.user.get_username(), comment=form.cleaned_data["comment"], via="admin"
            )
        except WaitClosedError:
            # Closed between the check above and the decision: the API's compare-and-set is the referee.
            messages.error(request, describe_closed(wait))
        except DurableAgentsError as exc:
            messages.error(request, f"Nothing was decided: {exc}")
        else:
            verb, route = ("Approved", "approve") if approved else ("Rejected", "reject")
            record(request, wait.run, noted(f"{verb} {wait_label(wait)}", "comment", form.cleaned_data["comment"]))
            then = (
                f"but {stale_text(gone_stale)}: the run re-reads it and asks again before {wait.step.step_id} runs"
                if gone_stale is not None and wait.step is not None
                else f"a worker will pick it up and take the {route} path"
            )
            messages.success(
                request, f"{verb} {wait_label(wait)}, with your comment. Its run is scheduled to resume: {then}."
            )
        return HttpResponseRedirect(page)

    def _wait(self, request: HttpRequest, object_id: str) -> Wait:
        wait = (
            self.get_queryset(request).select_related("run", "step").filter(pk=object_id).first()
            if str(object_id).isdecimal()
            else None
        )
        if wait is None:
            raise Http404("no wait has that id")
        return wait

    def has_view_permission(self, request: HttpRequest, obj: Wait | None = None) -> bool:
        # Approvers see the queue they work from, even without the generic view permission.
        return super().has_view_permission(request, obj) or self.has_decide_permission(request)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return super().has_module_permission(request) or self.has_decide_permission(request)

    def has_decide_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(DECIDE_PERMISSION)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Wait | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Wait | None = None) -> bool:
        return False
