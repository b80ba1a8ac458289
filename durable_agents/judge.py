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

from collections.abc import Callable
from typing import Any

from durable_agents.agents.journal import ask, journal_call
from durable_agents.agents.messages import ForcedToolRequest
from durable_agents.agents.participants import Participant, participants
from durable_agents.conf import settings
from durable_agents.engine.control import Park, Rerun, WaitSpec
from durable_agents.engine.waits import latest_wait
from durable_agents.errors import DefinitionError, PermanentError
from durable_agents.models import Step, StepKind, StepStatus, Turn, WaitKind, WaitStatus
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

    return StepDef(name=name, kind=StepKind.JUDGE, fn=run, options={"rubric": rubric, "participant": participant})


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
        step_key=str(ctx.step.pk),
    )
    return journal_call(ctx, "judge", request, ask(ctx, answerer, request), answerer.name)


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
