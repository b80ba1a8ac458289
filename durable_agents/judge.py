"""Judge steps (LLM-as-judge): a verdict against a rubric, snapshotted so a retry replays it, never re-asks.

The judge asks the run's participant to call one tool, `submit_verdict` — forced where the model takes forced
tool use, else asked for (and asked again, bounded) as agents/structured.py describes, since today's models
refuse forced tool choice; every response is journaled (Turn, purpose "judge") before it is acted on. A
failing verdict routes as declared: fail the run, redo an earlier step with the judge's reasons as feedback
(`ctx.feedback()`, bounded), or ask a human whether to accept it anyway.

Example::

    judge("review_email", rubric="Polite, accurate, states the refunded amount.",
          subject=lambda ctx: ctx.result("resolve")["text"], on_fail="redo", redo_step="resolve")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from durable_agents.agents.capabilities import ModelChoice, check_choice, thinking_param
from durable_agents.agents.participants import Participant, participants
from durable_agents.agents.structured import Form, ask_for_call
from durable_agents.conf import settings
from durable_agents.engine.control import Park, Rerun, WaitSpec
from durable_agents.engine.waits import latest_wait
from durable_agents.errors import DefinitionError, PermanentError
from durable_agents.models import Step, StepKind, StepStatus, WaitKind, WaitStatus
from durable_agents.workflows import Batch, StepDef, delivery_param

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
    max_tokens: int = 4096,
    thinking: str | dict[str, Any] | None = None,
    effort: str | None = None,
    max_asks: int = 3,
    delivery: Batch | str | None = None,
) -> StepDef:
    """A judge step; its result is {"passed", "score", "reasons"} (plus "overridden_by" if a human accepted).

    `thinking` and `effort` as for `agent()`, checked against the model table; `max_tokens` bounds thinking and
    verdict together; `max_asks` bounds the asks for a valid verdict on models that refuse forced tool use;
    `delivery` as for `agent()` ("batch": at half price through the Message Batches API).
    """
    if on_fail not in ROUTES:
        raise DefinitionError(f"judge {name!r}: on_fail must be one of {ROUTES}, got {on_fail!r}")
    if on_fail == "redo" and not redo_step:
        raise DefinitionError(f"judge {name!r}: on_fail='redo' needs redo_step")
    if max_asks < 1:
        raise DefinitionError(f"judge {name!r}: max_asks must be at least 1")
    choice = ModelChoice(model, thinking_param(thinking), effort, max_tokens)
    check_choice(f"judge {name!r}", choice)
    delivery = delivery_param(delivery, f"judge {name!r}")

    def run(ctx: Any) -> dict[str, Any]:
        verdict = _ask(ctx, rubric, subject, participant, choice, max_asks, delivery)
        if verdict["passed"]:
            return verdict
        if on_fail == "redo":
            redone = Step.objects.filter(run_id=ctx.run_id, step_id=ctx.step_id, status=StepStatus.SUPERSEDED).count()
            if redone < max_redos:
                raise Rerun(redo_step, verdict["reasons"], verdict)
        if on_fail == "ask_human":
            return _ask_human(ctx, name, verdict)
        raise JudgeFailedError(f"{name} failed (score {verdict['score']}): {verdict['reasons']}")

    options = {"rubric": rubric, "participant": participant, "model_choice": choice}
    return StepDef(name=name, kind=StepKind.JUDGE, fn=run, options=options)


def _ask(
    ctx: Any,
    rubric: str,
    subject: Callable[[Any], str],
    participant: Any,
    choice: ModelChoice,
    max_asks: int,
    delivery: Batch | str | None,
) -> dict[str, Any]:
    """The verdict: replayed from the journal when one was given (the snapshot), else asked for."""
    chosen = ctx.run.participant or participant or settings.DEFAULT_PARTICIPANT
    answerer = participants.get(chosen) if isinstance(chosen, str) else chosen
    form = Form(
        purpose="judge",
        tool=VERDICT_TOOL,
        system=SYSTEM + rubric,
        prompt=f"Subject to review:\n\n{subject(ctx)}",
        choice=choice,
        read=_read_verdict,
        max_asks=max_asks,
        answer="verdict",
        delivery=delivery,
    )
    verdict, _turn = ask_for_call(ctx, answerer, form)
    return verdict


def _read_verdict(data: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A verdict that keeps to VERDICT_TOOL's schema, or what is wrong with it (sent back to the model)."""
    score, reasons = data.get("score"), data.get("reasons")
    if not isinstance(data.get("passed"), bool):
        problem = "passed must be true or false"
    elif isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
        problem = f"score must be a number from 0 to 1, got {score!r}"
    elif not isinstance(reasons, str) or not reasons.strip():
        problem = "reasons must say, concretely, what is right or wrong"
    else:
        return {"passed": data["passed"], "score": score, "reasons": reasons}, None
    return None, f"{problem}; call submit_verdict again with passed, score and reasons"


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
