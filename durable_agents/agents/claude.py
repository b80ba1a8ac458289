"""The Anthropic participant: Claude through the official SDK, with its errors mapped to retry decisions.

One retry owner: the engine. The SDK's own retries are off (`max_retries=0`) so attempts do not
multiply; a transient error (connection, timeout, 408, 409, 429, 5xx, 529) becomes ModelUnavailableError
carrying the server's `retry-after`, the step attempt is persisted, and the re-executed step resumes from the
journal — the model is asked again only for the turn that never got an answer. 400/401/402/403/404/413
become ModelRequestError: permanent, with a message that says what to fix; a 400 "prompt is too long" is
ContextWindowExceededError, which the agent loop meets by compacting, once. Two answers outrank the status:
a spend limit (the usage tier's monthly cap, a 429 with `error.details.error_code` "enforced_spend_limit_reached"
and no `retry-after`; or a limit the organization set, a 400) is permanent, because the API refuses every call
until someone raises the limit; and the API's own `x-should-retry` header ("true" / "false", which the SDK obeys
before any status rule) makes a status transient or permanent against its default. The API key is read from
ANTHROPIC_API_KEY by the SDK and never written anywhere: error messages are scrubbed of it.

An answered call's `anthropic-ratelimit-*` headers tell the shared rate limiter how much of the API's own limits
is left, so the workers slow down before the API answers 429 (rate_limits.py). With COUNT_TOKENS, the first
request of a conversation is reserved by the API's count of its prompt (messages.count_tokens) instead of the
four-characters-a-token estimate.

Compaction calls are ordinary Messages requests (the agent loop appends a summarisation instruction to the
conversation it would have sent), so they read the same cached prefix as the turns before them. Only
answered requests are billed and journaled: an HTTP error carries no usage, and the API bills none.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx2 as httpx

from durable_agents import tracing
from durable_agents.agents import rate_limits
from durable_agents.agents.messages import TURN, ModelRequest, ModelResponse, Usage
from durable_agents.conf import settings
from durable_agents.errors import (
    ContextWindowExceededError,
    LeaseLostError,
    ModelRequestError,
    ModelUnavailableError,
)

CONNECTIONS_PER_POOL = 50
TRANSIENT_ERROR_TYPES = {"overloaded_error", "api_error", "rate_limit_error", "timeout_error"}
PERMANENT_HINTS = {
    400: "the request is invalid; check the model name, tools and messages",
    401: "the API key is missing or wrong; set ANTHROPIC_API_KEY",
    403: "the API key may not use this model or feature",
    404: "the model or endpoint does not exist; check DURABLE_AGENTS['DEFAULT_MODEL']",
    413: "the request is too large; lower max_tokens or compact the conversation",
}
# `error.details.error_code` of the 429s that no retry fixes: the API refuses every call until the limit is raised
# (https://platform.claude.com/docs/en/api/errors; the SDK names them EnforcedSpendLimitReachedError and
# ContractSpendLimitReachedError).
SPEND_LIMIT_CODES = {
    "enforced_spend_limit_reached": (
        "the organization reached the monthly spend limit of its API usage tier",
        "move it to a higher usage tier in the Claude Console (Settings > Limits), or wait for the date the message "
        "gives",
    ),
    "contract_spend_limit_reached": (
        "the organization reached the spend limit of its contract",
        "ask Anthropic to raise the contract's limit",
    ),
    # A 402 (billing_error) in the SDK's error types: the organization's spend is capped by the one it is linked to.
    "linked_organization_spend_limit_reached": (
        "the organization reached the spend limit of the organization it is linked to",
        "ask that organization's admins to raise the limit",
    ),
}
# The tier's monthly cap as its message says it, for a 429 whose `error.details` a proxy left out.
TIER_SPEND_LIMIT_TEXT = "you have reached your api usage limits"
# 408 (request timeout) and 409 (conflict_error: a lock timeout) are retried, as the SDK's own `_should_retry` does.
RETRIED_STATUSES = {408, 409, 429}
# A prompt over the context window is a 400 "prompt is too long: N tokens > M maximum" before any answer.
PROMPT_TOO_LONG_TEXT = "prompt is too long"
# A spend limit the organization (or a workspace) set itself is a 400 whose message begins "You have reached your
# specified API usage limits" / "... specified workspace API usage limits"; it has no error code to branch on.
OWN_SPEND_LIMIT_TEXT = ("specified api usage limits", "specified workspace api usage limits")
OWN_SPEND_LIMIT = (
    "the organization or workspace reached a spend limit it set",
    "raise that limit in the Claude Console (Settings > Limits)",
)
# count_tokens takes the prompt and what shapes it, not the generation parameters (max_tokens, metadata, stream).
COUNTED_PARAMETERS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config")
# The longest a 429's retry-after may hold every worker's calls of a model (the API asks for seconds).
LONGEST_RETRY_AFTER_SECONDS = 900.0
# A count is an optional refinement of an estimate: it may not hold the turn up for long.
COUNT_TOKENS_TIMEOUT_SECONDS = 10.0

logger = logging.getLogger(__name__)


def redact(message: str) -> str:
    """Remove the API key from text that may be persisted or logged."""
    key = os.environ.get("ANTHROPIC_API_KEY", "")
    return message.replace(key, "[redacted]") if len(key) >= 8 else message


def retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait: `retry-after-ms` or `retry-after` (seconds), checked where it enters:
    a value that is not a finite number of seconds (NaN, "1e400", a date) is no value, and a long one is cut to
    LONGEST_RETRY_AFTER_SECONDS — it goes into the bucket every worker shares, where a year would stop them all."""
    if headers is None:
        return None
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        value = headers.get(name)
        if value:
            try:
                seconds = float(value) / scale
            except ValueError:
                continue
            if math.isfinite(seconds) and seconds >= 0:
                return min(seconds, LONGEST_RETRY_AFTER_SECONDS)
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
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        error_type = error.get("type")
        headers = exc.response.headers if exc.response is not None else {}
        spend_limit = spend_limit_of(status, getattr(exc, "error_code", None), str(error.get("message") or ""))
        if spend_limit:
            # Before x-should-retry: the error code names the cause, and this cause outlasts any retry schedule.
            cause, action = spend_limit
            raise ModelRequestError(
                f"model API {status}: {message} ({cause}: every call fails until the limit is raised; {action}, "
                "then resume the run with `manage.py durable_resume <run id>`)",
                status=status,
            ) from exc
        if status == 400 and PROMPT_TOO_LONG_TEXT in message.lower():
            raise ContextWindowExceededError(
                f"model API {status}: {message} (the conversation no longer fits the model's context window: the "
                "agent compacts it and asks again, once)"
            ) from exc
        transient = status in RETRIED_STATUSES or status >= 500 or error_type in TRANSIENT_ERROR_TYPES
        should_retry = headers.get("x-should-retry")
        if should_retry == "false" and transient:
            raise ModelRequestError(
                f"model API {status}: {message} (the API said retrying this request will not help "
                "(x-should-retry: false); fix what the message names, then resume the run with "
                "`manage.py durable_resume <run id>`)",
                status=status,
            ) from exc
        if transient or should_retry == "true":
            asked = "" if transient else " (the API asked for a retry: x-should-retry: true)"
            raise ModelUnavailableError(
                f"model API {status}: {message}{asked}", retry_after=retry_after(headers), status=status
            ) from exc
        hint = PERMANENT_HINTS.get(status, "the model API refused the request")
        raise ModelRequestError(f"model API {status}: {message} ({hint})", status=status) from exc


