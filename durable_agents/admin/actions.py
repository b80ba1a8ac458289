"""Operator actions on runs: resume, retry the failed step, cancel (with or without compensation),
set the budget, swap the participant, approve or reject a wait, re-plan from a step — one at a time
from the run page, or in bulk from the list.

Each action checks its own permission, confirms what it will do, then calls the public API with the
operator as `actor` (the engine records the event). No status is written here. Domain errors become
admin error messages, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from durable_agents import api
from durable_agents.agents.participants import participants
from durable_agents.errors import DurableAgentsError, WaitNotFoundError
from durable_agents.models import ACTIVE_RUN_STATUSES, Run, RunStatus, Step, Wait
from durable_agents.storable import BIGINT_MAX

# Bulk actions act on at most this many runs at once; select fewer (filter first) for more.
BULK_LIMIT = 500


class RunActionForm(forms.Form):
    """An action's form; bare, it is a confirmation."""

    def __init__(self, *args: Any, run: Run | None = None, **kwargs: Any) -> None:
        self.run = run
        super().__init__(*args, **kwargs)


class CancelForm(RunActionForm):
    reason = forms.CharField(
        required=False,
        max_length=1000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        help_text="Recorded in the run's history with your name.",
    )


class BudgetForm(RunActionForm):
    tokens = forms.IntegerField(
        required=False, min_value=0, max_value=BIGINT_MAX, label="Token budget", help_text="Leave empty to keep."
    )
    cost_usd = forms.DecimalField(
        required=False, min_value=0, max_digits=14, decimal_places=6, label="Cost budget (USD)"
    )

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        self.fields["tokens"].initial = run.token_budget
        self.fields["cost_usd"].initial = run.cost_budget_usd

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("tokens") is None and data.get("cost_usd") is None:
            raise forms.ValidationError("Give a token budget, a cost budget, or both.")
        return data


class SwapForm(RunActionForm):
    participant = forms.ChoiceField(help_text="Answers this run's model turns from the next turn on.")

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        self.fields["participant"].choices = [(name, name) for name in participants.names()]
        self.fields["participant"].initial = run.participant or None


class DecisionForm(RunActionForm):
    comment = forms.CharField(
        required=False,
        max_length=2000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        help_text="Recorded with the decision.",
    )

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        wait = Wait.objects.open().filter(run=run).first()
        self.wait = wait
        if wait is not None:
            self.fields["brief"] = forms.CharField(
                required=False,
                disabled=True,
                initial=wait.brief or wait.question,
                label=wait.question[:80],
                widget=forms.Textarea(attrs={"rows": 14, "cols": 90}),
            )
            self.order_fields(["brief", "comment"])


class ReplanForm(RunActionForm):
    step_id = forms.ChoiceField(label="From step", help_text="This step and all after it execute again.")

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        steps = Step.objects.live().filter(run=run).order_by("position").values_list("step_id", "status")
        self.fields["step_id"].choices = [(step_id, f"{step_id} ({status})") for step_id, status in steps]


def _decide(run: Run, approved: bool, data: dict[str, Any], actor: str) -> Run:
    wait = Wait.objects.open().filter(run=run).first()
    if wait is None:
        raise WaitNotFoundError(f"run {run.pk} has no open wait; it may have been decided a moment ago")
    api.decide(wait.pk, approved, by=actor, comment=data.get("comment", ""), via="admin")
    return run


@dataclass(frozen=True)
class RunAction:
    """One thing an operator can do to a run, behind the permission `durable_agents.<codename>`."""

    slug: str
    label: str
    codename: str
    applies_to: tuple[str, ...]
    explanation: str
    perform: Callable[[Run, dict[str, Any], str], Run]
    form_class: type[RunActionForm] = RunActionForm
    destructive: bool = False

    @property
    def permission(self) -> str:
        return f"durable_agents.{self.codename}"

    @property
    def needs_page(self) -> bool:
        """Destructive actions confirm on a page of their own, and so do actions that ask for input."""
        return self.destructive or bool(self.form_class.base_fields)

    def is_allowed(self, user: Any) -> bool:
        return user.has_perm(self.permission)

    def applies(self, run: Run) -> bool:
        return run.status in self.applies_to


NOT_COMPLETED = tuple(s for s in RunStatus.values if s != RunStatus.COMPLETED)

