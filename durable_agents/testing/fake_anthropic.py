"""A fake Anthropic Messages API on loopback: strict like the real one, scripted replies, faults and a request log.

Point the real SDK at it and the whole client stack (retries, timeouts, SSE parsing) runs for real::

    from durable_agents.testing.fake_anthropic import Fault, FakeAnthropic, Reply

    with FakeAnthropic() as fake:
        fake.enqueue(Fault.status(529), Reply.tool_use("search", {"q": "otters"}), Reply.text("done"))
        client = anthropic.Anthropic(api_key="test-key", base_url=fake.url)
        ...
        assert fake.count(conversation, turn=1) == 1, "turn 1 was asked twice: a committed step re-ran"

Strict: the fake refuses what the documented API refuses, with the documented words (`api_shapes`, `api_rules`,
`api_tool_loop`), from its own model table written from the docs (`api_models`, never the library's): an unknown
top-level field, a prefill on a model without prefill, a forced `tool_choice` while thinking, a `tool_use` without
its `tool_result`, a fifth cache breakpoint, a prompt over the context window, a thinking block whose signature it
did not mint or whose prefix changed (`thinking_binding`). A refusal is a 400 (404 for a retired model) and is
recorded with `RecordedRequest.refused`; a body of a shape no rule expected is a 400 naming the field, never a
dropped connection. The defaults are the strictest documented account:

* unknown model ids ("m", "claude-test") are served with the newest models' rules: thinking on when omitted,
  adaptive only, no prefill, no forced tool choice, no sampling parameters, prefix check (``strict_models=True``
  makes them a 404, like a retired id; ``models={...}`` adds or replaces rows);
* ``preserved_thinking="error"``: an account created on or after 2026-08-31, where a thinking block whose prefix
  changed is a 400 (``"allow"``: an older account, the block goes through and lands in `prefix_mismatches`);
* ``strict_roles=True``: two messages of one role in a row are refused (the API would combine them);
* ``auto_thinking=True``: when a request thinks, a reply without a thinking block is served with a signed one in
  front, so every test that sends history back exercises the signature and prefix checks.

Concurrency: `latency=2.0` makes every answer take two seconds, like a model thinking; `in_flight` and
`peak_in_flight` count requests being answered; `hold()` keeps requests waiting until `release()`, and
`wait_in_flight(n, timeout)` waits until n are held, so a test can look at its workers while n conversations
wait on the model. `requests_per_second=50` limits the API as Anthropic does (a bucket of 50 requests refilled at
50 a second): a request beyond it is answered 429 with a `retry-after` and counted in `rate_limited`; answers
within it carry the `anthropic-ratelimit-requests-*` headers.

What answers a `POST /v1/messages`, first match wins: the queue (`enqueue`, `fail_next`), then `responder`
(a function of the `RecordedRequest`), then a plain `end_turn` text reply. `count_tokens`, refused requests and
`max_tokens: 0` cache pre-warms never consume the queue. The fake does not retry anything; the SDK under test
owns retries, and each of its attempts shows up in the log with its `x-stainless-retry-count`.

Message Batches (`fake_batches`): `client.messages.batches.create/retrieve/list/cancel/delete/results` work. A batch
ends `batch_processing_seconds` after creation (0 by default; looked at lazily, when it is retrieved, listed or its
results fetched) and only then are its requests answered, in order, each exactly as a live `/v1/messages` (the same
checks, queue, responder and reply building; a refusal or a `Fault` becomes an `errored` result, `Fault.expired()` /
`Fault.canceled()` end that request so). The log records each as a "/v1/messages" request with its `batch_id`, so
`count` counts batched asks too. `hold_batches()` / `release_batches()` / `end_batches()` make timing
deterministic, `batch_expire_after_seconds` shortens the API's 24 h expiry, and `fail_batch_call(op, fault,
after=True)` lets a call take effect before its fault (a batch created, a connection dropped: the client cannot know).
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from durable_agents.testing.api_models import MODELS, ModelRules, rules_for
from durable_agents.testing.api_rules import check_request
from durable_agents.testing.api_shapes import check_shape
from durable_agents.testing.fake_batches import BATCHES_PATH, Batch, BatchCall, BatchDesk, fault_result
from durable_agents.testing.fake_cache import PromptCache
from durable_agents.testing.fake_http import Handler, Server
from durable_agents.testing.fake_log import CONVERSATION_HEADER, RecordedRequest, RequestLog, Responder
from durable_agents.testing.fake_replies import (
    STOP_REASONS,
    Fault,
    Reply,
    build_message,
    error_body,
    redacted_thinking_block,
    server_tool_use_block,
    stream_events,
    text_block,
    thinking_block,
    tool_use_block,
)
from durable_agents.testing.fake_traffic import InFlight, RequestBucket
from durable_agents.testing.thinking_binding import Binding, BlockNote, Signer, content_digest

if TYPE_CHECKING:
    import anthropic

__all__ = [
    "CONVERSATION_HEADER",
    "STOP_REASONS",
    "Batch",
    "BlockNote",
    "FakeAnthropic",
    "Fault",
    "ModelRules",
    "RecordedRequest",
    "Reply",
    "Responder",
    "redacted_thinking_block",
    "server_tool_use_block",
    "text_block",
    "thinking_block",
    "tool_use_block",
]

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
REDACTED = "[redacted]"
# https://platform.claude.com/docs/en/api/errors: 413 request_too_large above 32 MB (Messages and count_tokens).
MAX_BODY_BYTES = 32 * 1024 * 1024
_SECRET_HEADERS = frozenset({"x-api-key", "authorization"})


@dataclass
class _Verdict:
    """What checking a request decided: its model's rules, and what its thinking blocks turned out to be."""

    rules: ModelRules | None = None
    binding: Binding = field(default_factory=Binding)
    status: int = 200
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)


