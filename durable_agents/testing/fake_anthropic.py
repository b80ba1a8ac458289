"""A fake Anthropic Messages API on loopback: scripted replies, injected faults, a request log and cache accounting.

Point the real SDK at it and the whole client stack (retries, timeouts, SSE parsing) runs for real::

    from durable_agents.testing.fake_anthropic import Fault, FakeAnthropic, Reply

    with FakeAnthropic() as fake:
        fake.enqueue(Fault.status(529), Reply.tool_use("search", {"q": "otters"}), Reply.text("done"))
        client = anthropic.Anthropic(api_key="test-key", base_url=fake.url)
        ...
        assert fake.count(conversation, turn=1) == 1, "turn 1 was asked twice: a committed step re-ran"

Concurrency: `latency=2.0` makes every answer take two seconds, like a model thinking; `in_flight` and
`peak_in_flight` count requests being answered; `hold()` keeps requests waiting until `release()`, and
`wait_in_flight(n, timeout)` waits until n are held, so a test can look at its workers while n conversations
wait on the model. `requests_per_second=50` limits the API as Anthropic does (a bucket of 50 requests refilled at
50 a second): a request beyond it is answered 429 with a `retry-after` and counted in `rate_limited`.

What answers a `POST /v1/messages`, first match wins: the queue (`enqueue`, `fail_next`), then `responder`
(a function of the `RecordedRequest`), then a plain `end_turn` text reply. `count_tokens`, auth failures and
malformed requests never consume the queue. The fake does not retry anything; the SDK under test owns retries,
and each of its attempts shows up in the log with its `x-stainless-retry-count`.

Token counts are estimates (~4 characters a token), stable for equal requests, so tests can compare them but
should not pin exact values.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import socket
import struct
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import anthropic

__all__ = [
    "CONVERSATION_HEADER",
    "STOP_REASONS",
    "FakeAnthropic",
    "Fault",
    "RecordedRequest",
    "Reply",
    "Responder",
    "text_block",
    "tool_use_block",
]

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
CONVERSATION_HEADER = "x-durable-conversation"
REDACTED = "[redacted]"
STOP_REASONS = frozenset(
    {"end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal", "model_context_window_exceeded"}
)
StopReason = Literal[
    "end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal", "model_context_window_exceeded"
]

# Status → Anthropic error type, as documented at https://docs.anthropic.com/en/api/errors.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_SECRET_HEADERS = frozenset({"x-api-key", "authorization"})
# The API looks back this many blocks from a breakpoint for an earlier cache entry.
_CACHE_LOOKBACK_BLOCKS = 20
# Tokens the API adds around every prompt (role markers, the assistant prefix); never cached.
_FRAMING_TOKENS = 3
_STREAM_CHUNK_CHARS = 16


def text_block(text: str) -> dict[str, Any]:
    """A `text` content block for `Reply(content=[...])`."""
    return {"type": "text", "text": text}


def tool_use_block(name: str, input: Mapping[str, Any], *, id: str | None = None) -> dict[str, Any]:
    """A `tool_use` content block; without `id` a fresh `toolu_...` id is minted each time it is served."""
    return {"type": "tool_use", "id": id, "name": name, "input": dict(input)}


@dataclass(frozen=True)
class Reply:
    """One assistant message the fake will serve, e.g. ``Reply.text("hi")`` or ``Reply(content=[...], ...)``."""

    content: Sequence[Mapping[str, Any]] = ()
    stop_reason: StopReason = "end_turn"
    stop_sequence: str | None = None
    output_tokens: int | None = None  # None: estimated from the content

    def __post_init__(self) -> None:
        if self.stop_reason not in STOP_REASONS:
            raise ValueError(f"unknown stop_reason {self.stop_reason!r}; use one of {sorted(STOP_REASONS)}")
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


@dataclass(frozen=True)
class Fault:
    """A failure to serve instead of a reply; build one with `status`, `delay`, `reset` or `stream_error`."""

    kind: Literal["status", "delay", "reset", "stream_error"]
    status_code: int = 0
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    then: Reply | None = None
    mid_stream: bool = False
    partial_text: str = ""

    @classmethod
    def status(
        cls, code: int, body: Mapping[str, Any] | str | None = None, headers: Mapping[str, str] | None = None
    ) -> Fault:
        """An HTTP error with an Anthropic error body: ``Fault.status(429, headers={"retry-after": "2"})``.

        `body` may be the whole JSON body, or just the message; by default the error type follows the status.
        """
        if not isinstance(body, Mapping):
            body = _error_body(_error_type(code), body or f"fake {code} from FakeAnthropic")
        return cls(kind="status", status_code=code, body=dict(body), headers=dict(headers or {}))

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
            kind="stream_error", status_code=code, body=_error_body(error_type, message), partial_text=partial_text
        )


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it; credentials are already redacted."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    conversation: str
    turn: int
    attempt: int
    time: float
    retry_count: int | None = None  # the SDK's `x-stainless-retry-count`

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages") or []) if isinstance(self.body, dict) else []

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def last_user_text(self) -> str:
        """The text of the last user message (tool results excluded), for responders that answer by prompt."""
        blocks = _blocks(self._last_user_content())
        return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")

    @property
    def tool_results(self) -> list[dict[str, Any]]:
        """The `tool_result` blocks of the last user message."""
        return [b for b in _blocks(self._last_user_content()) if b.get("type") == "tool_result"]

    def _last_user_content(self) -> Any:
        users = [m for m in self.messages if m.get("role") == "user"]
        return users[-1].get("content") if users else None


Responder = Callable[[RecordedRequest], "Reply | Fault | None"]


class FakeAnthropic:
    """A threaded loopback server speaking the Messages API.

    Example::

        with FakeAnthropic() as fake:
            fake.responder = lambda req: Reply.text(f"echo: {req.last_user_text}")
            client = fake.client(max_retries=0)
            assert client.messages.create(model="m", max_tokens=5, messages=[...]).content[0].text == "echo: hi"
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        responder: Responder | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_cache_tokens: int = 0,
        latency: float = 0.0,
        requests_per_second: float | None = None,
    ) -> None:
        self.responder: Responder | None = responder
        self.latency = latency  # seconds every `/v1/messages` answer takes, like a model thinking
        # The API's rate limit: a bucket of this many requests, refilled at this rate; beyond it, 429 + retry-after.
        self.requests_per_second = requests_per_second
        self.rate_limited = 0  # 429s served by that limit
        self._allowance = float(requests_per_second or 0.0)
        self._allowance_at = time.monotonic()
        self.errors: list[BaseException] = []  # exceptions raised by the responder, served as 500s
        self._host = host
        self._port = port
        self._clock = clock
        self._min_cache_tokens = min_cache_tokens
        self._lock = threading.RLock()
        self._queue: deque[Reply | Fault] = deque()
        self._log: list[RecordedRequest] = []
        self._cache: dict[str, float] = {}  # prefix hash → expiry on `clock`
        self._stopping = threading.Event()
        self._open = threading.Event()  # the gate: cleared by hold(), set by release()
        self._open.set()
        self._holds: Callable[[RecordedRequest], bool] | None = None
        self._flight = threading.Condition()
        self._in_flight = 0
        self._peak_in_flight = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL for ``anthropic.Anthropic(base_url=...)`` or ``ANTHROPIC_BASE_URL``."""
        if self._server is None:
            raise RuntimeError("FakeAnthropic is not running; call start() or use it as a context manager")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeAnthropic:
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server((self._host, self._port), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-anthropic", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # wakes handlers sleeping in a Fault.delay
        self._open.set()  # and those held at the gate
        server.shutdown()
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeAnthropic:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def environ(self, api_key: str = "test-key") -> dict[str, str]:
        """Environment for a subprocess whose SDK should talk to this fake."""
        return {"ANTHROPIC_BASE_URL": self.url, "ANTHROPIC_API_KEY": api_key}

    def client(self, **kwargs: Any) -> anthropic.Anthropic:
        """A real `anthropic.Anthropic` pointed at this fake; keyword arguments pass through."""
        import anthropic

        kwargs.setdefault("api_key", "test-key")
        return anthropic.Anthropic(base_url=self.url, **kwargs)

    # -- script ----------------------------------------------------------------------------------------------

    def enqueue(self, *items: Reply | Fault) -> None:
        """Serve these, in order, to the next `/v1/messages` requests (before the responder is asked)."""
        with self._lock:
            self._queue.extend(items)

    def fail_next(self, n: int, fault: Fault) -> None:
        """Serve `fault` to the next `n` requests, ahead of anything already queued."""
        with self._lock:
            self._queue.extendleft([fault] * n)

    @property
    def pending(self) -> int:
        """How many queued replies and faults have not been served yet."""
        with self._lock:
            return len(self._queue)

    def reset(self) -> None:
        """Forget the queue, the request log and the prompt cache (the responder stays)."""
        with self._lock:
            self._queue.clear()
            self._log.clear()
            self._cache.clear()
            self.errors.clear()
            self.rate_limited = 0

    # -- concurrency -----------------------------------------------------------------------------------------

    def hold(self, when: Callable[[RecordedRequest], bool] | None = None) -> None:
        """Keep `/v1/messages` requests waiting (counted in flight) until `release()`: every one, or those
        `when(request)` is true for (e.g. ``lambda r: r.turn >= 1``: first turns are answered, later ones held).
        """
        self._holds = when
        self._open.clear()

    def release(self) -> None:
        """Let held requests (and every later one) be answered."""
        self._open.set()

    @property
    def in_flight(self) -> int:
        """`/v1/messages` requests received and not yet answered."""
        with self._flight:
            return self._in_flight

    @property
    def peak_in_flight(self) -> int:
        """The most `/v1/messages` requests in flight at once since the start (or `reset_peak`)."""
        with self._flight:
            return self._peak_in_flight

    def reset_peak(self) -> None:
        with self._flight:
            self._peak_in_flight = self._in_flight

    def wait_in_flight(self, n: int, timeout: float) -> bool:
        """Block until at least `n` requests are in flight (True), or `timeout` seconds passed (False)."""
        with self._flight:
            return self._flight.wait_for(lambda: self._in_flight >= n, timeout=timeout)

    @contextlib.contextmanager
    def _flying(self) -> Iterator[None]:
        with self._flight:
            self._in_flight += 1
            self._peak_in_flight = max(self._peak_in_flight, self._in_flight)
            self._flight.notify_all()
        try:
            yield
        finally:
            with self._flight:
                self._in_flight -= 1

    # -- log -------------------------------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._log)

    def requests_for(self, conversation: str) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self._log if r.conversation == conversation]

    def count(self, conversation: str, turn: int) -> int:
        """How many times `/v1/messages` was asked for this turn; more than 1 means a retry or a re-run."""
        with self._lock:
            return sum(
                1 for r in self._log if r.path == MESSAGES_PATH and (r.conversation, r.turn) == (conversation, turn)
            )

    # -- serving ---------------------------------------------------------------------------------------------

    def _serve(self, handler: _Handler) -> None:
        path = handler.path.split("?", 1)[0].rstrip("/")
        raw = handler.rfile.read(int(handler.headers.get("content-length") or 0))
        # Redact before anything is stored: the API key must never outlive this request.
        headers = {k.lower(): (REDACTED if k.lower() in _SECRET_HEADERS else v) for k, v in handler.headers.items()}
        has_key = bool(handler.headers.get("x-api-key") or handler.headers.get("authorization", "")[7:].strip())
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        request = self._record(handler.command, path, headers, body)

        if path not in (MESSAGES_PATH, COUNT_TOKENS_PATH) or handler.command != "POST":
            handler.send_json(404, _error_body("not_found_error", f"{handler.command} {path} not found"))
        elif not has_key:
            handler.send_json(401, _error_body("authentication_error", "x-api-key or authorization header is required"))
        elif problem := _validate(path, body):
            handler.send_json(400, _error_body("invalid_request_error", problem))
        elif path == COUNT_TOKENS_PATH:
            input_tokens, creation, read = self._prompt_usage(body, update_cache=False)
            handler.send_json(200, {"input_tokens": input_tokens + creation + read})
        elif (wait := self._over_rate_limit()) is not None:
            handler.send_json(
                429,
                _error_body("rate_limit_error", f"over {self.requests_per_second:g} requests per second"),
                {"retry-after": str(max(1, math.ceil(wait)))},
            )
        else:
            with self._flying():
                # Held at the gate, then the model's latency; a stopping fake drops the connection instead.
                holds = self._holds
                if holds is None or holds(request):
                    while not self._open.wait(0.5):
                        pass
                if self.latency and self._stopping.wait(self.latency):
                    handler.drop_connection()
                    return
                self._answer(handler, request, self._next_action(request))

    def _over_rate_limit(self) -> float | None:
        """None if this request is within `requests_per_second` (taking its share), else seconds until it would be."""
        rate = self.requests_per_second
        if not rate:
            return None
        with self._lock:
            now = time.monotonic()
            self._allowance = min(rate, self._allowance + (now - self._allowance_at) * rate)
            self._allowance_at = now
            if self._allowance >= 1.0:
                self._allowance -= 1.0
                return None
            self.rate_limited += 1
            return (1.0 - self._allowance) / rate

    def _answer(self, handler: _Handler, request: RecordedRequest, action: Reply | Fault) -> None:
        if isinstance(action, Fault) and action.kind == "delay":
            if self._stopping.wait(action.seconds):
                handler.drop_connection()
                return
            action = action.then or self._fallback(request)
        if isinstance(action, Fault):
            self._serve_fault(handler, request, action)
            return
        message = self._message(request, action)
        if not request.stream:
            handler.send_json(200, message)
            return
        handler.start_stream()
        for event, data in _stream_events(message):
            handler.send_event(event, data)
        handler.end_stream()

    def _serve_fault(self, handler: _Handler, request: RecordedRequest, fault: Fault) -> None:
        if fault.kind == "reset":
            if fault.mid_stream and request.stream:
                handler.start_stream()
                events = _stream_events(self._message(request, Reply.text("This reply is cut off")))
                for event, data in events[:3]:  # message_start, content_block_start, one delta
                    handler.send_event(event, data)
            handler.drop_connection()
            return
        if fault.kind == "stream_error" and request.stream:
            handler.start_stream()
            events = _stream_events(self._message(request, Reply.text(fault.partial_text)))
            sent = events[:-3] if fault.partial_text else events[:1]  # all but block/message stops, or just start
            for event, data in sent:
                handler.send_event(event, data)
            handler.send_event("error", dict(fault.body or {}))
            handler.end_stream()
            return
        handler.send_json(fault.status_code, dict(fault.body or {}), fault.headers)

    def _record(self, method: str, path: str, headers: dict[str, str], body: Any) -> RecordedRequest:
        conversation, turn = _identify(headers, body)
        retry = headers.get("x-stainless-retry-count", "")
        with self._lock:
            attempt = 1 + sum(1 for r in self._log if (r.path, r.conversation, r.turn) == (path, conversation, turn))
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
            )
            self._log.append(request)
        return request

    def _next_action(self, request: RecordedRequest) -> Reply | Fault:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        return self._fallback(request)

    def _fallback(self, request: RecordedRequest) -> Reply | Fault:
        # Called outside the lock: a responder may read `fake.requests`, and it may be slow.
        responder = self.responder
        if responder is not None:
            try:
                answer = responder(request)
            except Exception as exc:
                logger.exception("FakeAnthropic responder raised for %s turn %s", request.conversation, request.turn)
                self.errors.append(exc)
                return Fault.status(500, f"FakeAnthropic responder raised {exc!r}", {"x-should-retry": "false"})
            if answer is not None:
                return answer
        return Reply.text("ok")

    def _message(self, request: RecordedRequest, reply: Reply) -> dict[str, Any]:
        input_tokens, creation, read = self._prompt_usage(request.body, update_cache=True)
        content = [_mint_ids(block) for block in reply.content]
        stop_sequence = reply.stop_sequence
        if reply.stop_reason == "stop_sequence" and stop_sequence is None:
            stop_sequence = next(iter(request.body.get("stop_sequences") or []), None)
        ttl_key = (
            "ephemeral_1h_input_tokens" if _last_breakpoint_ttl(request.body) > 300 else "ephemeral_5m_input_tokens"
        )
        return {
            "id": f"msg_01{uuid.uuid4().hex[:22]}",
            "type": "message",
            "role": "assistant",
            "model": request.body.get("model", "claude-fake"),
            "content": content,
            "stop_reason": reply.stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": input_tokens,
                "cache_creation_input_tokens": creation,
                "cache_read_input_tokens": read,
                "cache_creation": {
                    "ephemeral_5m_input_tokens": 0,
                    "ephemeral_1h_input_tokens": 0,
                    ttl_key: creation,
                },
                "output_tokens": reply.output_tokens if reply.output_tokens is not None else _output_tokens(content),
                "service_tier": "standard",
            },
        }

    def _prompt_usage(self, body: dict[str, Any], *, update_cache: bool) -> tuple[int, int, int]:
        """(input_tokens, cache_creation_input_tokens, cache_read_input_tokens) for this prompt."""
        segments = _prompt_segments(body)
        cumulative: list[int] = []
        hashes: list[str] = []
        running = 0
        # Caches are per model, and a prefix is everything before it: a rolling hash gives every prefix a key.
        digest = hashlib.sha256(str(body.get("model")).encode())
        for segment, _ttl in segments:
            text = _canonical(segment)
            running += _estimate(text)
            digest.update(text.encode())
            cumulative.append(running)
            hashes.append(digest.hexdigest())
        total = running + _FRAMING_TOKENS
        breakpoints = [i for i, (_segment, ttl) in enumerate(segments) if ttl is not None]
        if not breakpoints or cumulative[breakpoints[-1]] < self._min_cache_tokens:
            return total, 0, 0
        last = breakpoints[-1]
        candidates = sorted({*range(last, max(-1, last - _CACHE_LOOKBACK_BLOCKS), -1), *breakpoints}, reverse=True)
        now = self._clock()
        with self._lock:
            self._cache = {key: expiry for key, expiry in self._cache.items() if expiry > now}
            hit = next((i for i in candidates if hashes[i] in self._cache), None)
            if update_cache:
                for i in breakpoints:
                    self._cache[hashes[i]] = max(self._cache.get(hashes[i], 0.0), now + (segments[i][1] or 300))
                if hit is not None:  # a read refreshes the entry's lifetime, as the API does
                    self._cache[hashes[hit]] = max(self._cache[hashes[hit]], now + 300)
        read = cumulative[hit] if hit is not None else 0
        creation = cumulative[last] - read
        return total - cumulative[last], creation, read


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # a thousand clients connecting at once are queued, not refused

    def __init__(self, address: tuple[str, int], handler: type[_Handler], fake: FakeAnthropic) -> None:
        self.fake = fake
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)
        # Headers and body go out in separate writes: without this, Nagle + delayed ACK add ~40 ms a request.
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def track(self, connection: socket.socket, *, open: bool) -> None:
        with self._connections_lock:
            (self._connections.add if open else self._connections.discard)(connection)

    def close_connections(self) -> None:
        # Keep-alive handlers block reading the next request; shutting their sockets lets the threads end.
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or was reset on purpose makes our late write fail; that is the test working.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked SSE, like the real API
    server: _Server
    timeout = 30  # idle keep-alive connections give up their thread eventually

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, open=True)

    def finish(self) -> None:
        self.server.track(self.connection, open=False)
        super().finish()

    def do_POST(self) -> None:
        self.server.fake._serve(self)

    # Every method is answered, so a wrong one gets an Anthropic-style 404 rather than http.server's HTML 501.
    do_GET = do_PUT = do_DELETE = do_PATCH = do_POST

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the record; stderr noise would drown test output

    def _send_head(self, status: int, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        self.send_header("request-id", f"req_01{uuid.uuid4().hex[:22]}")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def send_json(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        payload = json.dumps(body).encode()
        self._send_head(
            status, {"content-type": "application/json", "content-length": str(len(payload)), **(headers or {})}
        )
        self.wfile.write(payload)

    def start_stream(self) -> None:
        self._send_head(
            200,
            {
                "content-type": "text/event-stream; charset=utf-8",
                "cache-control": "no-cache",
                "transfer-encoding": "chunked",
            },
        )

    def send_event(self, event: str, data: Mapping[str, Any]) -> None:
        chunk = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def drop_connection(self) -> None:
        # SO_LINGER 0 turns close() into a RST: the client sees "connection reset", not a clean EOF.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()  # makefile() holds a reference; the fd only closes when both are released
            self.connection.close()


def _error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def _error_body(error_type: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": f"req_01{uuid.uuid4().hex[:22]}",
    }


def _validate(path: str, body: Any) -> str | None:
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    required = ("model", "messages") if path == COUNT_TOKENS_PATH else ("model", "max_tokens", "messages")
    for name in required:
        if name not in body:
            return f"{name}: Field required"
    if not isinstance(body["messages"], list) or not body["messages"]:
        return "messages: at least one message is required"
    return None


def _identify(headers: Mapping[str, str], body: Any) -> tuple[str, int]:
    """(conversation, turn): metadata.user_id, else the conversation header, else the first user message."""
    if not isinstance(body, dict):
        return "", 0
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    turn = sum(1 for m in messages if m.get("role") == "assistant")
    user_id = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if user_id:
        return str(user_id), turn
    if headers.get(CONVERSATION_HEADER):
        return headers[CONVERSATION_HEADER], turn
    first = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    # Moving cache breakpoints must not change a conversation's identity, so they are stripped first.
    digest = hashlib.sha256(_canonical([_strip(b) for b in _blocks(first)]).encode()).hexdigest()
    return f"conv_{digest[:16]}", turn


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [text_block(content)]
    return [b for b in content or [] if isinstance(b, dict)]


def _strip(block: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in block.items() if k != "cache_control"}


def _ttl(block: Any) -> float | None:
    control = block.get("cache_control") if isinstance(block, dict) else None
    if not isinstance(control, dict):
        return None
    return 3600.0 if control.get("ttl") == "1h" else 300.0


def _prompt_segments(body: dict[str, Any]) -> list[tuple[dict[str, Any], float | None]]:
    """The prompt in cache order (tools, system, messages), one entry per block: (block sans cache_control, ttl)."""
    segments = [(_strip(tool), _ttl(tool)) for tool in body.get("tools") or [] if isinstance(tool, dict)]
    segments += [(_strip(block), _ttl(block)) for block in _blocks(body.get("system"))]
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        for index, block in enumerate(_blocks(message.get("content"))):
            # The role rides on each block so the same words from the other speaker are a different prefix.
            segments.append(({"role": message.get("role"), "index": index, **_strip(block)}, _ttl(block)))
    return segments


def _last_breakpoint_ttl(body: dict[str, Any]) -> float:
    return next((ttl for _segment, ttl in reversed(_prompt_segments(body)) if ttl is not None), 300.0)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _estimate(text: str) -> int:
    return max(1, (len(text) + 3) // 4)


def _output_tokens(content: list[dict[str, Any]]) -> int:
    sizes = [_estimate(b["text"] if b.get("type") == "text" else _canonical(b.get("input", b))) for b in content]
    return max(1, sum(sizes))


def _mint_ids(block: Mapping[str, Any]) -> dict[str, Any]:
    if block.get("type") in ("tool_use", "server_tool_use") and not block.get("id"):
        prefix = "toolu" if block["type"] == "tool_use" else "srvtoolu"
        return {**block, "id": f"{prefix}_01{uuid.uuid4().hex[:22]}"}
    return dict(block)


def _chunks(text: str) -> Iterator[str]:
    for start in range(0, len(text), _STREAM_CHUNK_CHARS):
        yield text[start : start + _STREAM_CHUNK_CHARS]


def _stream_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The SSE events that spell out `message`, in the order the API sends them."""
    usage = message["usage"]
    start = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1},
    }
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        kind = block.get("type")
        if kind == "text":
            opening, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": c} for c in _chunks(block["text"])]
        elif kind in ("tool_use", "server_tool_use"):
            encoded = json.dumps(block.get("input", {}))
            opening = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": ""}]
            deltas += [{"type": "input_json_delta", "partial_json": c} for c in _chunks(encoded)]
        elif kind == "thinking":
            opening = {**block, "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": c} for c in _chunks(block.get("thinking", ""))]
            deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
        else:
            opening, deltas = block, []
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": opening})
        )
        events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}) for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