def spend_limit_of(status: int, error_code: str | None, api_message: str) -> tuple[str, str] | None:
    """The spend limit an error response reports, as (the cause, what to do), in words; None if it reports none."""
    if error_code in SPEND_LIMIT_CODES:
        return SPEND_LIMIT_CODES[error_code]
    if status == 429 and TIER_SPEND_LIMIT_TEXT in api_message.lower():
        return SPEND_LIMIT_CODES["enforced_spend_limit_reached"]
    if status == 400 and any(text in api_message.lower() for text in OWN_SPEND_LIMIT_TEXT):
        return OWN_SPEND_LIMIT
    return None


class AnthropicParticipant:
    """Claude via `anthropic.Anthropic().messages.create` (or `.stream` for long outputs).

    One set of clients per process, shared by every thread (or greenlet) of the model worker: HTTP connections
    are pooled and kept alive between calls (MODEL_MAX_CONNECTIONS in all), so a thousand conversations do not
    reconnect on every turn. `remote`: a step gives its database connection back while Claude thinks.
    """

    name = "anthropic"
    remote = True
    # Its calls can go through the Message Batches API (batching.py; agents/batcher.py sends them).
    batchable = True

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
        wait for room first, correct the reservation by the billed usage after, pass a 429's retry-after on to
        every other worker, and hold them all when the answer's headers say the API's own limit is nearly spent
        (rate_limits.py)."""
        kwargs = request.as_kwargs()
        client = self.client
        if SDK_SPANS and tracing.enabled():
            # The journal's `chat` span is this call's span (GenAI conventions, with its cost): the SDK's own
            # `anthropic.messages.create` span would be a second CLIENT span of the same call, its tokens counted twice.
            client = client.with_options(open_telemetry={"traces": False})
        shared = rate_limits.limiter()
        key = client.api_key or ""
        reservation = None
        if shared:
            counted = self._first_count(client, request)
            with limiter_faults_are_transient(request.model):
                reservation = shared.acquire(request.model, key, kwargs, request.max_tokens, input_tokens=counted)
        # The call's span (opened by the journal's `ask`) learns where it goes and, once answered, the message's id.
        traced = tracing.current()
        traced.set({tracing.SERVER_ADDRESS: client.base_url.host, tracing.SERVER_PORT: client.base_url.port})
        try:
            message, headers, request_id = self._call(client, kwargs)
        except ModelUnavailableError as exc:
            if shared and reservation:
                with limiter_faults_logged("a 429's hold" if exc.status == 429 else "a refund"):
                    if exc.status == 429:
                        shared.rate_limited(reservation, exc.retry_after)
                    else:
                        shared.settle(reservation, Usage())
            raise
        except (ModelRequestError, ContextWindowExceededError):
            # Refused, so nothing was billed: give the reserved tokens back for the other workers.
            if shared and reservation:
                with limiter_faults_logged("a refund"):
                    shared.settle(reservation, Usage())
            raise
        response = response_of(message, request_id)
        traced.set({tracing.GEN_AI_RESPONSE_ID: message.get("id")})
        if shared:
            # The answer is billed: a limiter that fails now must not lose it (the step would ask for it again).
            with limiter_faults_logged("the billed usage"):
                if reservation:
                    shared.settle(reservation, response.usage)
                shared.observe(request.model, key, headers)
        return response

    def count_tokens(self, request: ModelRequest) -> int | None:
        """The prompt's input tokens as the API counts them (`messages.count_tokens`), or None if it could not say.

        The count is free but a round trip of its own, limited by a requests-per-minute limit apart from the Messages
        API's (https://platform.claude.com/docs/en/build-with-claude/token-counting); any failure gives None, so a
        caller falls back to its estimate::

            tokens = participant.count_tokens(request) or estimate_tokens(request.as_kwargs())
        """
        return count_input_tokens(self.client, request.as_kwargs())

    def _first_count(self, client: anthropic.Anthropic, request: ModelRequest) -> int | None:
        # Only the first request of a conversation: nothing about its prompt was measured yet, and its system prompt
        # and tools are often most of it. Later reservations are corrected by each answer's billed usage, so a count
        # per turn would double the round trips for little.
        if not settings.COUNT_TOKENS or request.turn != 0 or request.purpose != TURN:
            return None
        if rate_limits.limits_for(request.model) is None:
            return None  # nothing would be reserved
        return count_input_tokens(client, request.as_kwargs())

    def _call(self, client: anthropic.Anthropic, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any, str]:
        """The answer as a JSON object, its HTTP headers (the rate limiter reads `anthropic-ratelimit-*` off them)
        and its request id.

        Not streamed, the object is the body as the API wrote it, decoded once: its blocks are what is journaled and
        sent back, keys in the order the API wrote them (a tool_use's input as the model wrote it), where the SDK's
        models would reorder a block's fields; and the SDK's `Message`, of which a few fields are read, is not built
        (0.16 ms a call). Streamed, the SDK assembles the message from its events and it is dumped with the fields
        they set (nulls included), in the SDK's field order.
        """
        with map_errors():
            if self.stream:
                with client.messages.stream(**kwargs) as stream:
                    return _whole(stream), stream.response.headers, stream.request_id or ""
            raw = client.messages.with_raw_response.create(**kwargs)
            response = raw.parse(to=httpx.Response)  # read, not parsed
        try:
            body = json.loads(response.content)
        except ValueError:
            body = None
        blocks = body.get("content") if isinstance(body, dict) else None
        if not isinstance(blocks, list) or not all(isinstance(block, dict) for block in blocks):
            # Not a Messages API answer (a proxy's page sent as 200?): nothing to journal, asked again.
            raise ModelUnavailableError("the model API answered 200 with no message in the body; the step retries")
        return body, raw.headers, raw.request_id or ""


# The deltas the SDK's accumulator applies, and to which blocks (anthropic/lib/streaming/_messages.py, accumulate_event
# and TRACKS_TOOL_INPUT). It skips any other without a word: the block would be journaled half written.
_ASSEMBLED = {
    "text_delta": ("text",),
    "citations_delta": ("text",),
    "input_json_delta": ("tool_use", "server_tool_use"),
    "thinking_delta": ("thinking",),
    "signature_delta": ("thinking",),
}


# The events of a stream, in the order https://platform.claude.com/docs/en/build-with-claude/streaming gives: a
# message_start; each block's content_block_start (its index the block's place in the message), deltas and stop, one
# block after the other; one or more message_delta (the stop_reason, cumulative usage); a final message_stop. Pings,
# event types this code does not know and the SDK's own events (`text`, `input_json`, ...) may come anywhere.
_FLOW = frozenset(
    {
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    }
)


class _Broken(Exception):
    """The stream's events do not make a whole message."""


@dataclass
class _Flow:
    """A stream's events checked against the documented order as they come (see()), then its end (check_end())."""

    began: bool = False
    blocks: int = 0  # blocks started
    open: int | None = None  # the block between its start and its stop
    billed: bool = False  # a message_delta came
    ended: bool = False  # its message_stop came
    split: dict[str, Any] | None = None  # the last message_delta's 5 min / 1 h split of the cache writes
    inputs: dict[int, str] = field(default_factory=dict)  # a tool block's input JSON as its deltas wrote it
    unparsed: list[int] = field(default_factory=list)  # tool blocks whose input was not a whole JSON object

    def see(self, event: Any, snapshot: Any) -> None:
        kind = event.type
        if kind not in _FLOW:
            return
        if self.ended:
            raise _Broken(f"a {kind} after message_stop")
        if kind == "message_start":
            if self.began:
                raise _Broken("a second message_start")
            self.began = True
            return
        if not self.began:
            raise _Broken(f"a {kind} before message_start")
        if kind == "content_block_start":
            if self.open is not None or self.billed or event.index != self.blocks:
                raise _Broken(f"content_block_start {event.index!r} where block {self.blocks} was to start")
            self.open, self.blocks = event.index, self.blocks + 1
        elif kind in ("content_block_delta", "content_block_stop"):
            if self.open is None or event.index != self.open:
                raise _Broken(f"a {kind} for block {event.index!r}, which is not open")
            if kind == "content_block_delta":
                self._delta(event, snapshot.content[event.index].type)
            else:
                self.open = None
                self._parse_input(event.index)
        elif kind == "message_delta":
            if self.open is not None or not isinstance(event.usage.output_tokens, int):
                raise _Broken("a message_delta inside a block, or without its output_tokens")
            self.billed = True
            # The SDK keeps message_start's split of the cache writes; a message_delta's totals win, its split too.
            self.split = event.usage.to_dict().get("cache_creation", self.split)
        else:  # message_stop
            if not self.billed:
                raise _Broken("message_stop before any message_delta: no stop_reason, no final usage")
            self.ended = True

    def _delta(self, event: Any, block: str) -> None:
        delta = event.delta.type
        if block not in _ASSEMBLED.get(delta, ()):
            raise ModelRequestError(
                f"the model API streamed a {delta!r} for a {block!r} block, which the installed anthropic SDK "
                f"({anthropic.__version__}) does not assemble; upgrade it, or ask without streaming"
            )
        if delta == "input_json_delta":
            self.inputs[event.index] = self.inputs.get(event.index, "") + event.delta.partial_json

    def _parse_input(self, index: int) -> None:
        # The SDK parses each delta's JSON so far in partial mode and keeps what it made of it: `{"city": "Par`
        # would be an input of {}. The whole input is parsed once its block stopped, as the streaming docs do.
        written = self.inputs.pop(index, "")
        if not written:
            return  # no deltas: the input its content_block_start gave (a tool without parameters)
        try:
            whole = json.loads(written)
        except ValueError:
            whole = None
        if not isinstance(whole, dict):
            self.unparsed.append(index)

    def check_end(self, stop_reason: str | None) -> None:
        if not self.ended or stop_reason is None:
            raise _Broken("the stream ended before its message did")
        if self.unparsed and stop_reason != "max_tokens":
            # Cut by max_tokens, a tool call is incomplete by design and the agent loop sets the turn aside.
            raise _Broken(f"the input of block {self.unparsed[0]} is not a whole JSON object")


def _whole(stream: Any) -> dict[str, Any]:
    """The message a 200 stream assembled, dumped as its events wrote it.

    ModelUnavailableError (asked again) if the stream did not hold a whole one, in the documented order (_Flow): no
    events, events out of order or for a block not open, an end before its `message_stop` (usage counts are
    cumulative: an earlier message_delta's are not the bill), a tool's input that is not a whole JSON object (unless
    max_tokens cut it). ModelRequestError if it holds a delta the SDK would skip (a new block type's, say): a retry
    would stream it again.
    """
    flow = _Flow()
    try:
        for event in stream:
            flow.see(event, stream.current_message_snapshot if flow.began else None)
        message = stream.get_final_message()
        flow.check_end(message.stop_reason)
    # What the SDK's accumulator raises on events it cannot place (a delta for no block, an event before
    # message_start, a tool input that is not JSON): the stream, not the request, was wrong.
    except (_Broken, AssertionError, RuntimeError, ValueError, LookupError, TypeError, AttributeError) as exc:
        said = str(exc) if isinstance(exc, _Broken) else f"{type(exc).__name__}: {redact(str(exc))}"
        raise ModelUnavailableError(f"the model API's stream held no whole message ({said}); the step retries") from exc
    # The fields the stream's events set, nulls included: a citation's `document_title: null` is sent back as written
    # (`exclude_none` dropped it, and nulls inside a tool's input). content_of leaves out a block's own null fields.
    whole = message.model_dump(mode="json", exclude_unset=True)
    if isinstance(flow.split, dict) and isinstance(whole.get("usage"), dict):
        whole["usage"]["cache_creation"] = flow.split
    return whole


@contextmanager
def limiter_faults_are_transient(model: str) -> Iterator[None]:
    """The shared limiter unreachable before a call (Redis down, a database error): the call waits and retries like
    any unavailable model, rather than failing the run."""
    try:
        yield
    except (ModelUnavailableError, LeaseLostError):
        raise  # the limiter's own verdict; or the step's lease, proven again after a wait for room
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, nothing was sent and nothing billed
        raise ModelUnavailableError(
            f"the shared rate limiter of {model} could not be reached ({type(exc).__name__}: {redact(str(exc))}); "
            "the step retries"
        ) from exc


@contextmanager
def limiter_faults_logged(what: str) -> Iterator[None]:
    """The shared limiter unreachable after a call: logged, not raised. The bucket is off by one call's correction
    (it refills as time passes); raising would lose an answer that was billed, or hide the call's own error."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.warning("the shared rate limiter did not take %s: %s", what, redact(f"{type(exc).__name__}: {exc}"))


def response_of(message: dict[str, Any], request_id: str, *, model: str = "", batch: bool = False) -> ModelResponse:
    """A Messages API answer (JSON as the API wrote it, answered live or in a batch's results) as the answer to
    journal: its blocks and stop_details with their own null fields left out (nulls inside them kept), its billed
    usage; `model` where the answer names none."""
    details = message.get("stop_details")
    return ModelResponse(
        content=content_of(message),
        stop_reason=message.get("stop_reason") or "",
        model=message.get("model") or model,
        usage=usage_of(message.get("usage")),
        request_id=request_id,
        stop_details=_without_nulls(details) if isinstance(details, dict) else None,
        batch=batch,
    )


def content_of(message: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    """The content blocks of a Messages API answer, each in its own key order, its own null fields left out."""
    return tuple(_without_nulls(block) for block in message.get("content") or ())


def _without_nulls(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if value is not None}


def count_input_tokens(client: anthropic.Anthropic, request: dict[str, Any]) -> int | None:
    """The input tokens of a Messages request by `messages.count_tokens`; None on any failure (logged, never raised).

    The count is the whole prompt (cached or not), so a reservation made from it errs high when part of the prompt
    is read from the cache; the billed usage corrects it after the call.
    """
    params = {name: request[name] for name in COUNTED_PARAMETERS if name in request}
    try:
        counted = client.messages.count_tokens(**params, timeout=COUNT_TOKENS_TIMEOUT_SECONDS)
    except Exception as exc:  # noqa: BLE001 - a count refines an estimate: the call it is for must not fail with it
        logger.warning("count_tokens failed, the estimate stands: %s", redact(f"{type(exc).__name__}: {exc}"))
        return None
    tokens = getattr(counted, "input_tokens", None)
    return int(tokens) if isinstance(tokens, int) and tokens > 0 else None


# The SDK traces its own calls (anthropic._tracing, from 2.16) unless told not to.
SDK_SPANS = "open_telemetry" in inspect.signature(anthropic.Anthropic.copy).parameters


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


def new_client() -> anthropic.Anthropic:
    """One Anthropic client as `new_clients` makes them (key and base URL from the environment, no SDK retries), with
    a few connections: for a job that makes a handful of calls and closes it (the batcher's pass)."""
    timeout = float(settings.MODEL_TIMEOUT_SECONDS)
    return anthropic.Anthropic(max_retries=0, timeout=timeout)


def usage_of(usage: Any) -> Usage:
    """The billed tokens of a Messages API answer's `usage` object (as JSON; none, or null counts, are zeros); 1 h
    cache writes are priced apart from 5 min ones."""
    usage = usage if isinstance(usage, dict) else {}
    split = usage.get("cache_creation")
    split = split if isinstance(split, dict) else {}
    return Usage(
        input_tokens=usage.get("input_tokens") or 0,
        output_tokens=usage.get("output_tokens") or 0,
        cache_write_tokens=usage.get("cache_creation_input_tokens") or 0,
        cache_read_tokens=usage.get("cache_read_input_tokens") or 0,
        cache_write_1h_tokens=split.get("ephemeral_1h_input_tokens") or 0,
    )
