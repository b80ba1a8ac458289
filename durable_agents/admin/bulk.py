"""Bulk actions on the run list: resume (or retry) and cancel the selected runs, each through the public API,
each run logged in the admin's log; at most BULK_LIMIT runs at once."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.response import TemplateResponse

from durable_agents import api
from durable_agents.admin.action_forms import CancelForm
from durable_agents.admin.actions import ACTIONS, BULK_CANCEL_VERBS, BULK_LIMIT, cancelled_how
from durable_agents.admin.audit import noted, record_each
from durable_agents.errors import DurableAgentsError
from durable_agents.models import FINISHED_RUN_STATUSES, Run, RunStatus


def _selected(request: HttpRequest, queryset: QuerySet[Run]) -> list[tuple[Any, str]] | None:
    rows = list(queryset.order_by().values_list("pk", "status")[: BULK_LIMIT + 1])
    if len(rows) > BULK_LIMIT:
        messages.error(request, f"Select at most {BULK_LIMIT} runs at once (filter the list first).")
        return None
    return rows


def _report(request: HttpRequest, verb: str, done: int, failures: list[str]) -> None:
    if done:
        messages.success(request, f"{verb} {done} run{'s' if done != 1 else ''}; each is recorded in its events.")
    for failure in failures[:10]:
        messages.error(request, failure)
    if len(failures) > 10:
        messages.error(request, f"… and {len(failures) - 10} more runs could not be changed.")


@admin.action(description="Resume / retry selected runs", permissions=["resume"])
def resume_selected(model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Run]) -> None:
    rows = _selected(request, queryset)
    if rows is None:
        return
    may_retry = ACTIONS["retry"].is_allowed(request.user)
    done, failures, resumed = 0, [], []
    for pk, status in rows:
        if status == RunStatus.FAILED and not may_retry:
            failures.append(f"Run {pk} failed: retrying it needs the permission {ACTIONS['retry'].permission}.")
            continue
        try:
            api.resume(pk, actor=request.user.get_username())
        except DurableAgentsError as exc:
            failures.append(f"Run {pk}: {exc}")
        else:
            done += 1
            resumed.append(pk)
    record_each(request, Run, resumed, "Resumed (bulk action)")
    _report(request, "Resume scheduled (a worker picks each up) for", done, failures)


def _compensating(pks: Iterable[Any]) -> dict[Any, str]:
    """Of `pks`, the runs compensating on their way to an end, with that end (one query)."""
    live = Run.objects.filter(pk__in=list(pks)).exclude(finish_as="").exclude(status__in=FINISHED_RUN_STATUSES)
    return dict(live.values_list("pk", "finish_as"))


def _already(finish_as: str) -> str:
    return f"already compensating on its way to {finish_as}; the saga goes on"


@admin.action(description="Cancel selected runs…", permissions=["cancel"])
def cancel_selected(
    model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Run]
) -> TemplateResponse | None:
    """Cancel after a confirmation page listing the runs (optionally compensating their effects)."""
    rows = _selected(request, queryset)
    if rows is None:
        return None
    form = CancelForm(request.POST if request.POST.get("confirm") == "yes" else None)
    if request.POST.get("confirm") == "yes" and form.is_valid():
        compensate = request.POST.get("compensate") == "on"
        outcomes: Counter[str] = Counter()
        failures, cancelled = [], []
        actor = request.user.get_username()
        compensating = _compensating(pk for pk, _ in rows)
        for pk, _status in rows:
            if pk in compensating:  # the engine ignores a second cancel: the saga goes on
                failures.append(f"Run {pk}: {_already(compensating[pk])}; left as it is.")
                continue
            try:
                run = api.cancel(pk, form.cleaned_data["reason"], compensate=compensate, actor=actor)
            except DurableAgentsError as exc:
                failures.append(f"Run {pk}: {exc}")
            else:
                outcomes[BULK_CANCEL_VERBS[cancelled_how(run)]] += 1
                cancelled.append(pk)
        how = "with compensation" if compensate else "without compensation"
        record_each(
            request, Run, cancelled, noted(f"Cancelled ({how}, bulk action)", "reason", form.cleaned_data["reason"])
        )
        # A run a worker holds is only asked to stop, a saga only begun: each outcome is reported as what it is.
        for verb, count in sorted(outcomes.items()):
            _report(request, verb, count, [])
        _report(request, "", 0, failures)
        return None
    selected = list(
        queryset.order_by("-created_at").only("id", "workflow", "workflow_version", "status", "finish_as")[:BULK_LIMIT]
    )
    # Counted and confirmed: the runs a cancel can stop. A finished one, or one already compensating on its way to
    # its end, is listed apart, left as it is.
    runs = [run for run in selected if not run.is_finished and not run.finish_as]
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Cancel {len(runs)} run{'s' if len(runs) != 1 else ''}?",
        "opts": Run._meta,
        "runs": runs,
        "finished": [run for run in selected if run.is_finished],
        "compensating": [run for run in selected if run.finish_as and not run.is_finished],
        "form": form,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        "select_across": request.POST.get("select_across", "0"),
    }
    return TemplateResponse(request, "admin/durable_agents/run/bulk_cancel.html", context)
