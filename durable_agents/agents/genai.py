"""A model call as OpenTelemetry's GenAI semantic conventions describe it: the attributes of its `chat` span.

The names are the conventions' (`gen_ai.*`, in opentelemetry-semantic-conventions'
`_incubating/attributes/gen_ai_attributes.py`, now kept in the semantic-conventions-genai repository); the journal's
`ask` opens the span and sets them, the Anthropic participant adds `server.address` and `gen_ai.response.id`. With
DURABLE_AGENTS["TRACE_CONTENT"], the prompt and the answer go along as `gen_ai.input.messages` and
`gen_ai.output.messages` (role and parts, as the conventions shape them), redacted as the logs are; without it,
nothing of either.
"""

from __future__ import annotations

import json
from typing import Any

from durable_agents import tracing
from durable_agents.agents.messages import ModelRequest, ModelResponse, Participant
from durable_agents.agents.pricing import cost_usd
from durable_agents.errors import ContextWindowExceededError, ModelRequestError, ModelUnavailableError
from durable_agents.redaction import redact, redactor

# The model API's errors as the Anthropic participant words them (its status and the API's own message, the key
# scrubbed). Any other exception a participant raises may quote what it was asked: its text is content.
_WORDED_ERRORS = (ModelUnavailableError, ModelRequestError, ContextWindowExceededError)


def chat_attributes(ctx: Any, participant: Participant, request: ModelRequest) -> dict[str, Any]:
    """The GenAI semantic conventions' attributes of a model call, known before it is sent."""
    if not tracing.enabled():
        return {}
    attributes = {
        tracing.GEN_AI_OPERATION_NAME: tracing.CHAT,
        tracing.GEN_AI_PROVIDER_NAME: participant.name,
        tracing.GEN_AI_REQUEST_MODEL: request.model,
        tracing.GEN_AI_REQUEST_MAX_TOKENS: request.max_tokens,
        tracing.GEN_AI_CONVERSATION_ID: str(ctx.run_id),
        tracing.MODEL_PURPOSE: request.purpose,
        tracing.MODEL_TURN: request.turn,
    }
    if tracing.content_enabled():
        attributes[tracing.GEN_AI_INPUT_MESSAGES] = redactor()(json.dumps(_messages_of(request), default=str))
    return attributes


def answer_attributes(answer: ModelResponse) -> dict[str, Any]:
    """The GenAI attributes of an answer: model, finish reason, usage (input tokens counted whole, cached or not, as
    the conventions ask of `gen_ai.usage.input_tokens`), and its cost."""
    if not tracing.enabled():
        return {}
    usage = answer.usage
    attributes = {
        tracing.GEN_AI_RESPONSE_MODEL: answer.model,
        tracing.GEN_AI_RESPONSE_FINISH_REASONS: [answer.stop_reason] if answer.stop_reason else None,
        tracing.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
        tracing.GEN_AI_USAGE_OUTPUT_TOKENS: usage.output_tokens,
        tracing.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.cache_read_tokens,
        tracing.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS: usage.cache_write_tokens,
        tracing.COST_USD: float(cost_usd(answer.model, usage, batch=answer.batch)),
        tracing.MODEL_REQUEST_ID: answer.request_id or None,
    }
    if tracing.content_enabled():
        output = [{"role": "assistant", "parts": _parts(answer.content), "finish_reason": answer.stop_reason}]
        attributes[tracing.GEN_AI_OUTPUT_MESSAGES] = redactor()(json.dumps(output, default=str))
    return attributes


def error_message(error: BaseException) -> str:
    """The text a failed model call's exception event shows: redacted, when this library worded the error or content
    is on; else "" (the event shows the exception's class and frames only)."""
    if isinstance(error, _WORDED_ERRORS) or tracing.content_enabled():
        return redact(str(error))
    return ""


def _messages_of(request: ModelRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages in the shape of `gen_ai.input.messages` (role and parts)."""
    found: list[dict[str, Any]] = []
    if request.system:
        found.append({"role": "system", "parts": _parts(request.system)})
    found.extend({"role": m.get("role"), "parts": _parts(m.get("content"))} for m in request.messages)
    return found


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    parts: list[dict[str, Any]] = []
    for block in content or ():
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "content": block.get("text", "")})
        elif kind == "tool_use":
            parts.append(
                {"type": "tool_call", "id": block.get("id"), "name": block.get("name"), "arguments": block.get("input")}
            )
        elif kind == "tool_result":
            parts.append(
                {"type": "tool_call_response", "id": block.get("tool_use_id"), "response": block.get("content")}
            )
        elif kind == "thinking":
            parts.append({"type": "reasoning", "content": block.get("thinking", "")})
        else:
            parts.append({"type": str(kind)})
    return parts
