"""Tool approvals: an effectful call marked `needs_approval` parks its run for a human before it runs.

An approval authorises exactly the call it showed — the tool and its checked arguments (their hash),
made by this step (its plan row) under this idempotency key. A call with other arguments (say, after a
re-plan re-read the order) asks again; so does a re-planned step (a new plan row). A rejected or expired
decision stops governing its step once an operator resumes or re-plans it (the step may ask again).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.engine.control import Park, WaitSpec
from durable_agents.engine.notices import short, template_brief
from durable_agents.errors import ApprovalRejectedError
from durable_agents.models import Effect, EffectStatus, Step, Wait, WaitKind, WaitStatus
from durable_agents.tools import Tool


def require_approval(ctx: Any, tool: Tool[..., Any], args: Any, key: str, *, always: bool = False) -> None:
    """Gate an effectful tool call: park for a human first, proceed once this exact call is approved.

    A rejection raises ApprovalRejectedError: an agent sees it as an is_error tool result (its reject
    path); a plain step fails with it.
    """
    checked = tool.validate(args)
    if not always and not tool.is_approval_required(checked):
        return
    if Effect.objects.filter(idempotency_key=key, status=EffectStatus.APPLIED).exists():
        # Applied before (approved then): invoking returns its result, or refuses other arguments.
        return
    args_hash = tool.args_hash(checked)
    wait = (
        governing(Wait.objects.filter(step_id=ctx.step.pk, kind=WaitKind.APPROVAL, effect_key=key, args_hash=args_hash))
        .order_by("-id")
        .first()
    )
    if wait is None or wait.status == WaitStatus.CANCELLED:
        question = f"Allow {tool.name}({short(checked, 200)})?"
        raise Park(
            WaitSpec(
                kind=WaitKind.APPROVAL,
                name=tool.name,
                effect_key=key,
                args_hash=args_hash,
                question=question,
                brief=template_brief(
                    ctx.run,
                    question=question,
                    context=f"Requested by step {ctx.step_id}: {tool.description}",
                    on_approve=f"{tool.name} runs once with exactly these arguments",
                    on_reject=f"{tool.name} does not run",
                ),
                deadline=clock.now() + timedelta(seconds=settings.APPROVAL_DEADLINE_SECONDS)
                if settings.APPROVAL_DEADLINE_SECONDS
                else None,
            )
        )
    if wait.status != WaitStatus.APPROVED:
        comment = (wait.decision or {}).get("comment", "")
        raise ApprovalRejectedError(f"{tool.name} was rejected by {wait.decided_by or 'the deadline'}: {comment}")


def governing(waits: Any) -> Any:
    """The waits that still decide their step: not retired by a resume or re-plan."""
    return waits.filter(retired=False)


def latest_wait(step: Step, *, kind: str, name: str) -> Wait | None:
    """The newest wait this step opened under `name` that still governs it."""
    return governing(Wait.objects.filter(step_id=step.pk, kind=kind, name=name)).order_by("-id").first()
