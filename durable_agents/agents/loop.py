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

Append-only: the step's first model call freezes its head — model, system, tools (names, descriptions, schemas),
first prompt, thinking and effort — in Step.frozen_request, and every later call of the step sends that head,
whatever code is deployed since (a deploy that rewords a docstring does not change a conversation in flight; a
new version of the workflow is the way to change it). The model table (capabilities.py) decides what a request
may carry. Every stop reason has a road forward:

    end_turn, stop_sequence          the step's answer
    tool_use                         the tools run (effects keyed by tool_use_id), their results go back
    pause_turn                       the assistant content is sent back as is, and the model goes on
    max_tokens (text)                continued: as an assistant prefill where the model takes one, else a user
                                     message asks it to go on from where it stopped
    max_tokens (in a tool call or    not an answer: the turn is set aside and asked again with twice the
      in its thinking)               max_tokens, up to the model's limit (then the step fails saying so)
    refusal                          the step fails with the refusal's category and explanation; with a
                                     fallback_model, the next attempt asks that model. A resume asks again:
                                     a refused turn is never replayed as the answer
    model_context_window_exceeded    the conversation is compacted and the turn asked again, once
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Max

from durable_agents import tracing
from durable_agents.agents.batching import step_batch
from durable_agents.agents.budget import Budget, PromptSize, estimate_prompt
from durable_agents.agents.candidate import recorded_prompt, replay_head
from durable_agents.agents.capabilities import ModelChoice, ModelProfile, check_choice, model_profile, thinking_param
from durable_agents.agents.compaction import (
    COMPACTION_INSTRUCTION,
    Compacted,
    Conversation,
    cacheable_system,
    cacheable_tools,
    summary_text,
    text_of,
)
from durable_agents.agents.journal import ask, journal_turn, record_thinking_dropped
from durable_agents.agents.messages import COMPACTION, TURN, ModelRequest, estimate_tokens
from durable_agents.agents.participants import Participant, participants
from durable_agents.agents.toolcalls import run_calls
from durable_agents.conf import settings
from durable_agents.engine import turnpath
from durable_agents.engine.context import prove_lease_reading_spend, write_tool_results
from durable_agents.engine.lease import Spent
from durable_agents.errors import (
    AgentLimitError,
    ContextWindowExceededError,
    DefinitionError,
    LeaseLostError,
    ModelRefusalError,
    PermanentError,
    RetryableError,
)
from durable_agents.models import Step, StepKind, Turn
from durable_agents.tools import Tool
from durable_agents.workflows import Batch, RetryPolicy, StepDef, delivery_param

FINAL_STOPS = ("end_turn", "stop_sequence")
CONTINUE_STOPS = ("max_tokens", "pause_turn")
# Asking again after a truncated turn: at most this many times in a row, doubling max_tokens each time.
MAX_TRUNCATED_RETRIES = 3


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
    thinking: dict[str, Any] | None = None
    effort: str | None = None
    fallback_model: str | None = None
    # None: the workflow's delivery; "live"; or a Batch (each call in a Message Batch: batching.py).
    delivery: Batch | str | None = None

    @property
    def choice(self) -> ModelChoice:
        return ModelChoice(self.model, self.thinking, self.effort, self.max_tokens, self.fallback_model)


