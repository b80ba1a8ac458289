"""The fake Anthropic API's request log: what each request was, whose conversation, which turn, which attempt."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from durable_agents.testing.fake_cache import blocks, canonical

if TYPE_CHECKING:
    from durable_agents.testing.fake_replies import Fault, Reply

__all__ = ["CONVERSATION_HEADER", "RecordedRequest", "RequestLog", "Responder", "identify"]

CONVERSATION_HEADER = "x-durable-conversation"


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it; credentials are already redacted. `refused` is the error it was answered
    with when the fake refused it (a 400 or 404 message), else None. `batch_id` is the `msgbatch_...` a batched
    request came in (its path is still "/v1/messages", so `count` counts it), None for a live request."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    conversation: str
    turn: int
    attempt: int
    time: float
    retry_count: int | None = None  # the SDK's `x-stainless-retry-count`
    refused: str | None = None
    batch_id: str | None = None

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages = self.body.get("messages") if isinstance(self.body, dict) else None
        return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def last_user_text(self) -> str:
        """The text of the last user message (tool results excluded), for responders that answer by prompt."""
        content = blocks(self._last_user_content())
        return "".join(b.get("text", "") for b in content if b.get("type") == "text")

    @property
    def tool_results(self) -> list[dict[str, Any]]:
        """The `tool_result` blocks of the last user message."""
        return [b for b in blocks(self._last_user_content()) if b.get("type") == "tool_result"]

    def _last_user_content(self) -> Any:
        users = [m for m in self.messages if m.get("role") == "user"]
        return users[-1].get("content") if users else None


Responder = Callable[[RecordedRequest], "Reply | Fault | None"]


def identify(headers: Mapping[str, str], body: Any) -> tuple[str, int]:
    """(conversation, turn): metadata.user_id, else the conversation header, else the first user message."""
    if not isinstance(body, dict):
        return "", 0
    # Refused requests are logged too: a malformed body must identify as something, never raise.
    listed = body.get("messages")
    messages = [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    user_id = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if user_id:
        return str(user_id), turn
    if headers.get(CONVERSATION_HEADER):
        return headers[CONVERSATION_HEADER], turn
    first = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    # Moving cache breakpoints must not change a conversation's identity, so they are stripped first.
    digest = hashlib.sha256(
        canonical([{k: v for k, v in b.items() if k != "cache_control"} for b in blocks(first)]).encode()
    ).hexdigest()
    return f"conv_{digest[:16]}", turn


class RequestLog:
    """Every request the fake received, in order, each numbered as an attempt at its (path, conversation, turn)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[RecordedRequest] = []

    def record(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: Any,
        *,
        refused: str | None = None,
        batch_id: str | None = None,
    ) -> RecordedRequest:
        conversation, turn = identify(headers, body)
        retry = headers.get("x-stainless-retry-count", "")
        with self._lock:
            key = (path, conversation, turn)
            attempt = 1 + sum(1 for r in self._requests if (r.path, r.conversation, r.turn) == key)
            request = RecordedRequest(
                method=method,
                path=path,
                headers=headers,
                body=body,
                conversation=conversation,
                turn=turn,
                attempt=attempt,
                time=time.time(),
                retry_count=int(retry) if retry.isdigit() else None,
                refused=refused,
                batch_id=batch_id,
            )
            self._requests.append(request)
        return request

    def all(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
