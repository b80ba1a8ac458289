"""The agent step: Claude's tool-use loop, journaled so a crash never asks the model twice for a turn.

Every response is committed as a Turn (with its usage, fenced by the run's lease token) before any of
its tool calls run; each tool_use becomes an effect keyed by run, step and tool_use_id; the tool
results are stored on the turn once they are all in. A re-executed step (after a crash, a transient
error or a participant swap) replays the journal and asks the participant only for turns it never
answered. The whole loop runs inside one step (one Celery task): a turn is journaled in its own short
transaction, which is as durable as a task per turn and saves a broker hop and a claim per turn.

Tokens: before every model call the run's budget is checked against everything it spent (budget.py);
once a prompt grows past the compaction threshold, older turns are folded into a summary stored in
Step.context (compaction.py). A re-executed step reads that context and the turns since, never the
whole journal, so resuming costs the same at turn 10 and turn 10,000.

Journal indices: agent turns and compaction calls share one sequence per step (unique with the step);
`Compacted.compactions` tells them apart, so `max_turns` counts agent turns only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.agents.budget import Budget, PromptSize, estimate_prompt
from durable_agents.agents.compaction import (
    COMPACTION_INSTRUCTION,
    Compacted,
    Conversation,
    cacheable_system,
    cacheable_tools,
    summary_text,
    text_of,
)
from durable_agents.agents.journal import ask, journal_turn
from durable_agents.agents.messages import TURN, ModelRequest, estimate_tokens
from durable_agents.agents.participants import Participant, participants
from durable_agents.agents.toolcalls import run_calls
from durable_agents.conf import settings
from durable_agents.errors import (
    AgentLimitError,
    ContextWindowExceededError,
    DefinitionError,
    LeaseLostError,
    ModelRefusalError,
    PermanentError,
)
from durable_agents.models import Step, StepKind, Turn
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
    # None: DURABLE_AGENTS['COMPACT_AT_PROMPT_TOKENS'] and ['KEEP_RECENT_TURNS'].
    compact_at_prompt_tokens: int | None = None
    keep_recent_turns: int | None = None


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
    compact_at_prompt_tokens: int | None = None,
    keep_recent_turns: int | None = None,
    retry: RetryPolicy | None = None,
    depends_on: Sequence[str] = (),
) -> StepDef:
    """An agent step: `instructions` (system prompt), `prompt(ctx)` (the user content; default: the run
    input as JSON) and the tools the model may call. Past `compact_at_prompt_tokens` of prompt, all but the
    last `keep_recent_turns` turns are folded into a summary (defaults: the DURABLE_AGENTS settings).
    `depends_on` names observations (step ids) the agent acts on: resumed past their freshness budget,
    the run re-plans from them instead of acting on a stale world.

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
    if (compact_at_prompt_tokens is not None and compact_at_prompt_tokens < 1) or (
        keep_recent_turns is not None and keep_recent_turns < 1
    ):
        raise DefinitionError(f"agent {name!r}: compact_at_prompt_tokens and keep_recent_turns must be positive")
    spec = AgentSpec(
        instructions,
        tuple(tools),
        prompt,
        model,
        max_tokens,
        max_turns,
        participant,
        max_tool_errors,
        compact_at_prompt_tokens,
        keep_recent_turns,
    )
    return StepDef(
        name=name,
        kind=StepKind.AGENT,
        fn=lambda ctx: run_agent(ctx, spec),
        retry=retry or RetryPolicy(max_attempts=8),
        options={"agent": spec},
        depends_on=tuple(depends_on),
    )


def resolve_participant(ctx: Any, spec: AgentSpec) -> Participant:
    """The run's override (an operator's swap) wins, then the step's choice, then the default."""
    chosen = ctx.run.participant or spec.participant or settings.DEFAULT_PARTICIPANT
    return chosen if not isinstance(chosen, str) else participants.get(chosen)


