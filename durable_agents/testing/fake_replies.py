"""What the fake Anthropic API can serve: replies (every documented response shape), faults, and their SSE spelling.

Content blocks are plain dicts in the API's own shape. Ids (`toolu_...`), thinking signatures and
redacted_thinking data left as None are filled in when the block is served: a signature binds the block to the
request it answers, so it can only be minted then (see `thinking_binding`).

Example::

    Reply.thinking("Compare both plans.", Reply.tool_use("search", {"q": "otters"}))
    Reply.refusal("cyber", "This looks like malware development.")
    Fault.spend_limit()      # the usage-tier cap: 429 without retry-after, until the 1st of next month
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from durable_agents.testing.api_models import ModelRules
from durable_agents.testing.api_rules import THINKING_KINDS, thinking_on, thinking_type
from durable_agents.testing.fake_cache import last_breakpoint_ttl, output_tokens
from durable_agents.testing.thinking_binding import Binding, Signer, prefix_of

__all__ = [
    "ERROR_TYPES",
    "REFUSAL_CATEGORIES",
    "STOP_REASONS",
    "Fault",
    "Reply",
    "redacted_thinking_block",
    "server_tool_use_block",
    "text_block",
    "thinking_block",
    "tool_use_block",
]

# https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons
STOP_REASONS = frozenset(
    {"end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal", "model_context_window_exceeded"}
)
StopReason = Literal[
    "end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal", "model_context_window_exceeded"
]
REFUSAL_CATEGORIES = frozenset({"cyber", "bio", "frontier_llm", "reasoning_extraction", "general_harms", None})

# Status → Anthropic error type, as documented at https://platform.claude.com/docs/en/api/errors.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_STREAM_CHUNK_CHARS = 16
# What an auto-served thinking block says when the request asks for a summary (display "summarized").
_AUTO_SUMMARY = "Considering the request before answering."


def text_block(text: str) -> dict[str, Any]:
    """A `text` content block for `Reply(content=[...])`."""
    return {"type": "text", "text": text}


def tool_use_block(name: str, input: Mapping[str, Any], *, id: str | None = None) -> dict[str, Any]:
    """A `tool_use` content block; without `id` a fresh `toolu_...` id is minted each time it is served."""
    return {"type": "tool_use", "id": id, "name": name, "input": dict(input)}


def server_tool_use_block(name: str, input: Mapping[str, Any], *, id: str | None = None) -> dict[str, Any]:
    """A `server_tool_use` block (a tool the API runs, e.g. ``web_search``); the id is a minted `srvtoolu_...`."""
    return {"type": "server_tool_use", "id": id, "name": name, "input": dict(input)}


def thinking_block(thinking: str = "", *, signature: str | None = None) -> dict[str, Any]:
    """A `thinking` block; its signature is minted when served (pass one only to serve a forged block)."""
    return {"type": "thinking", "thinking": thinking, "signature": signature}


def redacted_thinking_block(data: str | None = None) -> dict[str, Any]:
    """A `redacted_thinking` block: opaque `data`, minted when served like a signature."""
    return {"type": "redacted_thinking", "data": data}


@dataclass(frozen=True)
class Reply:
    """One assistant message the fake will serve, e.g. ``Reply.text("hi")`` or ``Reply(content=[...], ...)``.

    When the request thinks (an explicit thinking type, or the model's default), a reply without a thinking
    block is served with one in front, signed, unless the fake was built with ``auto_thinking=False``.
    """

    content: Sequence[Mapping[str, Any]] = ()
    stop_reason: StopReason = "end_turn"
    stop_sequence: str | None = None
    output_tokens: int | None = None  # None: estimated from the content
    stop_details: Mapping[str, Any] | None = None  # only with stop_reason "refusal"

    def __post_init__(self) -> None:
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"unknown stop_reason {self.stop_reason!r}; use one of {sorted(STOP_REASONS)}")
        if self.stop_details is not None and self.stop_reason != "refusal":
            # handling-stop-reasons: stop_details is null for every stop reason but refusal.
            raise ValueError("stop_details is only served with stop_reason='refusal'")
        # A tuple of copies so a Reply enqueued once cannot be changed by the test that built it.
        object.__setattr__(self, "content", tuple(dict(block) for block in self.content))

    @classmethod
    def text(cls, text: str, *, stop_reason: StopReason = "end_turn", stop_sequence: str | None = None) -> Reply:
        """A single text block: ``Reply.text("Paris.")`` or ``Reply.text("Par", stop_reason="max_tokens")``."""
        return cls(content=[text_block(text)], stop_reason=stop_reason, stop_sequence=stop_sequence)

    @classmethod
    def tool_use(cls, name: str, input: Mapping[str, Any], *, id: str | None = None, text: str | None = None) -> Reply:
        """A tool call, optionally after some text: ``Reply.tool_use("search", {"q": "otters"})``."""
        blocks = [text_block(text)] if text else []
        return cls(content=[*blocks, tool_use_block(name, input, id=id)], stop_reason="tool_use")

    @classmethod
    def parallel_tool_use(cls, *calls: tuple[str, Mapping[str, Any]], text: str | None = None) -> Reply:
        """Several tool calls in one turn: ``Reply.parallel_tool_use(("a", {}), ("b", {"x": 1}))``."""
        blocks = [text_block(text)] if text else []
        return cls(content=[*blocks, *(tool_use_block(n, i) for n, i in calls)], stop_reason="tool_use")

    @classmethod
    def thinking(cls, thinking: str, then: Reply | str = "ok") -> Reply:
        """A thinking block, then `then` (a Reply, or text): ``Reply.thinking("plan", Reply.tool_use(...))``."""
        after = Reply.text(then) if isinstance(then, str) else then
        return cls(
            content=[thinking_block(thinking), *after.content],
            stop_reason=after.stop_reason,
            stop_sequence=after.stop_sequence,
            stop_details=after.stop_details,
        )

    @classmethod
    def refusal(
        cls, category: str | None = "general_harms", explanation: str | None = None, *, text: str = ""
    ) -> Reply:
        """stop_reason "refusal" with `stop_details` (HTTP 200): ``Reply.refusal("cyber")``."""
        if category not in REFUSAL_CATEGORIES:
            raise ValueError(f"unknown refusal category {category!r}; use one of {REFUSAL_CATEGORIES}")
        details = {"type": "refusal", "category": category, "explanation": explanation}
        return cls(content=[text_block(text)] if text else [], stop_reason="refusal", stop_details=details)

    @classmethod
    def pause_turn(cls, name: str = "web_search", input: Mapping[str, Any] | None = None) -> Reply:
        """A server tool loop that hit its iteration limit: a `server_tool_use` with no result, stop "pause_turn"."""
        return cls(content=[server_tool_use_block(name, input or {"query": "..."})], stop_reason="pause_turn")

    @classmethod
    def truncated_tool_use(cls, name: str, partial_input: Mapping[str, Any], *, text: str | None = None) -> Reply:
        """Out of tokens inside a tool call: the last block is an incomplete `tool_use`, stop "max_tokens".

        A stream sends the input's JSON without its closing brace, as a cut-off generation would.
        """
        block = {**tool_use_block(name, partial_input), "_truncated": True}
        blocks = [text_block(text)] if text else []
        return cls(content=[*blocks, block], stop_reason="max_tokens")

    @classmethod
    def context_window_exceeded(cls, text: str = "The answer ran into the end of the context") -> Reply:
        """stop_reason "model_context_window_exceeded": the response filled the context window."""
        return cls.text(text, stop_reason="model_context_window_exceeded")


@dataclass(frozen=True)
class Fault:
    """A failure to serve instead of a reply; build one with `status`, `delay`, `reset`, `stream_error`,
    `spend_limit`, `retired_model`, `too_large`, or (batched requests only) `expired` and `canceled`."""

    kind: Literal["status", "delay", "reset", "stream_error", "expired", "canceled"]
    status_code: int = 0
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    then: Reply | None = None
    mid_stream: bool = False
    partial_text: str = ""
    model_in_message: bool = False  # "model: {model}" is filled with the request's model when served

    @classmethod
    def status(
        cls, code: int, body: Mapping[str, Any] | str | None = None, headers: Mapping[str, str] | None = None
    ) -> Fault:
        """An HTTP error with an Anthropic error body: ``Fault.status(429, headers={"retry-after": "2"})``.

        `body` may be the whole JSON body, or just the message; by default the error type follows the status.
        """
        if not isinstance(body, Mapping):
            body = error_body(error_type(code), body or f"fake {code} from FakeAnthropic")
        return cls(kind="status", status_code=code, body=dict(body), headers=dict(headers or {}))

    @classmethod
    def spend_limit(cls, resumes: str = "2027-01-01") -> Fault:
        """The usage-tier monthly spend cap, exactly as https://platform.claude.com/docs/en/api/errors shows it:
        429 rate_limit_error, ``error.details.error_code = "enforced_spend_limit_reached"``, no retry-after."""
        body = error_body(
            "rate_limit_error",
            "You have reached your API usage limits: your organization has crossed its monthly API usage threshold, "
            f"set based on your organization's API tier. You will regain access on {resumes} at 00:00 UTC.",
        )
        body["error"]["details"] = {"error_code": "enforced_spend_limit_reached"}
        return cls(kind="status", status_code=429, body=body)

    @classmethod
    def retired_model(cls, model: str | None = None) -> Fault:
        """404 not_found_error "model: <id>", what a retired model answers (the request's model by default)."""
        return cls(
            kind="status",
            status_code=404,
            body=error_body("not_found_error", f"model: {model or '{model}'}"),
            model_in_message=model is None,
        )

    @classmethod
    def too_large(cls) -> Fault:
        """413 request_too_large (bodies over 32 MB; the fake also answers it for real ones)."""
        return cls.status(413, "Request exceeds the maximum allowed number of bytes.")

    @classmethod
    def delay(cls, seconds: float, then: Reply | None = None) -> Fault:
        """Sleep before answering (with `then`, else the responder's or default reply): outlast a client timeout."""
        return cls(kind="delay", seconds=seconds, then=then)

    @classmethod
    def reset(cls, *, mid_stream: bool = False) -> Fault:
        """Drop the TCP connection with a RST; with `mid_stream`, a streaming request first gets headers and events."""
        return cls(kind="reset", mid_stream=mid_stream)

    @classmethod
    def stream_error(
        cls, error_type: str = "overloaded_error", message: str = "Overloaded", *, partial_text: str = ""
    ) -> Fault:
        """A 200 stream that sends `message_start` (and `partial_text`), then ``event: error``.

        A non-streaming request gets the matching HTTP status instead (529 for `overloaded_error`).
        """
        code = next((c for c, t in ERROR_TYPES.items() if t == error_type), 500)
        return cls(
            kind="stream_error", status_code=code, body=error_body(error_type, message), partial_text=partial_text
        )

    @classmethod
    def expired(cls) -> Fault:
        """A batched request that ends `expired` (its batch ran out of time before it was processed).

        Batch-only: served to a live `/v1/messages` request it is a 500 saying so, never a silent success.
        """
        return cls._batch_only("expired")

    @classmethod
    def canceled(cls) -> Fault:
        """A batched request that ends `canceled` (its batch was cancelled before it was processed). Batch-only."""
        return cls._batch_only("canceled")

    @classmethod
    def _batch_only(cls, kind: Literal["expired", "canceled"]) -> Fault:
        message = (
            f"Fault.{kind}() is a Message Batches result and was served to a live /v1/messages request; "
            "script it for batched requests only"
        )
        return cls(
            kind=kind, status_code=500, body=error_body("api_error", message), headers={"x-should-retry": "false"}
        )


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": f"req_01{uuid.uuid4().hex[:22]}",
    }


def mint_ids(block: Mapping[str, Any]) -> dict[str, Any]:
    if block.get("type") in ("tool_use", "server_tool_use") and not block.get("id"):
        prefix = "toolu" if block["type"] == "tool_use" else "srvtoolu"
        return {**block, "id": f"{prefix}_01{uuid.uuid4().hex[:22]}"}
    return dict(block)


def _chunks(text: str) -> Iterator[str]:
    for start in range(0, len(text), _STREAM_CHUNK_CHARS):
        yield text[start : start + _STREAM_CHUNK_CHARS]


def public(block: Mapping[str, Any]) -> dict[str, Any]:
    """The block as the API shows it (the fake's private markers removed)."""
    return {k: v for k, v in block.items() if not k.startswith("_")}


def stream_events(message: dict[str, Any], truncated: Sequence[bool] = ()) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events that spell out `message`, in the order the API sends them."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "stop_details": None,
        "usage": {**usage, "output_tokens": 1},
    }
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        kind = block.get("type")
        if kind == "text":
            opening, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": c} for c in _chunks(block["text"])]
        elif kind in ("tool_use", "server_tool_use"):
            encoded = json.dumps(block.get("input", {}))
            if index < len(truncated) and truncated[index]:
                encoded = encoded[:-1]  # cut off before the closing brace, as max_tokens cuts a generation
            opening = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": ""}]
            deltas += [{"type": "input_json_delta", "partial_json": c} for c in _chunks(encoded)]
        elif kind == "thinking":
            opening = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": c} for c in _chunks(block.get("thinking", ""))]
            deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
        else:
            opening, deltas = block, []  # redacted_thinking arrives whole in its content_block_start
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
        )
        events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {
        "stop_reason": message["stop_reason"],
        "stop_sequence": message["stop_sequence"],
        "stop_details": message.get("stop_details"),
    }
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def build_message(
    body: dict[str, Any],
    reply: Reply,
    rules: ModelRules | None,
    binding: Binding,
    *,
    usage: tuple[int, int, int],
    signer: Signer,
    auto_thinking: bool,
) -> tuple[dict[str, Any], list[bool]]:
    """The message serving `reply` to `body` (ids and signatures minted), and which blocks are cut-off tool calls.

    `usage` is (input_tokens, cache_creation_input_tokens, cache_read_input_tokens); with `auto_thinking`, a
    request that thinks gets a thinking block in front of a reply that has none.
    """
    input_tokens, creation, read = usage
    content = [mint_ids(block) for block in reply.content]
    if (
        rules is not None
        and auto_thinking
        and body.get("max_tokens") != 0
        and thinking_on(body, rules)
        and not any(b.get("type") in THINKING_KINDS for b in content)
    ):
        kind = thinking_type(body, rules)
        # between_tools thinks only between tool calls, and then always as a summary (migration guide).
        if kind != "between_tools" or any(b.get("type") == "tool_use" for b in content):
            thinking = body.get("thinking") if isinstance(body.get("thinking"), dict) else {}
            display = thinking.get("display") or ("summarized" if kind == "between_tools" else rules.display)
            content.insert(0, thinking_block(_AUTO_SUMMARY if display == "summarized" else ""))
    if rules is not None:
        _sign(body, rules, content, binding, signer)
    truncated = [bool(block.get("_truncated")) for block in content]
    content = [public(block) for block in content]
    stop_sequence = reply.stop_sequence
    if reply.stop_reason == "stop_sequence" and stop_sequence is None:
        stop_sequence = next(iter(body.get("stop_sequences") or []), None)
    ttl_key = "ephemeral_1h_input_tokens" if last_breakpoint_ttl(body) > 300 else "ephemeral_5m_input_tokens"
    message: dict[str, Any] = {
        "id": f"msg_01{uuid.uuid4().hex[:22]}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", "claude-fake"),
        "content": content,
        "stop_reason": reply.stop_reason,
        "stop_sequence": stop_sequence,
        # handling-stop-reasons: an object for "refusal", null for every other stop reason.
        "stop_details": dict(reply.stop_details) if reply.stop_details else None,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": 0,
                "ephemeral_1h_input_tokens": 0,
                ttl_key: creation,
            },
            "output_tokens": reply.output_tokens if reply.output_tokens is not None else output_tokens(content),
            "service_tier": "standard",
        },
    }
    if binding.transformations:
        # preserved-thinking: reported with the thinking-binding-controls beta (on message_start when streaming).
        message["input_transformations"] = list(binding.transformations)
    return message, truncated


def _sign(
    body: dict[str, Any], rules: ModelRules, content: list[dict[str, Any]], binding: Binding, signer: Signer
) -> None:
    # Signed at serve time with this request's prefix, so sending the block back unchanged passes the check.
    prefix = prefix_of(body)
    seq = list(binding.live)
    for j, block in enumerate(content):
        kind = block.get("type")
        field_name = "signature" if kind == "thinking" else "data" if kind == "redacted_thinking" else None
        if field_name is None or block.get(field_name) is not None:
            continue
        nonce = uuid.uuid4().hex[:16]
        block[field_name] = signer.mint(
            kind=kind,
            text=block.get("thinking", "") if kind == "thinking" else "",
            signer=rules.signer or rules.model,
            prefix=prefix,
            own=[public(b) for b in content[:j]],
            seq=seq,
            nonce=nonce,
        )
        seq.append(nonce)
