"""Briefs for humans: why a decision matters, what happened so far, what each answer does, what changed.

The deterministic template here is the fallback and the default; an approval step may ask its
participant to write the brief instead (journaled as a Turn with purpose "brief").
"""

from __future__ import annotations

import json
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.utils.timesince import timesince

from durable_agents import clock
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
        f"Run {run.id} ({run.workflow} v{run.workflow_version}), started {run.created_at:%Y-%m-%d %H:%M} UTC.",
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


BRIEF_SYSTEM = (
    "You write decision briefs for busy people who return to a request days later. From the record below, "
    "write at most 150 words: why this decision matters, what happened so far, exactly what happens on "
    "approve and on reject. Plain text, no preamble."
)


def participant_brief(ctx: Any, record: str) -> str:
    """The brief written by the run's participant (journaled as a Turn, purpose "brief"); the template
    `record` itself if the participant fails or says nothing. A re-executed step reuses the journaled one.
    """
    from durable_agents.agents.participants import ModelRequest, participants
    from durable_agents.conf import settings
    from durable_agents.engine.events import record_event
    from durable_agents.judge import journal_call
    from durable_agents.models import Turn

    turn = Turn.objects.filter(step_id=ctx.step.pk, purpose="brief").order_by("-index").first()
    if turn is None:
        try:
            answerer = participants.get(ctx.run.participant or settings.DEFAULT_PARTICIPANT)
            request = ModelRequest(
                model=settings.DEFAULT_MODEL,
                max_tokens=400,
                system=BRIEF_SYSTEM,
                tools=[],
                messages=[{"role": "user", "content": record}],
                metadata={"user_id": f"{ctx.run_id}:{ctx.step_id}"},
            )
            ctx.ensure_lease()
            turn = journal_call(ctx, "brief", request, answerer.respond(request), answerer.name)
        except Exception as exc:  # noqa: BLE001 - a brief is a courtesy: never fail the run for it
            record_event(ctx.run_id, "brief_fallback", step_id=ctx.step_id, error=str(exc)[:500])
            return record
    text = "".join(block.get("text", "") for block in turn.content if block.get("type") == "text").strip()
    return f"{text}\n\n---\n{record}" if text else record


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


SUBJECTS = {
    "requested": "Approval needed: {name}",
    "reminder": "Reminder {number}: approval still needed: {name}",
    "warning": "Deadline soon: {name}",
    "escalation": "Escalated: {name} was not decided in time",
    "expired": "Deadline passed: {name}",
}


def notification_for(wait: Wait, kind: str, number: int = 1) -> Notification:
    from durable_agents.links import decision_url

    name = wait.name or f"{wait.kind} {wait.pk}"
    body = wait.brief or wait.question
    if kind in ("reminder", "warning", "escalation"):
        body = f"{changes_since(wait)}\n\n{body}"
    if wait.deadline and kind != "expired":
        body = f"Deadline: {wait.deadline:%Y-%m-%d %H:%M} UTC\n\n{body}"
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
        link=decision_url(wait) if kind != "expired" else "",
    )
