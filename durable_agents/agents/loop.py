"""The agent step: Claude's tool-use loop, journaled so a crash never asks the model twice for a turn.

Every response is committed as a Turn (with its usage, fenced by the run's lease token) before any of
its tool calls run; each tool_use becomes an effect keyed by run, step and tool_use_id; the tool
results are stored on the turn once they are all in. A re-executed step (after a crash, a transient
error or a participant swap) replays the journal and asks the participant only for turns it never
answered. The whole loop runs inside one step (one Celery task): a turn is journaled in its own short
transaction, which is as durable as a task per turn and saves a broker hop and a claim per turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.db.models import F

from durable_agents import clock
from durable_agents.agents.participants import ModelRequest, ModelResponse, Participant, participants
from durable_agents.agents.pricing import cost_usd
from durable_agents.conf import settings
from durable_agents.errors import (
    AgentLimitError,
    ContextWindowExceededError,
    DefinitionError,
    LeaseLostError,
    ModelRefusalError,
    PermanentError,
    RetryableError,
    ToolArgumentsError,
)
from durable_agents.models import Run, Step, StepKind, Turn
from durable_agents.tools import Tool
from durable_agents.workflows import RetryPolicy, StepDef

FINAL_STOPS = ("end_turn", "stop_sequence")
CONTINUE_STOPS = ("max_tokens", "pause_turn")


@dataclass(frozen=True)
class AgentSpec:
    instructions: str
    tools: tuple[Tool[..., Any], ...]
    prompt: Callable[[Any], Any] | None
    model: str | None
    max_tokens: int
    max_turns: int
    participant: str | Participant | None
    max_tool_errors: int


def agent(
    name: str,
    *,
    instructions: str,
    tools: Sequence[Tool[..., Any]] = (),
    prompt: Callable[[Any], Any] | None = None,
    model: str | None = None,
    max_tokens: int = 1024,
    max_turns: int = 25,
    participant: str | Participant | None = None,
    max_tool_errors: int = 3,
    retry: RetryPolicy | None = None,
) -> StepDef:
    """An agent step: `instructions` (system prompt), `prompt(ctx)` (the user content; default: the run
    input as JSON) and the tools the model may call.

    Example::

        agent("resolve", instructions="You handle refund requests.", tools=[lookup_order, issue_refund],
              prompt=lambda ctx: ctx.input["message"], max_turns=10)
    """
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise DefinitionError(f"agent {name!r}: duplicate tool names in {names}")
    if not all(isinstance(t, Tool) for t in tools):
        raise DefinitionError(f"agent {name!r}: tools must be @tool objects")
    if max_turns < 1 or max_tokens < 1:
        raise DefinitionError(f"agent {name!r}: max_turns and max_tokens must be positive")
    spec = AgentSpec(instructions, tuple(tools), prompt, model, max_tokens, max_turns, participant, max_tool_errors)
    return StepDef(
        name=name,
        kind=StepKind.AGENT,
        fn=lambda ctx: run_agent(ctx, spec),
        retry=retry or RetryPolicy(max_attempts=8),
        options={"agent": spec},
    )


def resolve_participant(ctx: Any, spec: AgentSpec) -> Participant:
    """The run's override (an operator's swap) wins, then the step's choice, then the default."""
    chosen = ctx.run.participant or spec.participant or settings.DEFAULT_PARTICIPANT
    return chosen if not isinstance(chosen, str) else participants.get(chosen)


def run_agent(ctx: Any, spec: AgentSpec) -> dict[str, Any]:
    participant = resolve_participant(ctx, spec)
    model = spec.model or settings.DEFAULT_MODEL
    tools = {t.name: t for t in spec.tools}
    tool_defs = [t.anthropic_schema() for t in spec.tools]
    messages: list[dict[str, Any]] = [{"role": "user", "content": _initial_content(ctx, spec)}]
    journal = list(Turn.objects.filter(step_id=ctx.step.pk).order_by("index"))
    tool_errors = 0

    def turns() -> Iterator[Turn]:
        yield from journal
        index = len(journal)
        while True:
            if index >= spec.max_turns:
                raise AgentLimitError(f"the agent used its {spec.max_turns} turns without finishing")
            request = ModelRequest(
                model=model,
                max_tokens=spec.max_tokens,
                system=spec.instructions,
                tools=tool_defs,
                messages=_prefill_safe(messages),
                metadata={"user_id": f"{ctx.run_id}:{ctx.step_id}"},
            )
            yield _journal(ctx, index, request, participant.respond(request), participant.name)
            index += 1

    for turn in turns():
        _append_assistant(messages, turn.content)
        stop = turn.stop_reason
        if stop == "tool_use":
            results = turn.tool_results if turn.tool_results is not None else _run_tools(ctx, turn, tools)
            tool_errors += sum(1 for block in results if block.get("is_error"))
            if tool_errors > spec.max_tool_errors:
                raise AgentLimitError(f"the model made {tool_errors} invalid tool calls (limit {spec.max_tool_errors})")
            messages.append({"role": "user", "content": results})
        elif stop in FINAL_STOPS:
            return {"text": _text(messages[-1]["content"]), "stop_reason": stop, "turns": turn.index + 1}
        elif stop == "refusal":
            raise ModelRefusalError(f"the model refused at turn {turn.index}: {_text(turn.content)[:500]}")
        elif stop == "model_context_window_exceeded":
            raise ContextWindowExceededError(f"the conversation outgrew the context window at turn {turn.index}")
        elif stop in CONTINUE_STOPS:
            if turn.content and turn.content[-1].get("type") == "tool_use":
                raise AgentLimitError(f"turn {turn.index} hit max_tokens inside a tool call; raise max_tokens")
        else:
            raise PermanentError(f"unknown stop_reason {stop!r} at turn {turn.index}")
    raise AssertionError("unreachable: the turn stream ends only by returning or raising")


