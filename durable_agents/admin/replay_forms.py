"""Starting a replay from the console: the candidate form, the run list's "Replay selected runs…" and the cohort
list's "Replay the selected cohort…", each through `api.replay` with the operator as actor, logged in the admin's log.

The form asks for the candidate (model, participant, instructions, effort, thinking, tool descriptions), the lanes,
a budget, the concurrency and stubs. What the form cannot check (an unknown model, thinking the model refuses, runs
that are not finished real runs) the API refuses: the refusal is shown on the form, never a traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from durable_agents import api
from durable_agents.admin.actions import BULK_LIMIT
from durable_agents.admin.audit import record
from durable_agents.agents.capabilities import EFFORTS, THINKING_TYPES
from durable_agents.agents.participants import participants
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Cohort, Replay, Run

PERMISSION = "durable_agents.replay_run"
LANE_CHOICES = [("baseline", "baseline (the recorded model asked again: its own noise)"), ("candidate", "candidate")]


def _json_field(value: str, what: str, *, values: type | None = None) -> dict[str, Any]:
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise forms.ValidationError(f"{what} must be JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise forms.ValidationError(f"{what} must be a JSON object: {{tool name: ...}}")
    if values is not None and not all(isinstance(v, values) for v in parsed.values()):
        raise forms.ValidationError(f"{what} maps each tool name to a {values.__name__}")
    return parsed


class ReplayForm(forms.Form):
    model = forms.CharField(
        required=False, max_length=100, help_text="The candidate model, e.g. claude-sonnet-4-5 (blank: as recorded)."
    )
    participant = forms.ChoiceField(required=False, help_text="Who answers the model turns (blank: as recorded).")
    instructions = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 5, "cols": 80}),
        help_text="A new system prompt for the agent steps (blank: as recorded).",
    )
    effort = forms.ChoiceField(required=False, choices=[("", "as recorded"), *((e, e) for e in EFFORTS)])
    thinking = forms.ChoiceField(required=False, choices=[("", "as recorded"), *((t, t) for t in THINKING_TYPES)])
    tool_descriptions = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        help_text='Optional JSON: {"tool name": "its new description"}.',
    )
    lanes = forms.MultipleChoiceField(
        choices=LANE_CHOICES, initial=["baseline", "candidate"], widget=forms.CheckboxSelectMultiple
    )
    budget_usd = forms.DecimalField(
        required=False,
        min_value=Decimal("0.000001"),
        max_digits=14,
        decimal_places=6,
        label="Budget (USD)",
        help_text="What the whole replay may spend (blank: no budget).",
    )
    concurrency = forms.IntegerField(
        required=False, min_value=1, max_value=10_000, help_text="Replay runs in flight at once (blank: 100)."
    )
    stubs = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        help_text='Optional JSON: {"tool name": result} answers a call the recording never made (else it ends that '
        "run's replay).",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["participant"].choices = [("", "as recorded"), *((n, n) for n in participants.names())]

    def clean_tool_descriptions(self) -> dict[str, Any]:
        return _json_field(self.cleaned_data["tool_descriptions"], "Tool descriptions", values=str)

    def clean_stubs(self) -> dict[str, Any]:
        return _json_field(self.cleaned_data["stubs"], "Stubs")

    def candidate(self) -> dict[str, Any]:
        data = self.cleaned_data
        fields = ("model", "participant", "instructions", "effort", "thinking", "tool_descriptions")
        return {name: data[name] for name in fields if data.get(name)}

    def summary(self) -> str:
        """The candidate in the log's one line: "model claude-sonnet-4-5, effort low"."""
        shown = []
        for name, value in self.candidate().items():
            if name == "instructions":
                shown.append(f"instructions ({len(value)} characters)")
            elif name == "tool_descriptions":
                shown.append(f"tool descriptions for {', '.join(sorted(value))}")
            else:
                shown.append(f"{name} {value}")
        return ", ".join(shown) or "no change"