def agent(
    name: str,
    *,
    instructions: str,
    tools: Sequence[Tool[..., Any]] = (),
    prompt: Callable[[Any], Any] | None = None,
    model: str | None = None,
    max_tokens: int = 8192,
    max_turns: int = 25,
    participant: str | Participant | None = None,
    max_tool_errors: int = 3,
    compact_at_prompt_tokens: int | None = None,
    keep_recent_turns: int | None = None,
    retry: RetryPolicy | None = None,
    depends_on: Sequence[str] = (),
    thinking: str | dict[str, Any] | None = None,
    effort: str | None = None,
    fallback_model: str | None = None,
    delivery: Batch | str | None = None,
) -> StepDef:
    """An agent step: `instructions` (system prompt), `prompt(ctx)` (the user content; default: the run
    input as JSON) and the tools the model may call. Past `compact_at_prompt_tokens` of prompt, all but the
    last `keep_recent_turns` turns are folded into a summary (defaults: the DURABLE_AGENTS settings).
    `depends_on` names observations (step ids) the agent acts on: resumed past their freshness budget,
    the run re-plans from them instead of acting on a stale world. `thinking` (None: the model's default;
    "adaptive", "between_tools", "disabled", or the whole field) and `effort` ("low" ... "max") are checked
    against the model table when the model is named here, else by a system check (E014). `max_tokens` bounds
    thinking and answer together. `fallback_model` is asked on the next attempt after a refusal. `delivery="batch"`
    (or `Batch(deadline=..., ...)`) sends each model call through the Message Batches API at half price, the run
    parked until its answer is in (batching.py); None follows the workflow's `delivery`.

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
    choice = ModelChoice(model, thinking_param(thinking), effort, max_tokens, fallback_model)
    check_choice(f"agent {name!r}", choice)
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
        choice.thinking,
        effort,
        fallback_model,
        delivery_param(delivery, f"agent {name!r}"),
    )
    return StepDef(
        name=name,
        kind=StepKind.AGENT,
        fn=lambda ctx: run_agent(ctx, spec),
        retry=retry or RetryPolicy(max_attempts=8),
        options={"agent": spec, "model_choice": choice},
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
        # Read fresh: the step row the engine loaded carries neither the (possibly large) context nor the head.
        stored, frozen, self.last_journaled = _step_journal(ctx.step.pk)
        self.head = frozen or replay_head(ctx, self._head_from_code(), agent=True)
        self.unfrozen = frozen is None
        # Turns journaled before the step froze a head (by the previous version, during a deploy) go back without
        # their thinking blocks: their prefix may have been sent otherwise, and dropping them all is allowed.
        self.unfrozen_turns = int(self.head.get("turns_before", 0))
        self.model = self.head["model"]
        self.base = ModelRequest(
            model=self.model,
            max_tokens=spec.max_tokens,
            # Cache breakpoints are not part of the prompt: marked at the TTL configured now.
            system=cacheable_system(self.head["system"]),
            tools=cacheable_tools(self.head["tools"]),
            messages=(),
            metadata={"user_id": f"{ctx.run_id}:{ctx.step_id}"},
            thinking=self.head.get("thinking"),
            output_config=self.head.get("output_config"),
            step_key=str(ctx.step.pk),
        )
        compacted = Compacted.from_json(stored)
        prefill = self.profile.accepts_prefill(self.base.thinking)
        self.conversation = Conversation(
            self.head["prompt"], compacted, prefill=prefill, strip_on_fold=self.profile.prefix_check
        )
        self.next_index = compacted.turn + 1 if compacted else 0
        self.compactions = compacted.compactions if compacted else 0
        self.errors_by_turn: dict[int, int] = {}
        # The last prompt size the API reported for a request shaped like the next one (after the last fold).
        self.measured: PromptSize | None = None
        self.budget = Budget.of(ctx.run)
        self.batch = step_batch(ctx, spec.delivery)
        compact_at = spec.compact_at_prompt_tokens or settings.COMPACT_AT_PROMPT_TOKENS
        self.compact_at: int | None = int(compact_at) if compact_at else None
        self.keep = int(spec.keep_recent_turns or settings.KEEP_RECENT_TURNS)
        # Turns set aside in a row (cut inside a tool call or its thinking): the next ask doubles max_tokens.
        self.truncated = 0
        # The context window overflowed: compact, then ask again — once.
        self.must_compact = False
        self.overflowed = False
        self.dropped_models: set[str] = set()
        # The lease as the write of the last turn's tool results proved it (with the run's spend), for the ask after.
        self.proof: Spent | None = None

    @property
    def model(self) -> str:
        return self._model

    @model.setter
    def model(self, model: str) -> None:
        # Looked up once per model, not on every turn replayed: the table is rebuilt from settings on each lookup.
        self._model = model
        self.profile: ModelProfile = model_profile(model)

    def _head_from_code(self) -> dict[str, Any]:
        """The head this step's first model call sends, from the code deployed now (frozen once journaled)."""
        spec, choice = self.spec, self.spec.choice
        last = self.last_journaled
        return {
            "turns_before": 0 if last is None else last + 1,
            "model": choice.resolved_model,
            # Unmarked: cache breakpoints are not part of the prompt, and are added at the TTL of each request.
            "system": spec.instructions,
            "tools": [t.anthropic_schema() for t in spec.tools],
            "prompt": _first_prompt(self.ctx, spec),
            "thinking": choice.thinking,
            "output_config": choice.output_config(),
        }

    def run(self) -> dict[str, Any]:
        since = self.compacted.covers_until if self.compacted else 0
        # The step's first execution has nothing journaled to read.
        journal: Iterable[Turn] = ()
        if self.last_journaled is not None:
            journal = Turn.objects.filter(step_id=self.ctx.step.pk, purpose=TURN, index__gte=since).order_by("index")
        traced = tracing.current()
        for turn in journal:
            self.next_index = max(self.next_index, turn.index + 1)
            # Answered before (this step's earlier attempt): no call, so no chat span; the attempt's span says so.
            traced.event("model turn replayed from journal", {tracing.MODEL_TURN: turn.index})
            outcome = self._act(turn, replayed=True)
            if outcome is not None:
                return outcome
        while True:
            if self.must_compact or self._should_compact():
                self.proof = None  # a summary is asked for first
                self._compact()
            try:
                turn = self._ask()
            except ContextWindowExceededError:
                # Refused before any answer (400 "prompt is too long"): the same road as the stop reason.
                if self.overflowed or self.conversation.fold_point(self.keep) is None:
                    raise
                self.overflowed = self.must_compact = True
                continue
            outcome = self._act(turn, replayed=False)
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

    def _max_tokens(self) -> int:
        """The output limit of the next ask: doubled for each turn set aside as truncated, up to the model's limit."""
        wanted = self.spec.max_tokens * 2**self.truncated
        return min(wanted, self.profile.max_output) if self.profile.known else wanted

    def _ask(self) -> Turn:
        if self.turn_number >= self.spec.max_turns:
            raise AgentLimitError(f"the agent used its {self.spec.max_turns} turns without finishing")
        request = replace(
            self.base,
            model=self.model,
            max_tokens=self._max_tokens(),
            messages=self.conversation.sendable(self.model),
            turn_number=self.turn_number,
        )
        proof, self.proof = self.proof, None
        waited = self._record_dropped()
        counter = getattr(self.participant, "count_tokens", None) if settings.COUNT_TOKENS else None

        def count() -> int | None:
            nonlocal waited
            waited = True
            return counter(request)

        # Measured first: a count is a round trip to the API, and a pause in it must still meet the proof below.
        prompt_tokens = estimate_prompt(
            request.as_kwargs(), self.conversation.messages, self.measured, count if counter is not None else None
        )
        # A live call proves the lease right before it is sent; the same statement reads the spend the budget checks.
        # The statement that wrote the last turn's tool results proved it so, and stands for it if nothing since
        # waited on the database or the API: from either proof, the call is only this process's work away.
        if self.batch is not None:
            spent = None
        elif proof is not None and not waited:
            spent = proof
        else:
            spent = prove_lease_reading_spend(self.ctx)
        self.budget.check(
            model=request.model,
            prompt_tokens=prompt_tokens,
            max_tokens=request.max_tokens,
            purpose=f"turn {self.turn_number}",
            batch=self.batch is not None,
            spent=spent,
        )
        proven = spent is not None
        response = ask(self.ctx, self.participant, request, batch=self.batch, index=self.next_index, proven=proven)
        head = self.head if self.unfrozen else None
        turn = journal_turn(self.ctx, self.next_index, request, response, self.participant.name, head=head)
        self.unfrozen = False
        self.next_index += 1
        return turn

    def _record_dropped(self) -> bool:
        """A model swap drops the thinking blocks the new model cannot read, on purpose and on the record; True if it
        wrote that record."""
        dropped = self.conversation.dropped_models - self.dropped_models
        if dropped:
            record_thinking_dropped(self.ctx, sorted(dropped), self.model)
            self.dropped_models |= dropped
        return bool(dropped)

    def _act(self, turn: Turn, *, replayed: bool) -> dict[str, Any] | None:
        """Take a journaled turn into the conversation; the step's result once the agent is done, else None."""
        stop = turn.stop_reason
        if stop == "refusal":
            return self._refused(turn, replayed=replayed)
        if stop == "model_context_window_exceeded":
            return self._overflowed(turn, replayed=replayed)
        if _is_truncated(turn):
            return self._truncated(turn, replayed=replayed)
        self.truncated = 0
        self.overflowed = False
        if self.compacted is None or turn.index > self.compacted.turn:
            self.measured = PromptSize(_prompt_tokens(turn), len(self.conversation.messages))
        # Kept turns of an earlier fold lose their thinking blocks where the model checks their prefix (the folded
        # turns are gone); a model without the check wants the last turn's block back in a tool loop, unchanged.
        kept = (self.compacted is not None and turn.index < self.compacted.turn) or turn.index < self.unfrozen_turns
        kept = kept and self.profile.prefix_check
        self.conversation.add_turn(turn.index, turn.content, stop, model=turn.model, strip_thinking=kept)
        if stop == "tool_use":
            if turn.tool_results is not None:
                results = turn.tool_results
            else:
                results, self.proof = _run_tools(self.ctx, turn, self.tools)
            self.errors_by_turn[turn.index] = sum(1 for block in results if block.get("is_error"))
            if self.tool_errors > self.spec.max_tool_errors:
                raise AgentLimitError(
                    f"the model made {self.tool_errors} invalid tool calls (limit {self.spec.max_tool_errors})"
                )
            self.conversation.add_results(results)
        elif stop in FINAL_STOPS:
            turns = turn.index + 1 - self.compactions
            return {"text": self.conversation.final_text, "stop_reason": stop, "turns": turns}
        elif stop not in CONTINUE_STOPS:
            raise PermanentError(f"unknown stop_reason {stop!r} at turn {turn.index}")
        return None

    def _refused(self, turn: Turn, *, replayed: bool) -> None:
        """A refusal is never the answer: live, the step fails (or retries on the fallback model); replayed (a
        resume, or the fallback's attempt), the turn is set aside and the model asked again."""
        fallback = self.spec.fallback_model
        if replayed:
            if fallback and self.model != fallback:
                self.model = fallback
            return None
        details = turn.stop_details or {}
        why = f"category {details.get('category') or 'none'}"
        if details.get("explanation"):
            why += f": {details['explanation']}"
        said = text_of(turn.content)[:300]
        message = f"the model {turn.model} refused at turn {turn.index} ({why})" + (
            f"; it said: {said}" if said else ""
        )
        if fallback and self.model != fallback:
            raise RetryableError(f"{message}; the next attempt asks the fallback model {fallback}")
        raise ModelRefusalError(f"{message}. Resume the run to ask again, or give the step a fallback_model.")

    def _overflowed(self, turn: Turn, *, replayed: bool) -> None:
        """The context window filled up: compact and ask again, once; a second overflow fails the step."""
        if replayed and self.compacted is not None and turn.index < self.compacted.turn:
            self.overflowed = True  # compacted after it already: the turn after it was the one retry
            return None
        if self.overflowed or self.conversation.fold_point(self.keep) is None:
            raise ContextWindowExceededError(
                f"the conversation outgrew the context window at turn {turn.index}"
                + (" again after compaction" if self.overflowed else " and there is nothing to compact")
            )
        self.overflowed = True
        self.must_compact = True
        return None

    def _truncated(self, turn: Turn, *, replayed: bool) -> None:
        """Cut inside a tool call (or its thinking): not an answer. Asked again with twice the max_tokens, up to
        the model's limit; a resume after the limit was raised in code asks again as well."""
        asked_with = self._max_tokens()
        self.truncated += 1
        if replayed:
            return None
        at_limit = self.profile.known and asked_with >= self.profile.max_output
        if at_limit or self.truncated > MAX_TRUNCATED_RETRIES:
            why = f"at {self.model}'s limit" if at_limit else f"{self.truncated} times in a row"
            raise AgentLimitError(
                f"turn {turn.index} hit max_tokens ({asked_with}) inside a tool call or its thinking, {why}; "
                "raise the agent's max_tokens (or lower its effort) and resume the run"
            )
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
        self.must_compact = False
        point = self.conversation.fold_point(self.keep)
        if point is None:
            raise ContextWindowExceededError(
                "the conversation outgrew the context window and there is nothing to compact"
            )
        request = self.conversation.compaction_request(
            replace(self.base, model=self.model), point, turn_number=self.turn_number
        )
        # The request is a prefix of the last prompt plus the instruction: the last prompt bounds it.
        measured = (
            self.measured.tokens if self.measured else estimate_prompt(request.as_kwargs(), request.messages, None)
        )
        self.budget.check(
            model=request.model,
            prompt_tokens=measured + estimate_tokens(COMPACTION_INSTRUCTION),
            max_tokens=request.max_tokens,
            purpose=f"compaction before turn {self.turn_number}",
            batch=self.batch is not None,
        )
        # The largest prompt there is: a thawed zombie must stop before asking for it again (`ask` proves it).
        response = ask(self.ctx, self.participant, request, batch=self.batch, index=self.next_index, purpose=COMPACTION)
        folded_errors = sum(n for index, n in self.errors_by_turn.items() if index < point.covers_until)
        compacted = Compacted(
            summary=summary_text(response, request),
            covers_until=point.covers_until,
            turn=self.next_index,
            compactions=self.compactions + 1,
            prompt_tokens_before=measured,
            tool_errors=(self.compacted.tool_errors if self.compacted else 0) + folded_errors,
        )
        head = self.head if self.unfrozen else None
        journal_turn(
            self.ctx, self.next_index, request, response, self.participant.name, compacted=compacted, head=head
        )
        self.unfrozen = False
        self.conversation.fold(compacted, point)
        self.errors_by_turn = {i: n for i, n in self.errors_by_turn.items() if i >= point.covers_until}
        self.next_index += 1
        self.compactions += 1
        self.measured = None


