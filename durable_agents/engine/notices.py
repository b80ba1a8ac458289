"""What humans are told: decision briefs built from a run's own records, and the notifications about waits.

The template brief is deterministic (the default, and the fallback when a participant writes the brief);
approval steps built above the engine may ask their participant for a richer one.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils.timesince import timesince

from durable_agents import clock
from durable_agents.display import when_text
from durable_agents.links import decision_url
from durable_agents.models import Effect, EffectStatus, Event, Run, Step, StepStatus, Wait
from durable_agents.notify import Notification

RECENT_STEPS = 10


def short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, cls=DjangoJSONEncoder, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def template_brief(run: Run, *, question: str, on_approve: str, on_reject: str, context: str = "") -> str:
    """A brief a human can decide from after three days away, built from the run's own records."""
    done = list(Step.objects.filter(run_id=run.id, status=StepStatus.DONE).order_by("-position")[:RECENT_STEPS])[::-1]
    applied = list(Effect.objects.filter(run_id=run.id, status=EffectStatus.APPLIED, kind="effect").order_by("id")[:10])
    lines = [
        f"Decision needed: {question}",
        "",
        f"Run {run.id} ({run.workflow} v{run.workflow_version}), started {when_text(run.created_at)}.",
        f"Input: {short(run.input, 300)}",
    ]
    if context:
        lines += ["", context]
    lines += ["", "What happened so far:"]
    lines += [f"  - {s.step_id}: {short(s.result)}" for s in done] or ["  - nothing yet"]
    if applied:
        lines += ["", "Changes already made:"]
        lines += [f"  - {e.tool}({short(e.args, 120)})" for e in applied]
    lines += ["", f"If you approve: {on_approve}", f"If you reject: {on_reject}"]
    return "\n".join(lines)


def changes_since(wait: Wait) -> str:
    """What happened to the run since the wait opened (for reminders)."""
    events = list(
        Event.objects.filter(run_id=wait.run_id, created_at__gt=wait.created_at)
        .exclude(kind__in=["wait_reminder", "wait_warning"])
        .order_by("id")[:10]
    )
    age = timesince(wait.created_at, clock.now())
    if not events:
        return f"Opened {age} ago; nothing else has changed since."
    return f"Opened {age} ago. Since then: " + "; ".join(f"{e.kind} {e.step_id}".strip() for e in events)


# {name}: the workflow, the run's short id and what is asked, e.g. "refund_agent run 3f2a9c1e — issue_refund".
SUBJECTS = {
    "requested": "Approval needed: {name}",
    "reminder": "Reminder {number}: approval still needed: {name}",
    "warning": "Deadline soon: {name}",
    "escalation": "Escalated: {name} was not decided in time",
    "expired": "Deadline passed: {name}",
}


def subject_name(wait: Wait) -> str:
    """Which request a subject line is about, told apart in an inbox: workflow, run and the tool or approval."""
    workflow = Run.objects.filter(pk=wait.run_id).values_list("workflow", flat=True).first() or "run"
    return f"{workflow} run {str(wait.run_id)[:8]} — {wait.name or f'{wait.kind} {wait.pk}'}"


def notification_for(wait: Wait, kind: str, number: int = 1, *, link: bool = True) -> Notification:
    """The message of one notification about `wait`: the brief, what changed since, and the decision link (unless
    `link` is False). DecisionLinkError if the link cannot be made on this site."""
    name = subject_name(wait)
    body = wait.brief or wait.question
    if kind in ("reminder", "warning", "escalation"):
        body = f"{changes_since(wait)}\n\n{body}"
    if wait.deadline and kind != "expired":
        body = f"Deadline: {when_text(wait.deadline)}\n\n{body}"
    recipients = list(wait.notify_to)
    if kind == "escalation" and wait.escalate_to:
        recipients.append(wait.escalate_to)
    return Notification(
        kind=kind,
        wait_id=wait.pk,
        run_id=str(wait.run_id),
        recipients=tuple(recipients),
        subject=SUBJECTS.get(kind, "{name}").format(name=name, number=number),
        body=body,
        link=decision_url(wait) if link and kind != "expired" else "",
    )
