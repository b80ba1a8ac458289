"""Replay runs as the engine executes them: every answer from the recording, nothing applied.

A replay run (`Run.replay_lane` set; replays.py makes them) executes its workflow's plan like any run, except:

* a step that does not ask a model (a call, a planned tool, an approval, a signal, a timer, a fan-out) returns
  the result its recording committed for the same step — the n-th execution of a step name gets the n-th result
  recorded under that name; one the recording never reached, or a plan row with other arguments (a candidate
  planner's), ends the replay (ReplayDivergedError); so does a step that asks for a person with no recorded answer;
* a tool call of a model step is answered from the recorded tool calls: the first one not yet used with the same
  tool name and the same arguments (as the tool receives them: 34.9 and "34.90" are one Decimal), in recorded
  order. The answer is the recorded tool_result as the model read it. A call the recording never made is a
  divergence: recorded (a `replay_diverged` event), then answered by the replay's stub for that tool, or the replay
  of that run ends;
* a call is never executed: no effect row, no outbox row, no approval or signal wait, no notification, no
  lifecycle signal; `invoke_tool` and `park_txn` refuse a replay run outright (ReplayAppliesNothingError) should any
  road lead there, and a replay run cannot be forked into a real one.

Which recorded call answered which call is kept as a `replay_answered` event keyed by the call's idempotency key:
a step executed again after a crash gets the same answers, and a used recorded call is never used twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Sum

from durable_agents.engine.events import record_event
from durable_agents.errors import (
    ReplayAppliesNothingError,
    ReplayBudgetExceededError,
    ReplayDivergedError,
    ToolArgumentsError,
    UnknownToolError,
)
from durable_agents.models import Event, Replay, ReplayRun, Run, Step, StepKind
from durable_agents.tools import tools

MODEL_KINDS = frozenset({StepKind.AGENT, StepKind.JUDGE, StepKind.PLANNER})
ANSWERED = "replay_answered"
DIVERGED = "replay_diverged"


@dataclass
class Case:
    """What a replay run replays: its lane, its recording, the replay's candidate, stubs and budget."""

    run_id: Any
    replay_id: Any
    lane: str
    recording: dict[str, Any]
    candidate: dict[str, Any]
    stubs: dict[str, Any]
    budget_usd: Decimal | None
    recorded_calls: list[dict[str, Any]] = field(default_factory=list)
    # "batch": its model calls go through the Message Batches API (agents/batching.py); "": live.
    delivery: str = ""

    @classmethod
    def of(cls, run_id: Any) -> Case:
        link = ReplayRun.objects.select_related("recording", "replay").filter(run_id=run_id).first()
        if link is None:
            raise ReplayAppliesNothingError(f"run {run_id} is a replay run with no recording; it cannot go on")
        replay: Replay = link.replay
        data = link.recording.data
        return cls(
            run_id=run_id,
            replay_id=replay.id,
            lane=link.lane,
            recording=data,
            candidate=dict(replay.candidate or {}),
            stubs=dict(replay.stubs or {}),
            budget_usd=replay.budget_usd,
            recorded_calls=list(data.get("tool_calls") or []),
            delivery=replay.delivery,
        )


def is_replay(run: Run) -> bool:
    return bool(getattr(run, "replay_lane", ""))


def case_of(ctx: Any) -> Case:
    """The case of the run `ctx` executes, read once per step execution."""
    case = getattr(ctx, "_replay_case", None)
    if case is None:
        case = ctx._replay_case = Case.of(ctx.run_id)
    return case


def occurrence(ctx: Any) -> int:
    """How many plan rows of this step's name came before this one in the run (a redo or re-plan adds one)."""
    return Step.objects.filter(run_id=ctx.run_id, name=ctx.step.name, pk__lt=ctx.step.pk).count()


def recorded_step(case: Case, name: str, n: int, *, with_result: bool = True) -> dict[str, Any] | None:
    """The n-th recorded execution of step `name` (counting only those that committed a result)."""
    steps = case.recording.get("steps") or ()
    seen = [s for s in steps if s.get("name") == name and (not with_result or "result" in s)]
    return seen[n] if n < len(seen) else None