ACTIONS: dict[str, RunAction] = {
    action.slug: action
    for action in [
        RunAction(
            "resume",
            "Resume",
            "resume_run",
            (RunStatus.CANCELLED, RunStatus.PENDING, RunStatus.RUNNING),
            "A cancelled run continues at the step it stopped on; a pending or running run is woken again "
            "(safe if its worker is alive: the lease lets only one of them commit).",
            lambda run, data, actor: api.resume(run.pk, actor=actor),
        ),
        RunAction(
            "retry",
            "Retry failed step",
            "retry_step",
            (RunStatus.FAILED,),
            "The failed step runs again from attempt 1; committed steps are not repeated.",
            lambda run, data, actor: api.resume(run.pk, actor=actor),
        ),
        RunAction(
            "cancel",
            "Cancel",
            "cancel_run",
            ACTIVE_RUN_STATUSES,
            "The run stops; a step executing now finishes and is checkpointed first. Applied effects stay applied.",
            lambda run, data, actor: api.cancel(run.pk, data.get("reason", ""), compensate=False, actor=actor),
            CancelForm,
            destructive=True,
        ),
        RunAction(
            "compensate",
            "Cancel and compensate",
            "cancel_run",
            ACTIVE_RUN_STATUSES,
            "The run undoes its applied effects, newest first, each through its tool's compensating tool "
            "exactly once, then ends cancelled.",
            lambda run, data, actor: api.cancel(run.pk, data.get("reason", ""), compensate=True, actor=actor),
            CancelForm,
            destructive=True,
        ),
        RunAction(
            "budget",
            "Raise budget",
            "set_budget",
            NOT_COMPLETED,
            "Sets the run's token and/or cost budget; a run that failed on its budget can then be retried.",
            lambda run, data, actor: api.set_budget(
                run.pk, tokens=data.get("tokens"), cost_usd=data.get("cost_usd"), actor=actor
            ),
            BudgetForm,
        ),
        RunAction(
            "swap",
            "Swap participant",
            "swap_participant",
            ACTIVE_RUN_STATUSES,
            "The next model turn is asked of this participant; earlier turns stay as journaled.",
            lambda run, data, actor: api.swap_participant(run.pk, data["participant"], actor=actor),
            SwapForm,
        ),
        RunAction(
            "approve",
            "Approve",
            "decide_wait",
            (RunStatus.WAITING,),
            "The run's open wait is approved with your name and comment; the run wakes and takes the approve path.",
            lambda run, data, actor: _decide(run, True, data, actor),
            DecisionForm,
        ),
        RunAction(
            "reject",
            "Reject",
            "decide_wait",
            (RunStatus.WAITING,),
            "The run's open wait is rejected with your name and comment; the run wakes and takes the reject path.",
            lambda run, data, actor: _decide(run, False, data, actor),
            DecisionForm,
            destructive=True,
        ),
        RunAction(
            "replan",
            "Re-plan from a step",
            "replan_run",
            (RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.COMPLETED, RunStatus.PENDING, RunStatus.RUNNING),
            "The run executes again from the chosen step: later checkpoints are kept as superseded history, "
            "planner steps plan afresh, and effects already applied are reused, never repeated.",
            lambda run, data, actor: api.resume(run.pk, data["step_id"], actor=actor),
            ReplanForm,
            destructive=True,
        ),
    ]
}


def actions_for(run: Run, user: Any) -> list[tuple[RunAction, bool]]:
    """The actions that apply to `run` now, each with whether `user` may perform it."""
    return [(action, action.is_allowed(user)) for action in ACTIONS.values() if action.applies(run)]


def run_action_view(model_admin: admin.ModelAdmin, request: HttpRequest, object_id: str, slug: str) -> HttpResponse:
    """GET: the confirmation (or form) page. POST: perform through the public API, then back to the run."""
    action = ACTIONS.get(slug)
    if action is None:
        raise Http404(f"no run action {slug!r}")
    run = model_admin.get_object(request, object_id)
    if run is None:
        raise Http404("no run has that id")
    if not model_admin.has_view_permission(request, run) or not action.is_allowed(request.user):
        raise PermissionDenied(f"{action.label} needs the permission {action.permission}")
    run_url = reverse("admin:durable_agents_run_change", args=[run.pk])
    if not action.applies(run):
        messages.error(request, f"{action.label} does not apply to a {run.status} run.")
        return HttpResponseRedirect(run_url)
    form = action.form_class(request.POST if request.method == "POST" else None, run=run)
    if request.method == "POST" and form.is_valid():
        try:
            action.perform(run, form.cleaned_data, request.user.get_username())
        except DurableAgentsError as exc:
            messages.error(request, f"{action.label} failed: {exc}")
        else:
            messages.success(request, f"{action.label}: done for run {run.pk}. It is recorded in the run's events.")
        return HttpResponseRedirect(run_url)
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"{action.label}: run {str(run.pk)[:8]}",
        "opts": Run._meta,
        "run": run,
        "action": action,
        "form": form,
        "run_url": run_url,
    }
    return TemplateResponse(request, "admin/durable_agents/run/action_form.html", context)


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
    done, failures = 0, []
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
    _report(request, "Resumed", done, failures)


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
        done, failures = 0, []
        for pk, _status in rows:
            try:
                api.cancel(pk, form.cleaned_data["reason"], compensate=compensate, actor=request.user.get_username())
            except DurableAgentsError as exc:
                failures.append(f"Run {pk}: {exc}")
            else:
                done += 1
        _report(request, "Cancelled" + (" (compensating)" if compensate else ""), done, failures)
        return None
    runs = list(queryset.order_by("-created_at").only("id", "workflow", "workflow_version", "status")[:BULK_LIMIT])
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Cancel {len(runs)} run{'s' if len(runs) != 1 else ''}?",
        "opts": Run._meta,
        "runs": runs,
        "form": form,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        "select_across": request.POST.get("select_across", "0"),
    }
    return TemplateResponse(request, "admin/durable_agents/run/bulk_cancel.html", context)
