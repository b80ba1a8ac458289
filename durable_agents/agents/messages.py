"""What a participant is asked and answers: model requests, responses and usage, as plain frozen values.

The vocabulary every participant (the Anthropic model, a script, a function), the agent loop, compaction
and judges share; it depends on nothing else in durable_agents.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    # Sent when set: the model table (capabilities.py) decides what a model takes.
    thinking: Mapping[str, Any] | None = None
    output_config: Mapping[str, Any] | None = None
    tool_choice: Mapping[str, Any] | None = None
    # Not sent: "turn" (the agent's next move) or "compaction" (summarise the conversation as text).
    purpose: str = TURN
    # Not sent: how many agent turns the step journaled before this one (compaction calls excluded).
    turn_number: int | None = None
    # Not sent: which plan row asks (its step's primary key), so scripted tool_use ids differ after a redo
    # or re-plan as Claude's would, and stay the same when the same row asks again after a crash.
    step_key: str = ""

    def as_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": list(self.messages)}
        if self.system:
            kwargs["system"] = self.system
        if self.tools:
            kwargs["tools"] = list(self.tools)
        if self.metadata:
            kwargs["metadata"] = dict(self.metadata)
        if self.thinking is not None:
            kwargs["thinking"] = dict(self.thinking)
        if self.output_config:
            kwargs["output_config"] = dict(self.output_config)
        if self.tool_choice:
            kwargs["tool_choice"] = dict(self.tool_choice)
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
    # Answered through the Message Batches API: billed at BATCH_PRICE_FACTOR of the live price.
    batch: bool = False


class Participant(Protocol):
    """Answers a ModelRequest; when `request.purpose == "compaction"`, with a text summary of the conversation.

    A participant with a true `remote` attribute waits on the network: the step gives its database connection
    back while it answers (see `journal.ask`).
    """

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
