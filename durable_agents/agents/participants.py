"""Participants answer model turns: the Anthropic model, a deterministic script, or a plain function.

A participant takes a ModelRequest and returns a ModelResponse; the agent loop journals every response
before acting on it, so any participant can take over a run mid-way from the journal. A request whose
`purpose` is "compaction" asks for a summary of the conversation so far (text): the Anthropic model
writes one; function and scripted participants answer with a deterministic one, without calling the script.

Example::

    from durable_agents.agents.participants import ScriptedParticipant, participants, text, tool_use

    def refund_script(request):
        if not request.tool_results:
            return [tool_use("lookup_order", {"order_id": "A-1"})]
        return [text("Done.")]

    participants.register("refund-script", ScriptedParticipant(refund_script))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from durable_agents.errors import UnknownParticipantError

TURN = "turn"
COMPACTION = "compaction"


@dataclass(frozen=True)
class Usage:
    """Tokens one model call was billed for; `cache_write_1h_tokens` is the part of the writes with a 1 h TTL."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_write_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_1h_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt, however it was billed (uncached, written to the cache, read from it)."""
        return self.input_tokens + self.cache_write_tokens + self.cache_read_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class ModelRequest:
    """What the agent loop asks: the Messages API parameters, nothing secret."""

    model: str
    max_tokens: int
    system: Any
    tools: Sequence[Mapping[str, Any]]
    messages: Sequence[Mapping[str, Any]]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # Not sent: "turn" (the agent's next move) or "compaction" (summarise the conversation as text).
    purpose: str = TURN
    # Not sent: how many agent turns the step journaled before this one (compaction calls excluded).
    turn_number: int | None = None

    def as_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": list(self.messages)}
        if self.system:
            kwargs["system"] = self.system
        if self.tools:
            kwargs["tools"] = list(self.tools)
        if self.metadata:
            kwargs["metadata"] = dict(self.metadata)
        return kwargs

    def digest(self) -> str:
        raw = json.dumps(self.as_kwargs(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(raw.encode()).hexdigest()

    @property
    def tool_results(self) -> list[Mapping[str, Any]]:
        """The tool_result blocks of the last user message (what the tools answered last)."""
        last = self.messages[-1] if self.messages else {}
        content = last.get("content") if last.get("role") == "user" else None
        return [b for b in content if b.get("type") == "tool_result"] if isinstance(content, list) else []

    @property
    def turn(self) -> int:
        """How many agent turns came before this one: 0 for the first request, and so on.

        Counted by the agent loop, so it keeps counting after compaction folded old turns into a summary.
        """
        if self.turn_number is not None:
            return self.turn_number
        return sum(1 for m in self.messages if m.get("role") == "assistant")


@dataclass(frozen=True)
class ModelResponse:
    """One model answer, as journaled: content blocks as plain dicts."""

    content: tuple[Mapping[str, Any], ...]
    stop_reason: str
    model: str
    usage: Usage = Usage()
    request_id: str = ""
    stop_details: Mapping[str, Any] | None = None


class Participant(Protocol):
    """Answers a ModelRequest; when `request.purpose == "compaction"`, with a text summary of the conversation."""

    name: str

    def respond(self, request: ModelRequest) -> ModelResponse: ...


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def tool_use(name: str, input: Mapping[str, Any], *, id: str | None = None) -> dict[str, Any]:  # noqa: A002
    """A tool_use block; without an id, the participant derives a deterministic one from the turn."""
    block = {"type": "tool_use", "name": name, "input": dict(input)}
    return {**block, "id": id} if id else block


def estimate_tokens(value: Any) -> int:
    """About four characters a token: a deterministic stand-in for usage when no model is called."""
    return max(1, len(json.dumps(value, default=str)) // 4)


class FunctionParticipant:
    """A plain Python function answers: it returns a ModelResponse, content blocks, or a string.

    The stop reason is `tool_use` when the content holds a tool_use block, else `end_turn`. Compaction
    requests go to `summarize(request) -> str` (default: a deterministic, bounded summary of the tool calls),
    so a script never has to know about compaction.
    """

    def __init__(
        self,
        fn: Callable[[ModelRequest], Any],
        *,
        name: str = "function",
        summarize: Callable[[ModelRequest], str] | None = None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.summarize = summarize

    def respond(self, request: ModelRequest) -> ModelResponse:
        if request.purpose == COMPACTION:
            return self._summary(request)
        answer = self.fn(request)
        if isinstance(answer, ModelResponse):
            return answer
        content = [text(answer)] if isinstance(answer, str) else list(answer)
        # Fresh ids per call would make a rebuilt conversation differ; derive them from the turn instead.
        blocks = tuple(
            {**block, "id": block.get("id", f"toolu_{request.turn:03d}_{i:02d}")}
            if block.get("type") == "tool_use"
            else block
            for i, block in enumerate(content)
        )
        stop = "tool_use" if any(b.get("type") == "tool_use" for b in blocks) else "end_turn"
        usage = Usage(input_tokens=estimate_tokens(request.as_kwargs()), output_tokens=estimate_tokens(blocks))
        return ModelResponse(content=blocks, stop_reason=stop, model=f"{self.name}:{request.model}", usage=usage)

    def _summary(self, request: ModelRequest) -> ModelResponse:
        if self.summarize is not None:
            summary = self.summarize(request)
        else:
            # Imported here: compaction builds on this module's request and response types.
            from durable_agents.agents.compaction import deterministic_summary

            summary = deterministic_summary(request)
        blocks = (text(summary),)
        usage = Usage(input_tokens=estimate_tokens(request.as_kwargs()), output_tokens=estimate_tokens(summary))
        return ModelResponse(content=blocks, stop_reason="end_turn", model=f"{self.name}:{request.model}", usage=usage)


class ScriptedParticipant(FunctionParticipant):
    """A deterministic script plays the model: offline, for tests, the demo, and runs without an API key."""

    def __init__(
        self,
        script: Callable[[ModelRequest], Any],
        *,
        name: str = "scripted",
        summarize: Callable[[ModelRequest], str] | None = None,
    ) -> None:
        super().__init__(script, name=name, summarize=summarize)


class ParticipantRegistry:
    """Participants by name; "anthropic" (the real model) is always there."""

    def __init__(self) -> None:
        self._participants: dict[str, Participant] = {}

    def register(self, name: str, participant: Participant) -> Participant:
        self._participants[name] = participant
        return participant

    def get(self, name: str) -> Participant:
        if name not in self._participants and name == "anthropic":
            from durable_agents.agents.claude import AnthropicParticipant

            self._participants[name] = AnthropicParticipant()
        try:
            return self._participants[name]
        except KeyError:
            known = ", ".join(sorted({*self._participants, "anthropic"}))
            raise UnknownParticipantError(f"unknown participant {name!r} (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted({*self._participants, "anthropic"})


participants = ParticipantRegistry()
