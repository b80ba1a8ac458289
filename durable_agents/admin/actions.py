"""Operator actions on runs: resume, retry the failed step, cancel (with or without compensation),
set the budget, swap the participant, approve or reject a wait, deliver a signal, re-plan (reset) from a step,
fork from a step — one at a time from the run page (`bulk` has the list's).

Each action checks its own permission, confirms what it will do, then calls the public API with the
operator as `actor` (the engine records the event) and logs what it did in the admin's log (`audit`).
No status is written here. Domain errors become admin error messages, never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse

from durable_agents import api
from durable_agents.admin.action_forms import (
    BudgetForm,
    CancelForm,
    DecisionForm,
    ReplanForm,
    ResolveEffectForm,
    RunActionForm,
    SwapForm,
    unresolved_effects,
)
from durable_agents.admin.audit import noted, record
from durable_agents.admin.forbidden import forbidden
from durable_agents.admin.run_forms import ForkForm, SignalForm, deliver, fork, has_open_approval, open_signal_wait
from durable_agents.decisions import describe_closed, wait_label
from durable_agents.engine.records import let_go
from durable_agents.engine.wake import MODEL_BOUND_KINDS
from durable_agents.errors import DurableAgentsError, InvalidInputError, UnknownWorkflowError, WaitClosedError
from durable_agents.models import Run, RunStatus, Step, StepKind, Wait
from durable_agents.operations import concurrency_note
from durable_agents.states import RUN_RULES, RunOp
from durable_agents.workflows import registry

# Bulk actions act on at most this many runs at once; select fewer (filter first) for more.
BULK_LIMIT = 500


def _compensated(run: Run) -> bool:
    """A saga that ran to its end: its effects were undone, so it neither resumes nor retries (fork it)."""
    return bool(run.finish_as) and let_go(run)


# Steps that spend tokens on a participant: a budget or a participant swap changes nothing in a run without one.
# (An approval is model-bound for its queue only when it asks the participant for its brief.)
MODEL_STEP_KINDS = MODEL_BOUND_KINDS - {StepKind.APPROVAL}


def _uses_a_model(run: Run) -> bool:
    """Whether `run`'s workflow has a model step (agent, judge, planner): from the registry, else its plan."""
    try:
        definition = registry.get(run.workflow, run.workflow_version)
    except UnknownWorkflowError:
        return Step.objects.filter(run_id=run.pk, kind__in=MODEL_STEP_KINDS).exists()
    return any(step.kind in MODEL_STEP_KINDS for step in definition.steps)


def _resolve(run: Run, data: dict[str, Any], actor: str) -> Run:
    api.resolve_effect(
        data["effect"], data["outcome"] == "applied", result=data.get("result"), actor=actor, reason=data["reason"]
    )
    return run


def _decide(run: Run, approved: bool, data: dict[str, Any], actor: str) -> Run:
    wait: Wait = data["wait"]  # the wait the form showed, checked to belong to `run`
    try:
        api.decide(wait.pk, approved, by=actor, comment=data.get("comment", ""), via="admin")
    except WaitClosedError as exc:
        # Closed between the form's check and the decision (the API's compare-and-set is the referee).
        raise WaitClosedError(describe_closed(wait)) from exc
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
    # A further condition on the run, beyond its status (one query at most, run page only), and what a refusal
    # for it says ("Deliver signal does not apply: the run waits on no signal").
    when: Callable[[Run], bool] | None = None
    unless: str = ""
    # What happened, said of the run the action returned: "done" only when the change itself is made.
    outcome: Callable[[Run], str] = lambda run: "done"
    # What the audit trail says was done, from the form's data and the run the action returned.
    logged: Callable[[dict[str, Any], Run], str] | None = None
    # Errors in what the operator typed: the form is shown again with it, and the error (nothing is lost).
    keeps_input_on: tuple[type[Exception], ...] = ()
    # The action made a new run (a fork): the operator is taken to it.
    opens_result: bool = False

    def log_message(self, data: dict[str, Any], after: Run) -> str:
        return self.logged(data, after) if self.logged is not None else self.label

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
        # `when` first: the run page then reads the same number of rows whatever the run's status.
        return (self.when is None or self.when(run)) and run.status in self.applies_to