def _initial_content(ctx: Any, spec: AgentSpec) -> Any:
    if spec.prompt is not None:
        return spec.prompt(ctx)
    return json.dumps(ctx.input, cls=DjangoJSONEncoder)


def _append_assistant(messages: list[dict[str, Any]], content: Sequence[dict[str, Any]]) -> None:
    """Add a response; a continuation (after max_tokens or pause_turn) extends the previous assistant message."""
    if messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": [dict(b) for b in content]})
        return
    merged = messages[-1]["content"]
    for block in content:
        if merged and merged[-1].get("type") == "text" and block.get("type") == "text":
            merged[-1] = {**merged[-1], "text": merged[-1]["text"] + block["text"]}
        else:
            merged.append(dict(block))


def _prefill_safe(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy fit to send: the API refuses a final assistant message that ends in whitespace."""
    out = [dict(m) for m in messages]
    last = out[-1]
    if last["role"] == "assistant" and last["content"] and last["content"][-1].get("type") == "text":
        last["content"] = [*last["content"][:-1], {**last["content"][-1], "text": last["content"][-1]["text"].rstrip()}]
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if block.get("type") == "text")


def _journal(ctx: Any, index: int, request: ModelRequest, response: ModelResponse, participant: str) -> Turn:
    """Commit the response before acting on it: turn, usage on step and run, fenced by the lease token."""
    usage = response.usage
    cost = cost_usd(response.model, usage)
    counters = {
        "input_tokens": F("input_tokens") + usage.input_tokens,
        "output_tokens": F("output_tokens") + usage.output_tokens,
        "cache_write_tokens": F("cache_write_tokens") + usage.cache_write_tokens,
        "cache_read_tokens": F("cache_read_tokens") + usage.cache_read_tokens,
    }
    try:
        with transaction.atomic():
            # Progress resets the attempt count, so a long agent is not failed for retries spread over hours.
            fenced = Run.objects.filter(pk=ctx.run_id, lease_token=ctx.lease_token).update(
                attempt=1, updated_at=clock.now(), cost_usd=F("cost_usd") + cost, **counters
            )
            if not fenced:
                raise LeaseLostError()
            Step.objects.filter(pk=ctx.step.pk).update(cost_usd=F("cost_usd") + cost, **counters)
            return Turn.objects.create(
                run_id=ctx.run_id,
                step_id=ctx.step.pk,
                index=index,
                request_digest=request.digest(),
                content=[dict(b) for b in response.content],
                stop_reason=response.stop_reason,
                model=response.model,
                participant=participant,
                request_id=response.request_id,
                cost_usd=cost,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_write_tokens=usage.cache_write_tokens,
                cache_read_tokens=usage.cache_read_tokens,
            )
    except IntegrityError as exc:
        raise LeaseLostError(f"turn {index} of step {ctx.step_id} was journaled by another worker") from exc


def _run_tools(ctx: Any, turn: Turn, tools: dict[str, Tool[..., Any]]) -> list[dict[str, Any]]:
    """Run this turn's tool calls (effects keyed by tool_use_id) and store their results on the turn."""
    results = []
    for block in turn.content:
        if block.get("type") != "tool_use":
            continue
        results.append(_run_tool(ctx, block, tools))
    Turn.objects.filter(pk=turn.pk, tool_results__isnull=True).update(tool_results=results)
    return results


def _run_tool(ctx: Any, block: dict[str, Any], tools: dict[str, Tool[..., Any]]) -> dict[str, Any]:
    use_id, name = block["id"], block["name"]
    tool = tools.get(name)
    if tool is None:
        return _error(use_id, f"unknown tool {name!r}; the tools you may call are: {', '.join(tools) or 'none'}")
    try:
        result = ctx.call_tool(tool, block.get("input") or {}, key=f"{ctx.run_id}:{ctx.step_id}:{use_id}")
    except ToolArgumentsError as exc:
        return _error(use_id, str(exc))
    except (RetryableError, LeaseLostError, PermanentError):
        raise
    except Exception as exc:  # noqa: BLE001 - a tool's own failure is news for the model, not a crash
        return _error(use_id, f"{name} failed: {type(exc).__name__}: {exc}")
    return {"type": "tool_result", "tool_use_id": use_id, "content": json.dumps(result, cls=DjangoJSONEncoder)}


def _error(use_id: str, message: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": use_id, "content": message, "is_error": True}
