"""The forms of the run actions: bare, a confirmation; the others ask for what their action needs (a reason, a
budget, a participant, an effect's outcome, a decision on the wait shown, a step to re-plan from)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.db.models import Q

from durable_agents.agents.participants import participants
from durable_agents.decisions import (
    AskedAgain,
    asked_again,
    describe_closed,
    stale_before_approved,
    stale_text,
    wait_label,
)
from durable_agents.engine.plans import StaleObservation
from durable_agents.models import EffectKind, EffectStatus, Run, Step, Wait
from durable_agents.storable import BIGINT_MAX


class RunActionForm(forms.Form):
    """An action's form; bare, it is a confirmation. `wait_verb`: what the operator does to the wait it shows."""

    wait_verb = "decide"

    def __init__(self, *args: Any, run: Run | None = None, **kwargs: Any) -> None:
        self.run = run
        super().__init__(*args, **kwargs)

    def stale_reason(self) -> str | None:
        """Why what this form showed no longer holds (then nothing is done), or None."""
        return None


def comment_field(help_text: str) -> forms.CharField:
    """The comment recorded with a decision (or a cancel's reason): optional, bounded, a small text area."""
    return forms.CharField(
        required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 3, "cols": 70}), help_text=help_text
    )


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


def unresolved_effects(run: Run) -> Any:
    """The run's effects whose outcome nobody knows: external calls invoked without a recorded outcome."""
    return (
        run.effects.filter(kind=EffectKind.EFFECT)
        .filter(Q(status=EffectStatus.PENDING, attempts__gt=0) | ~Q(needs_attention=""))
        .exclude(status__in=(EffectStatus.APPLIED, EffectStatus.COMPENSATED))
    )


class ResolveEffectForm(RunActionForm):
    effect = forms.ChoiceField(label="Effect", help_text="Invoked with no recorded outcome.")
    outcome = forms.ChoiceField(
        choices=[("applied", "It was applied (the receiving system did it)"), ("failed", "It was not applied")],
        widget=forms.RadioSelect,
    )
    result = forms.JSONField(
        required=False, label="Result (JSON)", help_text="If applied: what the receiving system returned."
    )
    reason = forms.CharField(
        max_length=1000,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 70}),
        help_text="How you know (for example: checked in the payment provider's dashboard). Recorded with your name.",
    )

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        self.fields["effect"].choices = [
            (e.idempotency_key, f"{e.tool}({e.args}) — key {e.idempotency_key}, {e.attempts} invocation(s)")
            for e in unresolved_effects(run)
        ]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("outcome") == "failed" and data.get("result") not in (None, ""):
            raise forms.ValidationError("An effect that was not applied has no result: leave Result empty.")
        return data


def stale_decision(wait: Wait, shown_args_hash: str | None) -> str | None:
    """Why a decision form showing `wait` (and, for a tool call, the arguments hashing to `shown_args_hash`)
    must decide nothing now, or None. Every decision form of the console checks this before deciding; the
    API's compare-and-set is the last referee."""
    if not wait.is_open:
        return describe_closed(wait)
    if shown_args_hash is not None and shown_args_hash != wait.args_hash:
        return (
            f"{wait_label(wait)} asks for another call than the one your page showed; nothing was decided. "
            "Read it again, then decide."
        )
    return None


class DecisionForm(RunActionForm):
    """Approve or reject the one wait this form showed; its id travels with the form.

    The form is bound to a wait, never to "whatever is open when it is posted": a run can close the wait
    shown and open another (a larger refund, say) while the operator reads, and a decision must not land
    on a request its decider never saw.
    """

    wait = forms.IntegerField(required=False, widget=forms.HiddenInput)
    # The arguments shown (a tool approval's hash): a form whose call changed decides nothing.
    args_hash = forms.CharField(required=False, widget=forms.HiddenInput)
    comment = comment_field("Recorded with the decision.")

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        self.asked_again: AskedAgain | None = None
        self.gone_stale: StaleObservation | None = None
        if self.is_bound:
            # Only a wait of this run: a form edited to name another run's wait decides nothing.
            posted = str(self.data.get("wait", ""))
            self.shown_wait = Wait.objects.filter(run=run, pk=int(posted)).first() if posted.isdecimal() else None
        else:
            self.shown_wait = Wait.objects.open().filter(run=run).first()
            self.fields["wait"].initial = self.shown_wait.pk if self.shown_wait else None
            self.fields["args_hash"].initial = self.shown_wait.args_hash if self.shown_wait else ""
        if self.shown_wait is not None:
            self.fields["brief"] = forms.CharField(
                required=False,
                disabled=True,
                initial=self.shown_wait.brief or self.shown_wait.question,
                label=self.shown_wait.question[:80] or wait_label(self.shown_wait),
                widget=forms.Textarea(attrs={"rows": 14, "cols": 90}),
            )
            self.order_fields(["wait", "args_hash", "brief", "comment"])
            # Said before deciding: the request was asked again, or an observation its step needs went stale.
            self.asked_again = asked_again([self.shown_wait]).get(self.shown_wait.pk)
            self.gone_stale = stale_before_approved(self.shown_wait)

    @property
    def gone_stale_text(self) -> str:
        """`observe (fresh for 10 min) has gone stale: approved now, refund does not run yet; …`."""
        if self.gone_stale is None or self.shown_wait is None or self.shown_wait.step is None:
            return ""
        step = self.shown_wait.step.step_id
        return (
            f"{stale_text(self.gone_stale)}: approved now, {step} does not run yet; the run re-reads it and asks again."
        )

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.shown_wait is None:
            raise forms.ValidationError(
                "This form names no request of this run; open the run page again and choose the action there."
            )
        data["wait"] = self.shown_wait
        return data

    def stale_reason(self) -> str | None:
        if self.shown_wait is None:
            return None
        # Forms rendered before the hash travelled with them post none: the wait id alone binds those.
        shown = self.data.get("args_hash") if self.is_bound and "args_hash" in self.data else None
        return stale_decision(self.shown_wait, shown)


class ReplanForm(RunActionForm):
    step_id = forms.ChoiceField(label="From step", help_text="This step and all after it execute again.")

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        steps = Step.objects.live().filter(run=run).order_by("position").values_list("step_id", "status")
        self.fields["step_id"].choices = [(step_id, f"{step_id} ({status})") for step_id, status in steps]
