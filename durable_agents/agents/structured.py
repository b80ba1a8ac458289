"""One tool call's arguments as an answer (a judge's verdict, a planner's plan), on every model, journaled.

A model that takes forced tool use (and is not thinking) is sent `tool_choice: {"type": "tool", ...}`. Today's
models refuse that with a 400 (Sonnet 5.5, Opus 5.5, Fable 5.1+: "tool_choice: type "tool" and "any" are not
supported for this model"; every model while thinking), so they get `auto` with parallel calls off, and the
instructions say to call the tool; an answer without a valid call is sent back — the assistant turn as received,
thinking blocks and all, then a tool_result with the problem or a user message asking for the call — and the
model asked again, up to `max_asks` times an execution (the answers a re-execution replays do not count, so an
operator's resume after "raise max_tokens" or a refusal asks again). The migration guide's advice:
https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide

Every answer is journaled (Turn, purpose "judge" or "planner") before it is read, and the step's first call
freezes its head (model, system, tools, prompt, thinking, effort); a re-executed step reads the journaled answers
in order and asks only when none of them holds a valid call: a verdict or plan, once given, is replayed, never
asked for again. A turn cut inside the call (max_tokens) is set aside and asked again with twice the max_tokens;
a refusal fails the step with its category and explanation (a resume asks again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db.models import Max

from durable_agents import tracing
from durable_agents.agents.batching import step_batch
from durable_agents.agents.candidate import replay_head
from durable_agents.agents.capabilities import ModelChoice, model_profile
from durable_agents.agents.journal import ask, frozen_head, journal_call
from durable_agents.agents.messages import ModelRequest, Participant
from durable_agents.errors import AgentLimitError, ModelRefusalError, PermanentError
from durable_agents.models import Turn
from durable_agents.workflows import Batch

# The model's arguments → (the answer, None) when they hold one, else (None, what is wrong with them).
Reader = Callable[[dict[str, Any]], tuple[Any, str | None]]


@dataclass(frozen=True)
class Form:
    """What a judge or planner asks for: one call of `tool`, read by `read`."""

    purpose: str
    tool: dict[str, Any]
    system: str
    prompt: Any
    choice: ModelChoice
    read: Reader
    max_asks: int = 3
    answer: str = "answer"  # what the call holds, in messages: "verdict", "plan"
    # None: the workflow's delivery; "live"; or a Batch (each call in a Message Batch: batching.py).
    delivery: Batch | str | None = None


def ask_for_call(ctx: Any, participant: Participant, form: Form) -> tuple[Any, Turn]:
    """The answer and the turn it came in: from the journal when a journaled turn holds one, else asked for."""
    return _Asking(ctx, participant, form).run()


class _Asking:
    def __init__(self, ctx: Any, participant: Participant, form: Form) -> None:
        self.ctx = ctx
        self.participant = participant
        self.form = form
        frozen = frozen_head(ctx)
        self.head = frozen or replay_head(
            ctx,
            {
                "model": form.choice.resolved_model,
                "system": form.system,
                "tools": [form.tool],
                "prompt": form.prompt,
                "thinking": form.choice.thinking,
                "output_config": form.choice.output_config(),
            },
            agent=False,
        )
        self.unfrozen = frozen is None
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": self.head["prompt"]}]
        self.asked = 0
        self.truncated = 0
        self.problem = ""

    @property
    def name(self) -> str:
        return str(self.form.tool["name"])

    def run(self) -> tuple[Any, Turn]:
        journal = Turn.objects.filter(step_id=self.ctx.step.pk, purpose=self.form.purpose).order_by("index")
        traced = tracing.current()
        for turn in journal:
            traced.event("model turn replayed from journal", {tracing.MODEL_TURN: turn.index})
            found = self._consider(turn, replayed=True)
            if found is not None:
                return found, turn
        while self.asked < self.form.max_asks:
            turn = self._ask()
            found = self._consider(turn, replayed=False)
            if found is not None:
                return found, turn
        raise PermanentError(
            f"{self.form.purpose} {self.ctx.step_id!r} produced no valid {self.form.answer} in {self.form.max_asks} "
            f"attempts" + (f"; the last problem: {self.problem}" if self.problem else "")
        )

    def _ask(self) -> Turn:
        profile = model_profile(self.head["model"])
        thinking = self.head.get("thinking")
        if profile.accepts_forced_tool(thinking):
            tool_choice: dict[str, Any] = {"type": "tool", "name": self.name}
        else:
            tool_choice = {"type": "auto", "disable_parallel_tool_use": True}
        max_tokens = self.form.choice.max_tokens * 2**self.truncated
        request = ModelRequest(
            model=self.head["model"],
            max_tokens=min(max_tokens, profile.max_output) if profile.known else max_tokens,
            system=self.head["system"],
            tools=self.head["tools"],
            messages=list(self.messages),
            metadata={"user_id": f"{self.ctx.run_id}:{self.ctx.step_id}"},
            thinking=thinking,
            output_config=self.head.get("output_config"),
            tool_choice=tool_choice,
            step_key=str(self.ctx.step.pk),
        )
        self.asked += 1
        batch = step_batch(self.ctx, self.form.delivery)
        index = None
        if batch is not None:
            last = Turn.objects.filter(step_id=self.ctx.step.pk).aggregate(last=Max("index"))["last"]
            index = 0 if last is None else last + 1
        response = ask(self.ctx, self.participant, request, batch=batch, index=index, purpose=self.form.purpose)
        head = self.head if self.unfrozen else None
        turn = journal_call(self.ctx, self.form.purpose, request, response, self.participant.name, head=head)
        self.unfrozen = False
        return turn

    def _consider(self, turn: Turn, *, replayed: bool) -> Any:
        """The answer this turn holds, or None after adding to the conversation what asks for a better one."""
        content = [dict(b) for b in turn.content]
        if turn.stop_reason == "refusal":
            if replayed:
                return None  # a resume asks again
            details = turn.stop_details or {}
            why = f"category {details.get('category') or 'none'}"
            if details.get("explanation"):
                why += f": {details['explanation']}"
            raise ModelRefusalError(
                f"the model refused the {self.form.purpose} {self.ctx.step_id!r} ({why}); resume the run to ask again"
            )
        calls = [b for b in content if b.get("type") == "tool_use"]
        if turn.stop_reason == "max_tokens" and (not content or content[-1].get("type") in ("tool_use", "thinking")):
            self.truncated += 1
            if not replayed and self.truncated >= self.form.max_asks:
                raise AgentLimitError(
                    f"the {self.form.purpose} {self.ctx.step_id!r} hit max_tokens inside its answer "
                    f"{self.truncated} times; raise its max_tokens (or lower its effort) and resume the run"
                )
            return None
        self.truncated = 0
        if not content:
            self.problem = "an empty answer"
            return None  # asked again as it was: an empty assistant message cannot be sent back
        mine = next((b for b in calls if b.get("name") == self.name), None)
        if mine is not None:
            answer, self.problem = self.form.read(mine.get("input") or {})
            if self.problem is None:
                return answer
        else:
            self.problem = f"answered without calling {self.name}"
        results = [
            {
                "type": "tool_result",
                "tool_use_id": b["id"],
                "is_error": True,
                "content": self.problem if b is mine else f"Call {self.name} once, with your whole answer.",
            }
            for b in calls
        ]
        nudge = [] if mine is not None else [{"type": "text", "text": f"Call {self.name} now with your answer."}]
        self.messages += [{"role": "assistant", "content": content}, {"role": "user", "content": [*results, *nudge]}]
        return None