def _is_truncated(turn: Turn) -> bool:
    """A max_tokens turn cut inside a tool call, or before any text (inside its thinking): nothing to continue."""
    if turn.stop_reason != "max_tokens":
        return False
    content = turn.content or []
    return not content or content[-1].get("type") == "tool_use" or not any(b.get("type") == "text" for b in content)


def _first_prompt(ctx: Any, spec: AgentSpec) -> Any:
    """The step's first user message: built by its code, or, in a replay run, the one its recording sent."""
    recorded, prompt = recorded_prompt(ctx)
    return prompt if recorded else _initial_content(ctx, spec)


def _initial_content(ctx: Any, spec: AgentSpec) -> Any:
    if spec.prompt is not None:
        return spec.prompt(ctx)
    return json.dumps(ctx.input, cls=DjangoJSONEncoder)


def _step_journal(step_pk: int) -> tuple[Any, Any, int | None]:
    """The step's stored context, its frozen head and its last journaled turn's index (None: none yet)."""
    if turnpath.is_available():
        return turnpath.step_journal(step_pk) or (None, None, None)
    row = Step.objects.filter(pk=step_pk).values_list("context", "frozen_request").first()
    last = Turn.objects.filter(step_id=step_pk).aggregate(last=Max("index"))["last"]
    return (*(row or (None, None)), last)


def _prompt_tokens(turn: Turn) -> int:
    return turn.input_tokens + turn.cache_write_tokens + turn.cache_read_tokens


def _run_tools(ctx: Any, turn: Turn, tools: dict[str, Tool[..., Any]]) -> tuple[list[dict[str, Any]], Spent | None]:
    """Run this turn's tool calls (concurrently, effects keyed by tool_use_id) and store their results on the turn:
    the results, and the lease's proof if the write made one (Postgres: write_tool_results)."""
    results = run_calls(ctx, [block for block in turn.content if block.get("type") == "tool_use"], tools)
    # Fenced: a zombie (its run taken over) must not write the results the live worker will journal.
    proof = None
    if turnpath.is_available():
        written = proof = write_tool_results(ctx, turn.pk, results)
    else:
        written = Turn.objects.filter(pk=turn.pk, tool_results__isnull=True, run__lease_token=ctx.lease_token).update(
            tool_results=results
        )
    if not written:
        raise LeaseLostError(f"run {ctx.run_id} was taken over; the results of turn {turn.index} were not written")
    return results, proof