class FakeAnthropic:
    """A threaded loopback server speaking the Messages API, as strictly as the docs describe it.

    Example::

        with FakeAnthropic() as fake:
            fake.responder = lambda req: Reply.text(f"echo: {req.last_user_text}")
            client = fake.client(max_retries=0)
            message = client.messages.create(model="m", max_tokens=5, messages=[...])
            [block.text for block in message.content if block.type == "text"]   # ["echo: hi"]

    Options (see the module docstring for why these defaults): `models` adds or replaces rows of the model
    table; `strict_models` answers unknown ids 404; `preserved_thinking` is the account's prefix-check
    enforcement ("error" | "allow"); `strict_roles` refuses consecutive same-role messages; `auto_thinking`
    serves a signed thinking block in front of replies to thinking requests.
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
        models: Mapping[str, ModelRules] | None = None,
        strict_models: bool = False,
        preserved_thinking: Literal["error", "allow"] = "error",
        strict_roles: bool = True,
        auto_thinking: bool = True,
        batch_processing_seconds: float = 0.0,
        batch_expire_after_seconds: float | None = None,
    ) -> None:
        if preserved_thinking not in ("error", "allow"):
            raise ValueError(f"preserved_thinking must be 'error' or 'allow', not {preserved_thinking!r}")
        self.responder: Responder | None = responder
        self.latency = latency  # seconds every `/v1/messages` answer takes, like a model thinking
        # The API's rate limit: a bucket of this many requests, refilled at this rate; beyond it, 429 + retry-after.
        self._bucket = RequestBucket(requests_per_second)
        self.errors: list[BaseException] = []  # exceptions raised by the responder, served as 500s
        self.billed: list[dict[str, Any]] = []  # the usage of every message served: what the API would bill
        self.models: dict[str, ModelRules] = {**MODELS, **(models or {})}
        self.strict_models = strict_models
        self.preserved_thinking = preserved_thinking
        self.strict_roles = strict_roles
        self.auto_thinking = auto_thinking
        # Returned thinking blocks the model could not read (dropped silently, as the API does), and blocks whose
        # prefix changed but went through ("allow" accounts); both in the order seen.
        self.dropped_thinking: list[BlockNote] = []
        self.prefix_mismatches: list[BlockNote] = []
        self._paused: set[str] = set()  # digests of pause_turn answers: sent back last, they continue, not prefill
        self._signer = Signer(secrets.token_bytes(32))  # per fake: another fake's blocks are forgeries here
        self._host = host
        self._port = port
        self._lock = threading.RLock()
        self._queue: deque[Reply | Fault] = deque()
        self._log = RequestLog()
        self._cache = PromptCache(clock=clock, min_cache_tokens=min_cache_tokens)
        self._stopping = threading.Event()
        self._open = threading.Event()  # the gate: cleared by hold(), set by release()
        self._open.set()
        self._holds: Callable[[RecordedRequest], bool] | None = None
        self._flight = InFlight()
        self._batch_desk = BatchDesk(
            answer=self._answer_batched,
            log=self._log,
            lock=self._lock,
            stopping=self._stopping,
            processing_seconds=batch_processing_seconds,
            expire_after_seconds=batch_expire_after_seconds,
        )
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def requests_per_second(self) -> float | None:
        """The API's request rate limit this fake enforces (None: none)."""
        return self._bucket.rate

    @property
    def rate_limited(self) -> int:
        """429s served by the `requests_per_second` limit."""
        return self._bucket.limited

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
        self._server = Server((self._host, self._port), Handler, self)
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
        """Forget the queue, the request log, the thinking logs and the prompt cache (the responder stays)."""
        self._log.clear()
        with self._lock:
            self._queue.clear()
            self._cache.clear()
            self.errors.clear()
            self.dropped_thinking.clear()
            self.prefix_mismatches.clear()
            self.billed.clear()
            self._bucket.limited = 0
        self._batch_desk.clear()

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
        return self._flight.count

    @property
    def peak_in_flight(self) -> int:
        """The most `/v1/messages` requests in flight at once since the start (or `reset_peak`)."""
        return self._flight.peak

    def reset_peak(self) -> None:
        self._flight.reset_peak()

    def wait_in_flight(self, n: int, timeout: float) -> bool:
        """Block until at least `n` requests are in flight (True), or `timeout` seconds passed (False)."""
        return self._flight.wait_for(n, timeout)

    # -- message batches -------------------------------------------------------------------------------------

    @property
    def batch_processing_seconds(self) -> float:
        """How long after its creation a batch ends (monotonic clock, evaluated when it is next looked at)."""
        return self._batch_desk.processing_seconds

    @batch_processing_seconds.setter
    def batch_processing_seconds(self, seconds: float) -> None:
        self._batch_desk.processing_seconds = seconds

    @property
    def batch_expire_after_seconds(self) -> float | None:
        """A batch still processing this long after creation ends with its requests `expired` (the API's 24 h)."""
        return self._batch_desk.expire_after_seconds

    @batch_expire_after_seconds.setter
    def batch_expire_after_seconds(self, seconds: float | None) -> None:
        self._batch_desk.expire_after_seconds = seconds

    def hold_batches(self) -> None:
        """Keep every batch processing (a cancelled one: canceling) until `release_batches()` or `end_batches()`."""
        self._batch_desk.hold()

    def release_batches(self) -> None:
        self._batch_desk.release()

    def end_batches(self) -> None:
        """End every batch still processing now: its requests are answered, in order (a cancelled one's: canceled)."""
        self._batch_desk.end_all()

    def fail_batch_call(self, op: BatchCall, fault: Fault, *, after: bool = False) -> None:
        """Serve `fault` to the next call of a batch endpoint ("create" | "retrieve" | "list" | "cancel" |
        "delete" | "results"); with `after`, the call takes effect first: ``fail_batch_call("create",
        Fault.reset(), after=True)`` creates the batch and drops the connection, so the client cannot know."""
        self._batch_desk.fail_call(op, fault, after=after)

    @property
    def batches(self) -> list[Batch]:
        """Every batch created, oldest first (deleted ones too, with `deleted` set)."""
        return self._batch_desk.batches

    @property
    def batch_creates(self) -> int:
        """Batch creates that took effect (an `after=True` fault counts: the batch exists)."""
        return self._batch_desk.creates

    @property
    def batch_requests_answered(self) -> int:
        """Batched requests given an answer (succeeded or errored, as live; canceled and expired ones are not)."""
        return self._batch_desk.answered

    # -- log -------------------------------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        return self._log.all()

    def requests_for(self, conversation: str) -> list[RecordedRequest]:
        return [r for r in self._log.all() if r.conversation == conversation]

    def count(self, conversation: str, turn: int) -> int:
        """How many times `/v1/messages` was asked for this turn; more than 1 means a retry or a re-run."""
        key = (MESSAGES_PATH, conversation, turn)
        return sum(1 for r in self._log.all() if (r.path, r.conversation, r.turn) == key)

    # -- serving ---------------------------------------------------------------------------------------------

    def _serve(self, handler: Handler) -> None:
        path = handler.path.split("?", 1)[0].rstrip("/")
        # Redact before anything is stored: the API key must never outlive this request.
        headers = {k.lower(): (REDACTED if k.lower() in _SECRET_HEADERS else v) for k, v in handler.headers.items()}
        has_key = bool(handler.headers.get("x-api-key") or handler.headers.get("authorization", "")[7:].strip())
        length = handler.content_length()
        if path == BATCHES_PATH or path.startswith(BATCHES_PATH + "/"):
            if has_key:
                self._batch_desk.serve(handler, handler.command, path, headers, self.url)
                return
            handler.discard_body(length)
            message = "x-api-key or authorization header is required"
            self._log.record(handler.command, path, headers, None, refused=message)
            handler.send_json(401, error_body("authentication_error", message))
            return
        if length > MAX_BODY_BYTES:
            handler.discard_body(length)  # read it all, or the client sees a broken pipe instead of the 413
            message = "Request exceeds the maximum allowed number of bytes."
            self._log.record(handler.command, path, headers, None, refused=message)
            handler.send_json(413, error_body("request_too_large", message))
            return
        raw = handler.rfile.read(length)
        try:
            body = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            body = raw.decode("utf-8", "replace")
        if path not in (MESSAGES_PATH, COUNT_TOKENS_PATH) or handler.command != "POST":
            verdict = _Verdict(status=404, error=f"{handler.command} {path} not found")
        elif not has_key:
            verdict = _Verdict(status=401, error="x-api-key or authorization header is required")
        else:
            verdict = self._check(path, body, headers)
        request = self._log.record(handler.command, path, headers, body, refused=verdict.error or None)
        if verdict.status != 200:
            handler.send_json(verdict.status, error_body(_ERROR_TYPES[verdict.status], verdict.error))
            return
        with self._lock:
            self.dropped_thinking.extend(verdict.binding.dropped)
            self.prefix_mismatches.extend(verdict.binding.mismatched)
        if path == COUNT_TOKENS_PATH:
            input_tokens, creation, read = self._cache.usage(body, update_cache=False)
            handler.send_json(200, {"input_tokens": input_tokens + creation + read})
        elif (wait := self._bucket.take(verdict.headers)) is not None:
            handler.send_json(
                429,
                error_body("rate_limit_error", f"over {self.requests_per_second:g} requests per second"),
                {"retry-after": str(max(1, math.ceil(wait)))},
            )
        elif body.get("max_tokens") == 0:
            # A cache pre-warm (prompt-caching docs): nothing is generated, so the script is not consumed.
            self._answer(handler, request, Reply(stop_reason="max_tokens", output_tokens=0), verdict)
        else:
            with self._flight:
                # Held at the gate, then the model's latency; a stopping fake drops the connection instead.
                holds = self._holds
                if holds is None or holds(request):
                    while not self._open.wait(0.5):
                        pass
                if self.latency and self._stopping.wait(self.latency):
                    handler.drop_connection()
                    return
                self._answer(handler, request, self._next_action(request), verdict)

    def _check(self, path: str, body: Any, headers: Mapping[str, str]) -> _Verdict:
        """Refuse what the API refuses: the request's shape, its model (404), its rules, its thinking blocks."""
        try:
            return self._check_body(path, body, headers)
        except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as exc:
            # A body of a shape no rule expected (each rule in `check_request` is guarded and names its field):
            # the API answers such a request 400, and the handler thread must live on to answer it.
            logger.warning("FakeAnthropic could not read a request body: %r", exc)
            return _Verdict(status=400, error=f"request body: Input could not be validated ({type(exc).__name__})")

    def _check_body(self, path: str, body: Any, headers: Mapping[str, str]) -> _Verdict:
        betas = frozenset(v.strip() for v in headers.get("anthropic-beta", "").split(",") if v.strip())
        # The shape first, so the rules, the signatures and the cache accounting only read well-typed fields.
        if problem := check_shape(body, path=path, betas=betas):
            return _Verdict(status=400, error=problem)
        model = body["model"]
        if not isinstance(model, str):
            return _Verdict(status=400, error="model: Input should be a valid string")
        rules = rules_for(model, self.models, strict=self.strict_models)
        if rules is None:
            # https://platform.claude.com/docs/en/about-claude/model-deprecations: requests to retired models fail,
            # observed as 404 not_found_error "model: <id>" (the same for an id that never existed).
            return _Verdict(status=404, error=f"model: {model}")
        last = body["messages"][-1]
        with self._lock:
            paused = isinstance(last, dict) and content_digest(last.get("content")) in self._paused
        problem = check_request(
            body, path=path, rules=rules, strict_roles=self.strict_roles, betas=betas, continuation=paused
        )
        if problem:
            return _Verdict(rules=rules, status=400, error=problem)
        binding = self._signer.check(body, rules, mode=self.preserved_thinking, betas=betas)
        if binding.error:
            return _Verdict(rules=rules, binding=binding, status=400, error=binding.error)
        return _Verdict(rules=rules, binding=binding)

    def _answer_batched(self, params: Any, headers: Mapping[str, str], batch_id: str) -> dict[str, Any]:
        """One request of a batch, answered as `POST /v1/messages` would answer `params`, as its `result` object."""
        # https://platform.claude.com/docs/en/build-with-claude/batch-processing: a few parameters are not supported
        # in a batch (a validation error): streaming, and max_tokens 0 (a cache pre-warm would expire unused).
        if isinstance(params, dict) and params.get("stream"):
            verdict = _Verdict(status=400, error="stream: streaming is not supported in Message Batches requests")
        elif isinstance(params, dict) and params.get("max_tokens") == 0:
            verdict = _Verdict(status=400, error="max_tokens: must be at least 1 in Message Batches requests")
        else:
            verdict = self._check(MESSAGES_PATH, params, headers)
        request = self._log.record(
            "POST", MESSAGES_PATH, dict(headers), params, refused=verdict.error or None, batch_id=batch_id
        )
        if verdict.status != 200:
            return {"type": "errored", "error": error_body(_ERROR_TYPES[verdict.status], verdict.error)}
        with self._lock:
            self.dropped_thinking.extend(verdict.binding.dropped)
            self.prefix_mismatches.extend(verdict.binding.mismatched)
        action = self._next_action(request)
        if isinstance(action, Fault):
            return fault_result(action, params)
        message, _ = self._message(request, action, verdict)
        if action.stop_reason == "pause_turn":
            with self._lock:
                self._paused.add(content_digest(message["content"]))
        return {"type": "succeeded", "message": message}

    def _answer(self, handler: Handler, request: RecordedRequest, action: Reply | Fault, verdict: _Verdict) -> None:
        if isinstance(action, Fault) and action.kind == "delay":
            if self._stopping.wait(action.seconds):
                handler.drop_connection()
                return
            action = action.then or self._fallback(request)
        if isinstance(action, Fault):
            self._serve_fault(handler, request, action, verdict)
            return
        message, truncated = self._message(request, action, verdict)
        if action.stop_reason == "pause_turn":
            with self._lock:
                self._paused.add(content_digest(message["content"]))
        if not request.stream:
            handler.send_json(200, message, verdict.headers)
            return
        handler.start_stream(verdict.headers)
        for event, data in stream_events(message, truncated):
            handler.send_event(event, data)
        handler.end_stream()

    def _serve_fault(self, handler: Handler, request: RecordedRequest, fault: Fault, verdict: _Verdict) -> None:
        if fault.kind == "reset":
            if fault.mid_stream and request.stream:
                handler.start_stream()
                message, _ = self._message(request, Reply.text("This reply is cut off"), verdict)
                for event, data in stream_events(message)[:3]:  # message_start, content_block_start, one delta
                    handler.send_event(event, data)
            handler.drop_connection()
            return
        if fault.kind == "stream_error" and request.stream:
            handler.start_stream()
            message, _ = self._message(request, Reply.text(fault.partial_text), verdict)
            events = stream_events(message)
            sent = events[:-3] if fault.partial_text else events[:1]  # all but block/message stops, or just start
            for event, data in sent:
                handler.send_event(event, data)
            handler.send_event("error", dict(fault.body or {}))
            handler.end_stream()
            return
        body = dict(fault.body or {})
        if fault.model_in_message:
            model = request.body.get("model") if isinstance(request.body, dict) else None
            body["error"] = {**body["error"], "message": f"model: {model}"}
        handler.send_json(fault.status_code, body, fault.headers)

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

    def _message(self, request: RecordedRequest, reply: Reply, verdict: _Verdict) -> tuple[dict[str, Any], list[bool]]:
        usage = self._cache.usage(request.body, update_cache=True)
        message, truncated = build_message(
            request.body,
            reply,
            verdict.rules,
            verdict.binding,
            usage=usage,
            signer=self._signer,
            auto_thinking=self.auto_thinking,
        )
        with self._lock:
            self.billed.append(message["usage"])
        return message, truncated


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