NOT_COMPLETED = tuple(s for s in RunStatus.values if s != RunStatus.COMPLETED)
# Resume continues a failed or cancelled run, or re-wakes a runnable one (the state machine's two operations).
RESUMABLE = tuple(sorted(RUN_RULES[RunOp.RESUME].sources | RUN_RULES[RunOp.WAKE_UP].sources))
CANCELLABLE = tuple(sorted(RUN_RULES[RunOp.CANCEL].sources))
RERUNNABLE = tuple(sorted(RUN_RULES[RunOp.RERUN].sources))


def _scheduled(run: Run) -> str:
    if run.is_queued:  # behind its concurrency key: no worker takes it before a holder ends
        return f"scheduled — {concurrency_note(run)}"
    return "scheduled — a worker will pick the run up"


def cancelled_how(run: Run) -> str:
    """What a cancel did: "done", "compensating" (a saga begun) or "requested" (a worker holds the run)."""
    if run.status == RunStatus.CANCELLED:
        return "done"
    return "compensating" if run.finish_as else "requested"


CANCEL_OUTCOMES = {
    "done": "done — the run is cancelled",
    "compensating": "scheduled — a worker undoes the run's effects, newest first, then it ends cancelled",
    "requested": "requested — the run stops once the step executing now is checkpointed",
}
# The same outcomes, as a bulk cancel reports them ("<verb> 3 runs").
BULK_CANCEL_VERBS = {
    "done": "Cancelled",
    "compensating": "Started undoing the effects (then cancelling) of",
    "requested": "Asked to stop, once the step executing now is checkpointed,",
}


def _cancel_outcome(run: Run) -> str:
    return CANCEL_OUTCOMES[cancelled_how(run)]


def _decided(run: Run) -> str:
    if run.is_queued:
        return f"recorded — {concurrency_note(run)}"
    return "recorded — the run is scheduled to resume; a worker will pick it up"


def _budget_logged(data: dict[str, Any], after: Run) -> str:
    parts = [f"{after.token_budget} tokens" if data.get("tokens") is not None else ""]
    parts.append(f"${after.cost_budget_usd}" if data.get("cost_usd") is not None else "")
    return "Set the budget to " + " and ".join(p for p in parts if p)


def _decision_logged(verb: str) -> Callable[[dict[str, Any], Run], str]:
    return lambda data, after: noted(f"{verb} {wait_label(data['wait'])}", "comment", data.get("comment"))


def _resolve_logged(data: dict[str, Any], after: Run) -> str:
    how = "applied" if data["outcome"] == "applied" else "not applied"
    return noted(f"Recorded effect {data['effect']} as {how}", "reason", data.get("reason"))


def _signal_waits(run: Run) -> bool:
    return open_signal_wait(run) is not None


def _not_compensating(run: Run) -> bool:
    """A run undoing its effects on its way to an end ignores another cancel: the saga goes on (no query)."""
    return not run.finish_as