def recorded_step_result(ctx: Any) -> Any:
    """A step that asks no model: the result its recording committed for the same execution of that step."""
    case = case_of(ctx)
    n = occurrence(ctx)
    step = recorded_step(case, ctx.step.name, n)
    if step is None:
        record_event(ctx.run_id, DIVERGED, step_id=ctx.step_id, step=ctx.step.name, occurrence=n, answered="stopped")
        raise ReplayDivergedError(
            f"the replay reached step {ctx.step.name!r} (execution {n + 1}), which the recording never completed; "
            "the replay of this run ends here"
        )
    if "args" in step and canonical(step["args"]) != canonical(ctx.step.args or {}):
        # A plan row the replay's planner wrote otherwise (another amount): its recorded result is not its answer.
        record_event(
            ctx.run_id, DIVERGED, step_id=ctx.step_id, step=ctx.step.name, input=ctx.step.args, answered="stopped"
        )
        raise ReplayDivergedError(
            f"the replay planned step {ctx.step.name!r} with {canonical(ctx.step.args)[:300]}, where the recording had "
            f"{canonical(step['args'])[:300]}; the replay of this run ends here"
        )
    return step["result"]


def canonical(args: Any) -> str:
    return json.dumps(args, sort_keys=True, cls=DjangoJSONEncoder, separators=(",", ":"))


def call_key(name: str, args: Any) -> str:
    """Arguments as the tool receives them, as canonical JSON: checked and converted by the tool's signature where
    the tool is deployed and takes them (34.9 and "34.90" are the one Decimal), else as given."""
    try:
        checked = tools.get(name).validate(args) if isinstance(args, dict) else args
    except (UnknownToolError, ToolArgumentsError):
        checked = args
    return canonical(_normal(checked))


def _normal(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value.normalize())
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def answer_tool_call(ctx: Any, name: str, args: Any, key: str) -> dict[str, Any]:
    """The recorded answer to a tool call of a replay run: {"content": str, "is_error": bool}.

    Raises ReplayDivergedError for a call the recording never made and no stub answers.
    """
    case = case_of(ctx)
    answered: dict[str, dict[str, Any]] = {}
    diverged: set[str] = set()
    for kind, detail in Event.objects.filter(run_id=ctx.run_id, kind__in=(ANSWERED, DIVERGED)).values_list(
        "kind", "detail"
    ):
        if kind == ANSWERED:
            answered[detail.get("key")] = detail
        else:
            diverged.add(detail.get("key"))
    earlier = answered.get(key)
    if earlier is not None:
        return _answer(case, name, earlier)
    used = {d["recorded"] for d in answered.values() if d.get("recorded") is not None}
    wanted = call_key(name, args)
    for index, call in enumerate(case.recorded_calls):
        if index not in used and call.get("name") == name and call_key(name, call.get("input")) == wanted:
            detail = {"key": key, "tool": name, "recorded": index}
            record_event(ctx.run_id, ANSWERED, step_id=ctx.step_id, **detail)
            return _answer(case, name, detail)
    stubbed = name in case.stubs
    if key not in diverged:
        record_event(
            ctx.run_id,
            DIVERGED,
            step_id=ctx.step_id,
            key=key,
            tool=name,
            input=args,
            answered="stub" if stubbed else "stopped",
        )
    if not stubbed:
        raise ReplayDivergedError(
            f"the replay called {name} with {canonical(args)[:300]}, a call its recording never made; the replay of "
            f"this run ends here (a stub for {name} would answer it)"
        )
    detail = {"key": key, "tool": name, "recorded": None, "stub": True}
    record_event(ctx.run_id, ANSWERED, step_id=ctx.step_id, **detail)
    return _answer(case, name, detail)


def _answer(case: Case, name: str, detail: dict[str, Any]) -> dict[str, Any]:
    index = detail.get("recorded")
    if index is None:
        stub = case.stubs.get(name)
        return {"content": stub if isinstance(stub, str) else canonical(stub), "is_error": False}
    call = case.recorded_calls[index]
    return {"content": call.get("result", ""), "is_error": bool(call.get("is_error"))}


def check_budget(ctx: Any) -> None:
    """Before a replay run asks the model: the replay's cost budget (over all its runs) still has room."""
    case = case_of(ctx)
    if case.budget_usd is None:
        return
    run_ids = ReplayRun.objects.filter(replay_id=case.replay_id).values("run_id")
    spent = Run.objects.filter(pk__in=run_ids).aggregate(spent=Sum("cost_usd"))["spent"] or Decimal(0)
    if spent >= case.budget_usd:
        raise ReplayBudgetExceededError(
            f"replay {case.replay_id} spent ${spent:.4f} of its ${case.budget_usd:.4f} budget; this run stops before "
            "asking the model again"
        )


def refuse(run_id: Any, what: str) -> None:
    raise ReplayAppliesNothingError(f"run {run_id} is a replay run: it never {what}")