def candidate_summary(candidate: dict[str, Any]) -> str:
    """A stored candidate in a list cell: its fields, a long prompt shortened."""
    parts = []
    for name, value in (candidate or {}).items():
        if name == "instructions":
            text = value if isinstance(value, str) else json.dumps(value)
            parts.append(f"instructions: {text[:60]}{'…' if len(text) > 60 else ''}")
        elif name == "tool_descriptions" and isinstance(value, dict):
            parts.append(f"tool descriptions: {', '.join(sorted(value))}")
        else:
            parts.append(f"{name}: {value}")
    return "; ".join(parts) or "—"


def replay_form_page(
    model_admin: admin.ModelAdmin,
    request: HttpRequest,
    *,
    action: str,
    selected: list[Any],
    what: str,
    start: Callable[[ReplayForm, str], Replay],
) -> HttpResponse:
    """The candidate form for `what` ("3 runs", "cohort refunds-nov"); once submitted and valid, `start` makes the
    replay and the operator is taken to its report. The selection rides along as the admin action's hidden rows."""
    submitted = request.POST.get("confirm") == "yes"
    form = ReplayForm(request.POST if submitted else None)
    if submitted:
        if form.is_valid():
            try:
                made = start(form, request.user.get_username())
            except DurableAgentsError as exc:
                messages.error(request, f"The replay was not started: {exc}")
            else:
                record(request, made, f"Replayed {what} with candidate: {form.summary()}", added=True)
                messages.success(
                    request,
                    f"Replay {str(made.pk)[:8]} of {what} started; its report fills in as its runs finish.",
                )
                return HttpResponseRedirect(reverse("admin:durable_agents_replay_change", args=[made.pk]))
        else:
            messages.error(request, "The replay was not started: correct the fields marked below.")
    context = {
        **model_admin.admin_site.each_context(request),
        "title": f"Replay {what}",
        "opts": model_admin.opts,
        "form": form,
        "what": what,
        "action": action,
        "selected": selected,
        "action_checkbox_name": ACTION_CHECKBOX_NAME,
        "select_across": request.POST.get("select_across", "0"),
    }
    return TemplateResponse(request, "admin/durable_agents/replay/replay_form.html", context)


def _options(form: ReplayForm) -> dict[str, Any]:
    data = form.cleaned_data
    return {
        "candidate": form.candidate(),
        "lanes": tuple(data["lanes"]),
        "stubs": data["stubs"] or None,
        "budget_usd": data["budget_usd"],
        "concurrency": data["concurrency"],
    }


@admin.action(description="Replay selected runs…", permissions=["replay"])
def replay_selected(
    model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Run]
) -> HttpResponse | None:
    """Replay the selected finished runs with a candidate (saved as a new cohort first)."""
    ids = list(queryset.order_by("created_at", "id").values_list("pk", flat=True)[: BULK_LIMIT + 1])
    if len(ids) > BULK_LIMIT:
        messages.error(
            request, f"Select at most {BULK_LIMIT} runs to replay at once; for more, save a cohort (durable_replay)."
        )
        return None
    what = f"{len(ids)} run{'s' if len(ids) != 1 else ''}"

    def start(form: ReplayForm, actor: str) -> Replay:
        return api.replay(runs=ids, actor=actor, **_options(form))

    return replay_form_page(model_admin, request, action="replay_selected", selected=ids, what=what, start=start)


@admin.action(description="Replay the selected cohort…", permissions=["replay"])
def replay_cohort(
    model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[Cohort]
) -> HttpResponse | None:
    """Replay one cohort with a candidate."""
    cohorts = list(queryset.order_by("pk")[:2])
    if len(cohorts) != 1:
        messages.error(request, "Select exactly one cohort to replay.")
        return None
    cohort = cohorts[0]

    def start(form: ReplayForm, actor: str) -> Replay:
        return api.replay(cohort=cohort.name, actor=actor, **_options(form))

    return replay_form_page(
        model_admin, request, action="replay_cohort", selected=[cohort.pk], what=f"cohort {cohort.name}", start=start
    )