ACTIONS: dict[str, RunAction] = {
    action.slug: action
    for action in [
        RunAction(
            "resume",
            "Resume",
            "resume_run",
            tuple(s for s in RESUMABLE if s != RunStatus.FAILED),
            "A cancelled run continues at the step it stopped on; a pending or running run is woken again "
            "(safe if its worker is alive: the lease lets only one of them commit).",
            lambda run, data, actor: api.resume(run.pk, actor=actor),
            when=lambda run: not _compensated(run),
            unless="its saga undid its effects: fork it to go on",
            outcome=_scheduled,
            logged=lambda data, after: "Resumed",
        ),
        RunAction(
            "retry",
            "Retry failed step",
            "retry_step",
            (RunStatus.FAILED,),
            "The failed step runs again from attempt 1; committed steps are not repeated.",
            lambda run, data, actor: api.resume(run.pk, actor=actor),
            when=lambda run: not _compensated(run),
            unless="its saga undid its effects: fork it to go on",
            outcome=_scheduled,
            logged=lambda data, after: "Retried the failed step",
        ),
        RunAction(
            "cancel",
            "Cancel",
            "cancel_run",
            CANCELLABLE,
            "The run stops; a step executing now finishes and is checkpointed first. Applied effects stay applied.",
            lambda run, data, actor: api.cancel(run.pk, data.get("reason", ""), compensate=False, actor=actor),
            CancelForm,
            destructive=True,
            when=_not_compensating,
            unless="the run is already compensating on its way to its end; the saga goes on",
            outcome=_cancel_outcome,
            logged=lambda data, after: noted("Cancelled (without compensation)", "reason", data.get("reason")),
        ),
        RunAction(
            "compensate",
            "Cancel and compensate",
            "cancel_run",
            CANCELLABLE,
            "The run undoes its applied effects, newest first, each through its tool's compensating tool "
            "exactly once, then ends cancelled.",
            lambda run, data, actor: api.cancel(run.pk, data.get("reason", ""), compensate=True, actor=actor),
            CancelForm,
            destructive=True,
            when=_not_compensating,
            unless="the run is already compensating on its way to its end; the saga goes on",
            outcome=_cancel_outcome,
            logged=lambda data, after: noted("Cancelled (with compensation)", "reason", data.get("reason")),
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
            when=_uses_a_model,
            unless="the run asks no model",
            logged=_budget_logged,
        ),
        RunAction(
            "swap",
            "Swap participant",
            "swap_participant",
            CANCELLABLE,
            "The next model turn is asked of this participant; earlier turns stay as journaled.",
            lambda run, data, actor: api.swap_participant(run.pk, data["participant"], actor=actor),
            SwapForm,
            when=_uses_a_model,
            unless="the run asks no model",
            logged=lambda data, after: f"Swapped the participant to {data['participant']}",
        ),
        RunAction(
            "approve",
            "Approve",
            "decide_wait",
            (RunStatus.WAITING,),
            "The request shown below is approved with your name and comment; the run wakes and the approved step "
            "runs, unless an observation it depends on has gone stale by then: the run re-reads it and asks again. "
            "If the run has moved on to another request meanwhile, nothing is decided.",
            lambda run, data, actor: _decide(run, True, data, actor),
            DecisionForm,
            # A signal or timer wait is no decision: a signal is delivered ("Deliver signal"), a timer fires.
            when=has_open_approval,
            unless="the run waits on no approval",
            outcome=_decided,
            logged=_decision_logged("Approved"),
        ),
        RunAction(
            "reject",
            "Reject",
            "decide_wait",
            (RunStatus.WAITING,),
            "The request shown below is rejected with your name and comment; the run wakes and takes the "
            "reject path. If the run has moved on to another request meanwhile, nothing is decided.",
            lambda run, data, actor: _decide(run, False, data, actor),
            DecisionForm,
            destructive=True,
            when=has_open_approval,
            unless="the run waits on no approval",
            outcome=_decided,
            logged=_decision_logged("Rejected"),
        ),
        RunAction(
            "replan",
            "Re-plan from a step",
            "replan_run",
            RERUNNABLE,
            "The run executes again from the chosen step: later checkpoints are kept as superseded history, "
            "planner steps plan afresh, and effects already applied are reused, never repeated.",
            lambda run, data, actor: api.resume(run.pk, data["step_id"], actor=actor),
            ReplanForm,
            destructive=True,
            # A saga (compensating, or compensated) is never re-run into: fork it instead.
            when=lambda run: not run.finish_as,
            unless="a saga is never re-run into: fork the run instead",
            outcome=_scheduled,
            logged=lambda data, after: f"Reset to step {data['step_id']} (it and every step after it run again)",
        ),
        RunAction(
            "resolve",
            "Record an effect's outcome",
            "resolve_effect",
            (RunStatus.FAILED, RunStatus.PENDING, RunStatus.RUNNING, RunStatus.CANCELLED),
            "An external call was made but its outcome was never recorded (a crash mid-call, or too many "
            "unanswered tries). Check the receiving system, then record what happened: applied effects are not "
            "called again (and a saga undoes them); effects that did not happen are called again under the same "
            "key. A run that stopped on it resumes from there.",
            _resolve,
            ResolveEffectForm,
            destructive=True,
            when=lambda run: unresolved_effects(run).exists(),
            unless="the run has no effect whose outcome is unknown",
            logged=_resolve_logged,
        ),
        RunAction(
            "signal",
            "Deliver signal",
            "signal_run",
            (RunStatus.WAITING,),
            "The signal, with its JSON payload, is delivered to the wait shown below with your name; the run wakes "
            "and its step's result carries the payload. If the wait closed meanwhile, nothing is sent.",
            deliver,
            SignalForm,
            when=_signal_waits,
            unless="the run waits on no signal",
            outcome=lambda run: _decided(run).replace("recorded", "delivered", 1),
            logged=lambda data, after: f"Delivered signal {data['name']!r}",
            keeps_input_on=(InvalidInputError,),
        ),
        RunAction(
            "fork",
            "Fork from a step",
            "fork_run",
            tuple(RunStatus.values),
            "A new run copies this run's checkpoints before the chosen step and executes from there; this run is "
            "left as it is. With this run's input the fork reuses the effects it applied; with new input it "
            "applies its own.",
            fork,
            ForkForm,
            when=lambda run: not run.replay_lane,
            unless="a replay run is never forked: its fork would be a real run applying the candidate's calls; fork "
            "the recorded run instead",
            outcome=lambda run: f"started run {run.pk}",
            logged=lambda data, after: f"Forked at step {data['step_id']} into run {after.pk}",
            keeps_input_on=(InvalidInputError,),
            opens_result=True,
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
        return forbidden(request, action.permission, f"{action.label.lower()} runs", site=model_admin.admin_site)
    run_url = reverse("admin:durable_agents_run_change", args=[run.pk])
    # A GET may preset fields, as the admin's add page does (the steps table links "Reset to here" with its step).
    initial = (
        {} if request.method == "POST" else {k: v for k, v in request.GET.items() if k in action.form_class.base_fields}
    )
    form = action.form_class(request.POST if request.method == "POST" else None, run=run, initial=initial)
    # Before the status check: "the request you saw was decided by X" says more than "the run is pending".
    stale = form.stale_reason()
    if stale:
        messages.error(request, f"{action.label}: {stale}")
        return HttpResponseRedirect(run_url)
    if not action.applies(run):
        signal = open_signal_wait(run) if action.codename == "decide_wait" else None
        if signal is not None:
            # A page from before the fix, or an address typed by hand: say what to do instead.
            messages.error(
                request,
                f"{action.label} applies to approvals; run {str(run.pk)[:8]} waits for signal {signal.name!r}: "
                "use Deliver signal. Nothing was decided.",
            )
        elif run.status in action.applies_to and action.unless:
            messages.error(request, f"{action.label} does not apply: {action.unless}.")
        else:
            messages.error(request, f"{action.label} does not apply to a {run.status} run.")
        return HttpResponseRedirect(run_url)
    if request.method == "POST" and form.is_valid():
        try:
            after = action.perform(run, form.cleaned_data, request.user.get_username())
        except action.keeps_input_on as exc:
            # What the operator typed is refused (a payload too large, unstorable): shown again, with why.
            form.add_error(None, f"{action.label} refused: {exc}")
        except DurableAgentsError as exc:
            messages.error(request, f"{action.label} failed: {exc}")
            return HttpResponseRedirect(run_url)
        else:
            done = action.log_message(form.cleaned_data, after)
            record(request, run, done)
            if action.opens_result and after.pk != run.pk:
                record(request, after, f"{done} (from run {run.pk})", added=True)
                messages.success(request, f"{action.label}: {action.outcome(after)}, from run {run.pk}.")
                return HttpResponseRedirect(reverse("admin:durable_agents_run_change", args=[after.pk]))
            messages.success(
                request, f"{action.label}: {action.outcome(after)} (run {run.pk}). It is recorded in the run's events."
            )
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
