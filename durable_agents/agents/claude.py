"""The Anthropic participant: Claude through the official SDK, with its errors mapped to retry decisions.

One retry owner: the engine. The SDK's own retries are off (`max_retries=0`) so attempts do not
multiply; a transient error (connection, timeout, 429, 5xx, 529) becomes ModelUnavailableError carrying
the server's `retry-after`, the step attempt is persisted, and the re-executed step resumes from the
journal — the model is asked again only for the turn that never got an answer. 400/401/403/404/413
become ModelRequestError: permanent, with a message that says what to fix. The API key is read from
ANTHROPIC_API_KEY by the SDK and never written anywhere: error messages are scrubbed of it.

Compaction calls are ordinary Messages requests (the agent loop appends a summarisation instruction to the
conversation it would have sent), so they read the same cached prefix as the turns before them. Only
answered requests are billed and journaled: an HTTP error carries no usage, and the API bills none.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import httpx2 as httpx

from durable_agents.agents import rate_limits
from durable_agents.agents.messages import ModelRequest, ModelResponse, Usage
from durable_agents.conf import settings
from durable_agents.errors import ModelRequestError, ModelUnavailableError

CONNECTIONS_PER_POOL = 50
TRANSIENT_ERROR_TYPES = {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}
PERMANENT_HINTS = {
    400: "the request is invalid; check the model name, tools and messages",
    401: "the API key is missing or wrong; set ANTHROPIC_API_KEY",
    403: "the API key may not use this model or feature",
    404: "the model or endpoint does not exist; check DURABLE_AGENTS['DEFAULT_MODEL']",
    413: "the request is too large; lower max_tokens or compact the conversation",
}


def redact(message: str) -> str:
    """Remove the API key from text that may be persisted or logged."""
    key = os.environ.get("ANTHROPIC_API_KEY", "")
    return message.replace(key, "[redacted]") if len(key) >= 8 else message


def retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait: `retry-after-ms` or `retry-after` (seconds), any size."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                return max(float(value) / scale, 0.0)
            except ValueError:
                continue
    return None


@contextmanager
def map_errors() -> Iterator[None]:
    """Translate SDK exceptions into retryable or permanent domain errors (httpx's map_exceptions idiom)."""
    try:
        yield
    except anthropic.APITimeoutError as exc:
        raise ModelUnavailableError(f"model request timed out: {redact(str(exc))}") from exc
    except anthropic.APIConnectionError as exc:
        raise ModelUnavailableError(f"could not reach the model API: {redact(str(exc))}") from exc
    except httpx.TransportError as exc:
        # Raised as is by a stream cut mid-way (get_final_message), not wrapped by the SDK.
        raise ModelUnavailableError(f"the model API connection broke: {redact(str(exc))}") from exc
    except anthropic.APIStatusError as exc:
        status = exc.status_code
        message = redact(getattr(exc, "message", None) or str(exc))
        # An error event inside a 200 stream carries its kind in the body, not in the status.
        body = exc.body if isinstance(exc.body, dict) else {}
        error_type = (body.get("error") or {}).get("type") if isinstance(body.get("error"), dict) else None
        if status == 429 or status >= 500 or error_type in TRANSIENT_ERROR_TYPES:
            raise ModelUnavailableError(
                f"model API {status}: {message}", retry_after=retry_after(exc.response.headers), status=status
            ) from exc
        hint = PERMANENT_HINTS.get(status, "the model API refused the request")
        raise ModelRequestError(f"model API {status}: {message} ({hint})", status=status) from exc


class AnthropicParticipant:
    """Claude via `anthropic.Anthropic().messages.create` (or `.stream` for long outputs).

    One set of clients per process, shared by every thread (or greenlet) of the model worker: HTTP connections
    are pooled and kept alive between calls (MODEL_MAX_CONNECTIONS in all), so a thousand conversations do not
    reconnect on every turn. `remote`: a step gives its database connection back while Claude thinks.
    """

    name = "anthropic"
    remote = True

    def __init__(self, *, client: anthropic.Anthropic | None = None, stream: bool = False) -> None:
        self._clients = [client] if client is not None else []
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self.stream = stream

    @property
    def client(self) -> anthropic.Anthropic:
        """The process's next client, in turn (made on first use)."""
        if not self._clients:
            with self._lock:
                if not self._clients:
                    self._clients = new_clients()
        return self._clients[next(self._turn) % len(self._clients)]

    def respond(self, request: ModelRequest) -> ModelResponse:
        """Ask Claude, within the shared rate limit of the model and API key when MODEL_RATE_LIMITS sets one:
        wait for room first, correct the reservation by the billed usage after, and pass a 429's retry-after on
        to every other worker (rate_limits.py)."""
        kwargs = request.as_kwargs()
        client = self.client
        shared = rate_limits.limiter()
        key = client.api_key or ""
        reservation = shared.acquire(request.model, key, kwargs, request.max_tokens) if shared else None
        try:
            message = self._call(client, kwargs)
        except ModelUnavailableError as exc:
            if shared and reservation:
                if exc.status == 429:
                    shared.rate_limited(reservation, exc.retry_after)
                else:
                    shared.settle(reservation, Usage())
            raise
        usage = usage_of(message.usage)
        if shared and reservation:
            shared.settle(reservation, usage)
        return ModelResponse(
            content=tuple(block.model_dump(mode="json", exclude_none=True) for block in message.content),
            stop_reason=message.stop_reason or "",
            model=message.model,
            usage=usage,
            request_id=getattr(message, "_request_id", None) or "",
        )

    def _call(self, client: anthropic.Anthropic, kwargs: dict[str, Any]) -> Any:
        with map_errors():
            if self.stream:
                with client.messages.stream(**kwargs) as stream:
                    return stream.get_final_message()
            return client.messages.create(**kwargs)


def new_clients() -> list[anthropic.Anthropic]:
    """The process's Anthropic clients: key and base URL from ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL (as the SDK
    reads them), no SDK retries (the engine owns them), MODEL_MAX_CONNECTIONS kept-alive connections in all.

    httpcore's pool looks at every connection it holds on each request event, so one pool of 1,000 connections
    cost a request 2.65 ms of CPU against 0.9 ms for a pool of 10 (measured on this project's CI machine). The
    connections are split into pools of CONNECTIONS_PER_POOL, taken in turn; a pool may open twice its share
    when the turns run uneven.
    """
    size = max(int(settings.MODEL_MAX_CONNECTIONS), 1)
    pools = math.ceil(size / CONNECTIONS_PER_POOL)
    share = math.ceil(size / pools)
    limits = httpx.Limits(max_connections=2 * share, max_keepalive_connections=share, keepalive_expiry=30.0)
    timeout = float(settings.MODEL_TIMEOUT_SECONDS)
    return [
        anthropic.Anthropic(
            max_retries=0, timeout=timeout, http_client=anthropic.DefaultHttpxClient(limits=limits, timeout=timeout)
        )
        for _ in range(pools)
    ]


def usage_of(usage: Any) -> Usage:
    """The billed tokens of a Messages API `usage` object; 1 h cache writes are priced apart from 5 min ones."""
    split = getattr(usage, "cache_creation", None)
    return Usage(
        input_tokens=usage.input_tokens or 0,
        output_tokens=usage.output_tokens or 0,
        cache_write_tokens=usage.cache_creation_input_tokens or 0,
        cache_read_tokens=usage.cache_read_input_tokens or 0,
        cache_write_1h_tokens=(getattr(split, "ephemeral_1h_input_tokens", 0) or 0) if split is not None else 0,
    )