def run_agent(ctx: Any, spec: AgentSpec) -> dict[str, Any]:
    return _AgentLoop(ctx, spec).run()


class _AgentLoop:
    """One execution of an agent step: replay the turns journaled since the last compaction, then ask for more."""

    def __init__(self, ctx: Any, spec: AgentSpec) -> None:
        self.ctx = ctx
        self.spec = spec
        self.participant = resolve_participant(ctx, spec)
        self.tools = {t.name: t for t in spec.tools}
        self.base = ModelRequest(
            model=spec.model or settings.DEFAULT_MODEL,
            max_tokens=spec.max_tokens,
            system=cacheable_system(spec.instructions),
            tools=cacheable_tools([t.anthropic_schema() for t in spec.tools]),
            messages=(),
            metadata={"user_id": f"{ctx.run_id}:{ctx.step_id}"},
            step_key=str(ctx.step.pk),
        )
        # Read fresh: the step row the engine loaded does not carry the (possibly large) context.
        stored = Step.objects.filter(pk=ctx.step.pk).values_list("context", flat=True).first()
        compacted = Compacted.from_json(stored)
        self.conversation = Conversation(_initial_content(ctx, spec), compacted)
        self.next_index = compacted.turn + 1 if compacted else 0
        self.compactions = compacted.compactions if compacted else 0
        self.errors_by_turn: dict[int, int] = {}
        # The last prompt size the API reported for a request shaped like the next one (after the last fold).
        self.measured: PromptSize | None = None
        self.budget = Budget.of(ctx.run)
        compact_at = spec.compact_at_prompt_tokens or settings.COMPACT_AT_PROMPT_TOKENS
        self.compact_at: int | None = int(compact_at) if compact_at else None
        self.keep = int(spec.keep_recent_turns or settings.KEEP_RECENT_TURNS)

    def run(self) -> dict[str, Any]:
        since = self.compacted.covers_until if self.compacted else 0
        journal = Turn.objects.filter(step_id=self.ctx.step.pk, purpose=TURN, index__gte=since).order_by("index")
        for turn in journal:
            self.next_index = max(self.next_index, turn.index + 1)
            outcome = self._act(turn)
            if outcome is not None:
                return outcome
        while True:
            if self._should_compact():
                self._compact()
            outcome = self._act(self._ask())
            if outcome is not None:
                return outcome

    @property
    def compacted(self) -> Compacted | None:
        return self.conversation.compacted

    @property
    def turn_number(self) -> int:
        """Agent turns journaled so far: the number of the next one."""
        return self.next_index - self.compactions

    @property
    def tool_errors(self) -> int:
        return (self.compacted.tool_errors if self.compacted else 0) + sum(self.errors_by_turn.values())

    def _ask(self) -> Turn:
        if self.turn_number >= self.spec.max_turns:
            raise AgentLimitError(f"the agent used its {self.spec.max_turns} turns without finishing")
        request = replace(self.base, messages=self.conversation.sendable(), turn_number=self.turn_number)
        self.budget.check(
            model=request.model,
            prompt_tokens=estimate_prompt(request.as_kwargs(), self.conversation.messages, self.measured),
            max_tokens=request.max_tokens,
            purpose=f"turn {self.turn_number}",
        )
        response = ask(self.ctx, self.participant, request)
        turn = journal_turn(self.ctx, self.next_index, request, response, self.participant.name)
        self.next_index += 1
        return turn

    def _act(self, turn: Turn) -> dict[str, Any] | None:
        """Take a journaled turn into the conversation; the step's result once the agent is done, else None."""
        if self.compacted is None or turn.index > self.compacted.turn:
            self.measured = PromptSize(_prompt_tokens(turn), len(self.conversation.messages))
        self.conversation.add_turn(turn.index, turn.content, turn.stop_reason)
        stop = turn.stop_reason
        if stop == "tool_use":
            results = turn.tool_results if turn.tool_results is not None else _run_tools(self.ctx, turn, self.tools)
            self.errors_by_turn[turn.index] = sum(1 for block in results if block.get("is_error"))
            if self.tool_errors > self.spec.max_tool_errors:
                raise AgentLimitError(
                    f"the model made {self.tool_errors} invalid tool calls (limit {self.spec.max_tool_errors})"
                )
            self.conversation.add_results(results)
        elif stop in FINAL_STOPS:
            turns = turn.index + 1 - self.compactions
            return {"text": self.conversation.final_text, "stop_reason": stop, "turns": turns}
        elif stop == "refusal":
            raise ModelRefusalError(f"the model refused at turn {turn.index}: {text_of(turn.content)[:500]}")
        elif stop == "model_context_window_exceeded":
            raise ContextWindowExceededError(f"the conversation outgrew the context window at turn {turn.index}")
        elif stop in CONTINUE_STOPS:
            if turn.content and turn.content[-1].get("type") == "tool_use":
                raise AgentLimitError(f"turn {turn.index} hit max_tokens inside a tool call; raise max_tokens")
        else:
            raise PermanentError(f"unknown stop_reason {stop!r} at turn {turn.index}")
        return None

    def _should_compact(self) -> bool:
        return (
            self.compact_at is not None
            and self.measured is not None
            and self.measured.tokens >= self.compact_at
            and self.conversation.fold_point(self.keep) is not None
        )

    def _compact(self) -> None:
        """Fold the older turns into a summary: a journaled model call, committed with the new Step.context."""
        point = self.conversation.fold_point(self.keep)
        assert point is not None and self.measured is not None, "only called when _should_compact()"
        request = self.conversation.compaction_request(self.base, point, turn_number=self.turn_number)
        # The request is a prefix of the last prompt plus the instruction: the last prompt bounds it.
        self.budget.check(
            model=request.model,
            prompt_tokens=self.measured.tokens + estimate_tokens(COMPACTION_INSTRUCTION),
            max_tokens=request.max_tokens,
            purpose=f"compaction before turn {self.turn_number}",
        )
        # The largest prompt there is: a thawed zombie must stop before asking for it again (`ask` proves it).
        response = ask(self.ctx, self.participant, request)
        folded_errors = sum(n for index, n in self.errors_by_turn.items() if index < point.covers_until)
        compacted = Compacted(
            summary=summary_text(response, request),
            covers_until=point.covers_until,
            turn=self.next_index,
            compactions=self.compactions + 1,
            prompt_tokens_before=self.measured.tokens,
            tool_errors=(self.compacted.tool_errors if self.compacted else 0) + folded_errors,
        )
        journal_turn(self.ctx, self.next_index, request, response, self.participant.name, compacted=compacted)
        self.conversation.fold(compacted, point)
        self.errors_by_turn = {i: n for i, n in self.errors_by_turn.items() if i >= point.covers_until}
        self.next_index += 1
        self.compactions += 1
        self.measured = None


def _initial_content(ctx: Any, spec: AgentSpec) -> Any:
    if spec.prompt is not None:
        return spec.prompt(ctx)
    return json.dumps(ctx.input, cls=DjangoJSONEncoder)


def _prompt_tokens(turn: Turn) -> int:
    return turn.input_tokens + turn.cache_write_tokens + turn.cache_read_tokens


def _run_tools(ctx: Any, turn: Turn, tools: dict[str, Tool[..., Any]]) -> list[dict[str, Any]]:
    """Run this turn's tool calls (concurrently, effects keyed by tool_use_id) and store their results on the turn."""
    results = run_calls(ctx, [block for block in turn.content if block.get("type") == "tool_use"], tools)
    # Fenced: a zombie (its run taken over) must not write the results the live worker will journal.
    written = Turn.objects.filter(pk=turn.pk, tool_results__isnull=True, run__lease_token=ctx.lease_token).update(
        tool_results=results
    )
    if not written:
        raise LeaseLostError(f"run {ctx.run_id} was taken over; the results of turn {turn.index} were not written")
    return results
