"""Durable waits as steps: approvals, signals and timers (durable sleep). Export through `api`.

Example::

    workflow("payout", steps=[
        call("prepare", prepare),
        approval("approve", question="Pay out the amount?", on_approve="the payout is sent",
                 on_reject="nothing is paid", deadline=timedelta(days=3), remind_every=timedelta(days=1)),
        wait_for_signal("bank_ack", signal="bank.confirmed", timeout=timedelta(hours=6)),
        sleep("cool_off", seconds=3600),
        call("pay", pay),
    ])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from durable_agents import clock
from durable_agents.agents.journal import ask, journal_call
from durable_agents.agents.messages import ModelRequest
from durable_agents.agents.participants import participants
from durable_agents.conf import settings
from durable_agents.engine.control import Park, WaitSpec
from durable_agents.engine.events import record_event
from durable_agents.engine.notices import template_brief
from durable_agents.engine.retry import error_of
from durable_agents.engine.waits import latest_wait, take_buffered_signal
from durable_agents.errors import ApprovalRejectedError, DefinitionError, LeaseLostError, WaitExpiredError
from durable_agents.models import DeadlinePolicy, StepKind, Turn, WaitKind, WaitStatus
from durable_agents.workflows import StepDef

REJECT_ROUTES = ("fail", "continue")


def approval(
    name: str,
    *,
    question: str,
    on_approve: str = "the run continues",
    on_reject: str = "the run stops",
    reject: str = "fail",
    deadline: timedelta | None = None,
    on_deadline: str = DeadlinePolicy.REJECT,
    escalate_to: str = "",
    warn_before: timedelta | None = None,
    remind_every: timedelta | None = None,
    notify_to: Sequence[str] = (),
    brief: Callable[[Any], str] | str = "template",
) -> StepDef:
    """A human approves or rejects before the run goes on. `reject="continue"` hands the decision to later
    steps (the result has `approved: False`); `"fail"` stops the run with ApprovalRejectedError.

    `brief` is "template" (built from the run's records), "participant" (the run's model writes it from
    those records, journaled; the template if it fails) or a function of the step context.
    """
    if isinstance(brief, str) and brief not in ("template", "participant"):
        raise DefinitionError(f"approval {name!r}: brief must be 'template', 'participant' or a callable")
    if reject not in REJECT_ROUTES:
        raise DefinitionError(f"approval {name!r}: reject must be one of {REJECT_ROUTES}, got {reject!r}")
    if on_deadline not in DeadlinePolicy.values:
        raise DefinitionError(f"approval {name!r}: on_deadline must be one of {DeadlinePolicy.values}")
    if on_deadline == DeadlinePolicy.ESCALATE and not escalate_to:
        raise DefinitionError(f"approval {name!r}: on_deadline='escalate' needs escalate_to")

    def run(ctx: Any) -> dict[str, Any]:
        wait = latest_wait(ctx.step, kind=WaitKind.APPROVAL, name=name)
        if wait is None or wait.status == WaitStatus.CANCELLED:
            if callable(brief):
                text = brief(ctx)
            else:
                text = template_brief(ctx.run, question=question, on_approve=on_approve, on_reject=on_reject)
                if brief == "participant":
                    text = participant_brief(ctx, text)
            raise Park(
                WaitSpec(
                    kind=WaitKind.APPROVAL,
                    name=name,
                    question=question,
                    brief=text,
                    deadline=clock.now() + deadline if deadline else None,
                    on_deadline=on_deadline,
                    escalate_to=escalate_to,
                    warn_before=warn_before,
                    remind_every=remind_every,
                    notify_to=tuple(notify_to),
                )
            )
        decision = {
            "approved": wait.status == WaitStatus.APPROVED,
            "by": wait.decided_by,
            "comment": (wait.decision or {}).get("comment", ""),
            "wait": wait.pk,
        }
        if not decision["approved"] and reject == "fail":
            raise ApprovalRejectedError(f"{name} was rejected by {wait.decided_by}: {decision['comment']}".rstrip(": "))
        return decision

    return StepDef(name=name, kind=StepKind.APPROVAL, fn=run)


def wait_for_signal(
    name: str, *, signal: str | None = None, timeout: timedelta | None = None, on_timeout: str = "fail"
) -> StepDef:
    """Wait until `send_signal(run_id, signal, payload)` arrives (before or after the step starts);
    the step's result is the payload. `on_timeout`: "fail" the run, or "continue" with `timed_out: True`.
    """
    signal_name = signal or name
    if on_timeout not in REJECT_ROUTES:
        raise DefinitionError(f"signal step {name!r}: on_timeout must be one of {REJECT_ROUTES}")

    def run(ctx: Any) -> dict[str, Any]:
        wait = latest_wait(ctx.step, kind=WaitKind.SIGNAL, name=signal_name) or take_buffered_signal(
            ctx.step, signal_name, token=ctx.lease_token
        )
        if wait is None or wait.status == WaitStatus.CANCELLED:
            raise Park(
                WaitSpec(
                    kind=WaitKind.SIGNAL,
                    name=signal_name,
                    question=f"waiting for signal {signal_name!r}",
                    deadline=clock.now() + timeout if timeout else None,
                    on_deadline=DeadlinePolicy.REJECT,
                )
            )
        if wait.status != WaitStatus.APPROVED:
            if on_timeout == "fail":
                raise WaitExpiredError(f"signal {signal_name!r} did not arrive within {timeout}")
            return {"timed_out": True, "payload": None}
        return {"timed_out": False, "payload": (wait.decision or {}).get("payload"), "by": wait.decided_by}

    return StepDef(name=name, kind=StepKind.SIGNAL, fn=run)


def sleep(name: str, *, seconds: float | None = None, until: Callable[[Any], datetime] | None = None) -> StepDef:
    """A durable timer: the run waits (holding nothing) until the time passes; the sweep wakes it."""
    if (seconds is None) == (until is None):
        raise DefinitionError(f"sleep {name!r}: give seconds or until, not both")

    def run(ctx: Any) -> dict[str, Any]:
        wait = latest_wait(ctx.step, kind=WaitKind.TIMER, name=name)
        if wait is None or wait.status == WaitStatus.CANCELLED:
            fire_at = until(ctx) if until else clock.now() + timedelta(seconds=seconds or 0)
            raise Park(
                WaitSpec(
                    kind=WaitKind.TIMER,
                    name=name,
                    question=f"sleeping until {fire_at:%Y-%m-%d %H:%M:%S}",
                    deadline=fire_at,
                )
            )
        return {"fired_at": wait.decided_at.isoformat() if wait.decided_at else None}

    return StepDef(name=name, kind=StepKind.TIMER, fn=run)


BRIEF_SYSTEM = (
    "You write decision briefs for busy people who return to a request days later. From the record below, "
    "write at most 150 words: why this decision matters, what happened so far, exactly what happens on "
    "approve and on reject. Plain text, no preamble."
)


def participant_brief(ctx: Any, record: str) -> str:
    """The brief written by the run's participant (journaled as a Turn, purpose "brief"); the template
    `record` itself if the participant fails or says nothing. A re-executed step reuses the journaled one.
    """
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
                step_key=str(ctx.step.pk),
            )
            turn = journal_call(ctx, "brief", request, ask(ctx, answerer, request), answerer.name)
        except LeaseLostError:
            raise  # a zombie: it writes nothing, not even the fallback's event
        except Exception as exc:  # noqa: BLE001 - a brief is a courtesy: never fail the run for it
            record_event(ctx.run_id, "brief_fallback", step_id=ctx.step_id, error=error_of(exc, 500))
            return record
    text = "".join(block.get("text", "") for block in turn.content if block.get("type") == "text").strip()
    return f"{text}\n\n---\n{record}" if text else record
