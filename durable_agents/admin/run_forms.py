"""The forms of the run actions that take JSON from the operator: deliver a signal, fork a run from a step.

JSON is parsed here so a mistake is shown on the form, with the text as typed and where it broke, never a
traceback; what the payload may hold (storable, within the size limit) is the API's to say.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms

from durable_agents import api
from durable_agents.admin.action_forms import RunActionForm
from durable_agents.decisions import describe_closed
from durable_agents.errors import WaitClosedError
from durable_agents.models import Run, Step, StepKind, StepStatus, Wait, WaitKind

# What a JSON text field left empty means: no payload (None), or the source run's input for a fork.
EMPTY = ""


def parse_json(text: str, what: str) -> Any:
    """`text` as JSON, or a ValidationError that says where it broke; empty text is None."""
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise forms.ValidationError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}. "
            'Write JSON, e.g. {"paid": true} or "text in double quotes"; nothing was sent.'
        ) from exc
    except RecursionError as exc:
        raise forms.ValidationError(f"{what} nests too deeply to be read; nothing was sent.") from exc


def open_signal_wait(run: Run) -> Wait | None:
    """The signal wait `run` parks on, if any (read once per run object: the run page asks several actions)."""
    cached = getattr(run, "_durable_open_wait", False)
    if cached is False:
        cached = Wait.objects.open().filter(run=run).order_by("-id").first()
        run._durable_open_wait = cached  # type: ignore[attr-defined]
    return cached if cached is not None and cached.kind == WaitKind.SIGNAL else None


def has_open_approval(run: Run) -> bool:
    """Whether `run` waits on a decision (approve or reject); a signal or timer wait is no decision."""
    open_signal_wait(run)  # reads and keeps the open wait
    wait = run._durable_open_wait  # type: ignore[attr-defined]
    return wait is not None and wait.kind == WaitKind.APPROVAL


class SignalForm(RunActionForm):
    """Deliver a signal to the signal wait this form showed; its id travels with the form, and its name is the wait's
    own (shown, not typed: a typo would deliver a signal nothing waits for)."""

    wait_verb = "deliver to"
    wait = forms.IntegerField(required=False, widget=forms.HiddenInput)
    name = forms.CharField(max_length=200, label="Signal", help_text="The name the run waits for.")
    payload = forms.CharField(
        required=False,
        label="Payload (JSON)",
        widget=forms.Textarea(attrs={"rows": 8, "cols": 70, "class": "durable-mono"}),
        help_text='The step\'s result carries it, e.g. {"paid": true}. Leave empty for none.',
    )

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        if self.is_bound:
            posted = str(self.data.get("wait", ""))
            signal_waits = Wait.objects.filter(run=run, kind=WaitKind.SIGNAL)
            self.shown_wait = signal_waits.filter(pk=int(posted)).first() if _a_key(posted) else None
        else:
            self.shown_wait = open_signal_wait(run)
        # Shown, never typed nor preset by a link: the wait's own id and name (a disabled field takes its initial
        # value, whatever is posted).
        self.initial.pop("wait", None)
        self.initial.pop("name", None)
        if self.shown_wait is not None:
            self.initial.update(wait=self.shown_wait.pk, name=self.shown_wait.name)
        self.fields["name"].disabled = True

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.shown_wait is None:
            raise forms.ValidationError(
                "This form names no signal wait of this run, so nothing was sent: open Deliver signal from the run's "
                "page again."
            )
        data["wait"] = self.shown_wait  # checked to belong to this run
        return data

    def clean_payload(self) -> Any:
        return parse_json(self.cleaned_data.get("payload", EMPTY), "The payload")

    def stale_reason(self) -> str | None:
        # A second submit of the same form finds its wait closed by the first: it says so and sends nothing.
        if self.shown_wait is not None and not self.shown_wait.is_open:
            return describe_closed(self.shown_wait).replace("nothing was decided", "nothing was sent")
        return None


def deliver(run: Run, data: dict[str, Any], actor: str) -> Run:
    wait: Wait = data["wait"]
    # To the wait shown only (the API's compare-and-set under the run's lock): a double submit delivers once.
    try:
        api.send_signal(run.pk, wait.name, data["payload"], by=actor, wait_id=wait.pk)
    except WaitClosedError as exc:
        raise WaitClosedError(describe_closed(wait).replace("nothing was decided", "nothing was sent")) from exc
    return run


def _a_key(text: str) -> bool:
    """A primary key Postgres can look up: digits, and within a bigint (a longer number is no row, not an error)."""
    return text.isdecimal() and len(text) < 19


def forkable_steps(steps: list[Step]) -> list[Step]:
    """The steps a fork may start at: the forward plan up to its first step without a checkpoint (every step
    before the fork's first must have one; the API checks again)."""
    forward = sorted(
        (s for s in steps if s.status != StepStatus.SUPERSEDED and s.kind != StepKind.COMPENSATE),
        key=lambda s: s.position,
    )
    shown = []
    for step in forward:
        shown.append(step)
        if step.status != StepStatus.DONE:
            break
    return shown


class ForkForm(RunActionForm):
    step_id = forms.ChoiceField(label="Fork at step", help_text="The new run executes this step and all after it.")
    input = forms.CharField(
        required=False,
        label="New input (JSON)",
        widget=forms.Textarea(attrs={"rows": 6, "cols": 70, "class": "durable-mono"}),
        help_text="Leave empty to keep this run's input (the fork then reuses the effects it applied).",
    )

    def __init__(self, *args: Any, run: Run, **kwargs: Any) -> None:
        super().__init__(*args, run=run, **kwargs)
        steps = list(Step.objects.live().filter(run=run).defer("context", "result").order_by("position"))
        self.fields["step_id"].choices = [(s.step_id, f"{s.step_id} ({s.status})") for s in forkable_steps(steps)]

    def clean_input(self) -> Any:
        return parse_json(self.cleaned_data.get("input", EMPTY), "The new input")


def fork(run: Run, data: dict[str, Any], actor: str) -> Run:
    return api.fork(run.pk, data["step_id"], input=data.get("input"), actor=actor)
