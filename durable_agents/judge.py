"""Judge steps (LLM-as-judge): a verdict against a rubric, snapshotted so a retry replays it, never re-asks.

The judge asks the run's participant to call one forced tool, `submit_verdict`; the response is
journaled (Turn, purpose "judge") before it is acted on. A failing verdict routes as declared: fail the
run, redo an earlier step with the judge's reasons as feedback (`ctx.feedback()`, bounded), or ask a
human whether to accept it anyway.

Example::

    judge("review_email", rubric="Polite, accurate, states the refunded amount.",
          subject=lambda ctx: ctx.result("resolve")["text"], on_fail="redo", redo_step="resolve")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F, Max

from durable_agents import clock
from durable_agents.agents.loop import count_unjournaled, create_turn, usage_counters
from durable_agents.agents.participants import ModelRequest, ModelResponse, Participant, participants
from durable_agents.agents.pricing import cost_usd
from durable_agents.conf import settings
from durable_agents.engine.plans import Rerun
from durable_agents.engine.waits import Park, WaitSpec, latest_wait
from durable_agents.errors import DefinitionError, LeaseLostError, PermanentError
from durable_agents.models import Run, Step, StepKind, StepStatus, Turn, WaitKind, WaitStatus
from durable_agents.workflows import StepDef

ROUTES = ("fail", "redo", "ask_human")
VERDICT_TOOL = {
    "name": "submit_verdict",
    "description": "Submit your verdict on the subject, judged against the rubric.",
    "input_schema": {
        "type": "object",
        "properties": {
            "passed": {"type": "boolean", "description": "true if the subject meets the rubric"},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "string", "description": "what is right or wrong, concretely"},
        },
        "required": ["passed", "score", "reasons"],
        "additionalProperties": False,
    },
}
SYSTEM = (
    "You are a strict reviewer. Judge the subject only against the rubric below, then call submit_verdict "
    "once. Be concrete in your reasons: they are sent back to the author.\n\nRubric:\n"
)


class JudgeFailedError(PermanentError):
    """The judge's verdict failed the subject."""


@dataclass(frozen=True)
class ForcedToolRequest(ModelRequest):
    """A model request that forces one tool (the judge's verdict, a planner's plan)."""

    tool_choice: Mapping[str, Any] | None = None

    def as_kwargs(self) -> dict[str, Any]:
        kwargs = super().as_kwargs()
        if self.tool_choice:
            kwargs["tool_choice"] = dict(self.tool_choice)
        return kwargs


def judge(
    name: str,
    *,
    rubric: str,
    subject: Callable[[Any], str],
    on_fail: str = "fail",
    redo_step: str | None = None,
    max_redos: int = 2,
    participant: str | Participant | None = None,
    model: str | None = None,
    max_tokens: int = 512,
) -> StepDef:
    """A judge step; its result is {"passed", "score", "reasons"} (plus "overridden_by" if a human accepted)."""
    if on_fail not in ROUTES:
        raise DefinitionError(f"judge {name!r}: on_fail must be one of {ROUTES}, got {on_fail!r}")
    if on_fail == "redo" and not redo_step:
        raise DefinitionError(f"judge {name!r}: on_fail='redo' needs redo_step")

    def run(ctx: Any) -> dict[str, Any]:
        verdict = _verdict(ctx, _snapshot(ctx) or _ask(ctx, rubric, subject(ctx), participant, model, max_tokens))
        if verdict["passed"]:
            return verdict
        if on_fail == "redo":
            redone = Step.objects.filter(run_id=ctx.run_id, step_id=ctx.step_id, status=StepStatus.SUPERSEDED).count()
            if redone < max_redos:
                raise Rerun(redo_step, verdict["reasons"], verdict)
        if on_fail == "ask_human":
            return _ask_human(ctx, name, verdict)
        raise JudgeFailedError(f"{name} failed (score {verdict['score']}): {verdict['reasons']}")

    return StepDef(name=name, kind=StepKind.JUDGE, fn=run, options={"rubric": rubric})


def _snapshot(ctx: Any) -> Turn | None:
    return Turn.objects.filter(step_id=ctx.step.pk, purpose="judge").order_by("-index").first()


def _ask(ctx: Any, rubric: str, text: str, participant: Any, model: str | None, max_tokens: int) -> Turn:
    chosen = ctx.run.participant or participant or settings.DEFAULT_PARTICIPANT
    answerer = participants.get(chosen) if isinstance(chosen, str) else chosen
    request = ForcedToolRequest(
        model=model or settings.DEFAULT_MODEL,
        max_tokens=max_tokens,
        system=SYSTEM + rubric,
        tools=[VERDICT_TOOL],
        messages=[{"role": "user", "content": f"Subject to review:\n\n{text}"}],
        metadata={"user_id": f"{ctx.run_id}:{ctx.step_id}"},
        tool_choice={"type": "tool", "name": "submit_verdict"},
    )
    ctx.ensure_lease()
    return journal_call(ctx, "judge", request, answerer.respond(request), answerer.name)


def _verdict(ctx: Any, turn: Turn) -> dict[str, Any]:
    for block in turn.content:
        if block.get("type") == "tool_use" and block.get("name") == "submit_verdict":
            data = block.get("input") or {}
            if isinstance(data.get("passed"), bool):
                return {"passed": data["passed"], "score": data.get("score"), "reasons": str(data.get("reasons", ""))}
    raise PermanentError(f"judge {ctx.step_id} answered without a verdict (stop_reason {turn.stop_reason})")


def _ask_human(ctx: Any, name: str, verdict: dict[str, Any]) -> dict[str, Any]:
    wait = latest_wait(ctx.step, kind=WaitKind.APPROVAL, name=f"{name}:override")
    if wait is None or wait.status == WaitStatus.CANCELLED:
        raise Park(
            WaitSpec(
                kind=WaitKind.APPROVAL,
                name=f"{name}:override",
                question=f"The reviewer failed this ({verdict['reasons']}). Accept it anyway?",
                brief=f"Reviewer verdict: score {verdict['score']}.\nReasons: {verdict['reasons']}\n\n"
                f"If you approve: the run continues as if the review passed.\nIf you reject: the run fails.",
            )
        )
    if wait.status == WaitStatus.APPROVED:
        return {**verdict, "overridden_by": wait.decided_by}
    raise JudgeFailedError(
        f"{name} failed and {wait.decided_by or 'the deadline'} did not accept it: {verdict['reasons']}"
    )


def journal_call(ctx: Any, purpose: str, request: ModelRequest, response: ModelResponse, participant: str) -> Turn:
    """Journal a one-off model call of a step (judge, planner) with its usage, fenced by the lease token."""
    cost = cost_usd(response.model, response.usage)
    counters = usage_counters(response.usage)
    last = Turn.objects.filter(step_id=ctx.step.pk).aggregate(last=Max("index"))["last"]
    index = 0 if last is None else last + 1
    try:
        with transaction.atomic():
            if not Run.objects.filter(pk=ctx.run_id, lease_token=ctx.lease_token).update(
                cost_usd=F("cost_usd") + cost, updated_at=clock.now(), **counters
            ):
                raise LeaseLostError()
            Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters)
            return create_turn(ctx, index, purpose, request, response, participant, cost)
    except LeaseLostError:
        count_unjournaled(ctx, index, response.usage, cost, "lease lost")
        raise
    except IntegrityError as exc:
        count_unjournaled(ctx, index, response.usage, cost, "journaled by another worker")
        raise LeaseLostError(f"{purpose} call of step {ctx.step_id} was journaled by another worker") from exc
