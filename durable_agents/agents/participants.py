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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.utils.module_loading import import_string

from durable_agents.agents.compaction import deterministic_summary
from durable_agents.agents.messages import (
    COMPACTION,
    TURN,
    ModelRequest,
    ModelResponse,
    Participant,
    Usage,
    estimate_tokens,
    text,
    tool_use,
)
from durable_agents.errors import UnknownParticipantError

__all__ = [
    "COMPACTION",
    "TURN",
    "FunctionParticipant",
    "ModelRequest",
    "ModelResponse",
    "Participant",
    "ParticipantRegistry",
    "ScriptedParticipant",
    "Usage",
    "estimate_tokens",
    "participants",
    "text",
    "tool_use",
]
# The real model, created on first use: importing the Anthropic SDK is left to processes that need it.
ANTHROPIC = "durable_agents.agents.claude.AnthropicParticipant"


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
        blocks = tuple(
            {**block, "id": block.get("id", _tool_use_id(request, i))} if block.get("type") == "tool_use" else block
            for i, block in enumerate(content)
        )
        stop = "tool_use" if any(b.get("type") == "tool_use" for b in blocks) else "end_turn"
        usage = Usage(input_tokens=estimate_tokens(request.as_kwargs()), output_tokens=estimate_tokens(blocks))
        return ModelResponse(content=blocks, stop_reason=stop, model=f"{self.name}:{request.model}", usage=usage)

    def _summary(self, request: ModelRequest) -> ModelResponse:
        summary = self.summarize(request) if self.summarize is not None else deterministic_summary(request)
        blocks = (text(summary),)
        usage = Usage(input_tokens=estimate_tokens(request.as_kwargs()), output_tokens=estimate_tokens(summary))
        return ModelResponse(content=blocks, stop_reason="end_turn", model=f"{self.name}:{request.model}", usage=usage)


def _tool_use_id(request: ModelRequest, index: int) -> str:
    """A deterministic tool_use id: the same when the same plan row asks the same turn again (a rebuilt
    conversation must not differ), a new one for a new plan row (a redo, a re-plan), as Claude's would be."""
    row = hashlib.sha256(request.step_key.encode()).hexdigest()[:8] if request.step_key else "00000000"
    return f"toolu_{row}_{request.turn:03d}_{index:02d}"


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
        self._lock = threading.Lock()  # threads of one worker share one Anthropic participant (one client)

    def register(self, name: str, participant: Participant) -> Participant:
        self._participants[name] = participant
        return participant

    def unregister(self, name: str) -> None:
        """Forget `name`; "anthropic" is then made afresh on next use (its client reads the environment again)."""
        self._participants.pop(name, None)

    @contextmanager
    def isolated(self) -> Iterator[ParticipantRegistry]:
        """Undo, at the end of the block, every registration and removal made in it: for tests.

        Example::

            with participants.isolated():
                participants.register("anthropic", ScriptedParticipant(script))
        """
        saved = dict(self._participants)
        try:
            yield self
        finally:
            with self._lock:
                self._participants = saved

    def get(self, name: str) -> Participant:
        if name not in self._participants and name == "anthropic":
            with self._lock:
                if name not in self._participants:
                    self._participants[name] = import_string(ANTHROPIC)()
        try:
            return self._participants[name]
        except KeyError:
            known = ", ".join(sorted({*self._participants, "anthropic"}))
            raise UnknownParticipantError(f"unknown participant {name!r} (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted({*self._participants, "anthropic"})


participants = ParticipantRegistry()
