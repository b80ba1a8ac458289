"""Errors as the API means them: spend limits, x-should-retry, refusal details and rate-limit headers, read through
the real SDK over real HTTP (FakeAnthropic, or ScriptedAPI below where the fake cannot say it). No database.

Each test names the documentation it holds the code to.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import pytest

from durable_agents.agents import rate_limits
from durable_agents.agents.claude import AnthropicParticipant, count_input_tokens
from durable_agents.agents.messages import ModelRequest
from durable_agents.errors import ModelRequestError, ModelUnavailableError, StepError
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault

API_KEY = "sk-ant-test-secret-errors-0123456789"
ERRORS_DOC = "https://platform.claude.com/docs/en/api/errors"
# The tier's monthly spend cap, as the errors page shows it: a 429 rate_limit_error with an error code, no retry-after.
SPEND_CAP_BODY = {
    "type": "error",
    "error": {
        "type": "rate_limit_error",
        "message": "You have reached your API usage limits: your organization has crossed its monthly API usage "
        "threshold, set based on your organization's API tier. You will regain access on 2027-01-01 at 00:00 UTC.",
        "details": {"error_code": "enforced_spend_limit_reached"},
    },
    "request_id": "req_011spendcap",
}


# -- a loopback Messages API that says what FakeAnthropic cannot (stop_details, rate-limit headers, a fixed date) ----


EVENTS = "__events__"  # an answer scripted as stream events (ScriptedAPI.answer_stream)


class ScriptedAPI:
    """Answers each `POST /v1/messages` with the next scripted (status, body, headers), else a plain reply; each
    `POST /v1/messages/count_tokens` with the next scripted count answer, else 404. `date` fixes the `date` header
    (epoch seconds) so a reset time can be exact; `hold` keeps Messages requests in flight. Requests are recorded,
    body and path.

    Example::

        with ScriptedAPI() as api:
            api.answer(message(stop_reason="refusal"), headers={"anthropic-ratelimit-requests-remaining": "0"})
            client = anthropic.Anthropic(api_key="k", base_url=api.url, max_retries=0)
    """

    def __init__(self) -> None:
        self.answers: deque[tuple[int, dict[str, Any], dict[str, str]]] = deque()
        self.counts: deque[tuple[int, dict[str, Any]]] = deque()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.date: float | None = None
        # A streamed answer ends (cleanly) after this many events: a stream cut short, or empty (0).
        self.cut_stream_after: int | None = None
        # `hold.clear()` keeps Messages requests waiting (each sets `arrived`) until `hold.set()`.
        self.hold = threading.Event()
        self.hold.set()
        self.arrived = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.api = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def answer(self, body: dict[str, Any], status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.answers.append((status, body, dict(headers or {})))

    def answer_stream(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        """Stream the next answer as these (event, data) pairs, whatever the request asked for."""
        self.answers.append((200, {EVENTS: events}, {}))

    def count(self, body: dict[str, Any], status: int = 200) -> None:
        self.counts.append((status, body))

    def paths(self) -> list[str]:
        return [path for path, _body in self.requests]

    def client(self, **kwargs: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(api_key=API_KEY, base_url=self.url, max_retries=0, timeout=5.0, **kwargs)

    def __enter__(self) -> ScriptedAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        api: ScriptedAPI = self.server.api  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        path = self.path.split("?", 1)[0]
        api.requests.append((path, body))
        if path.endswith("/count_tokens"):
            status, answer = api.counts.popleft() if api.counts else (404, error_body("not_found_error", "no count"))
            return self._json(status, answer, {})
        api.arrived.set()
        api.hold.wait(timeout=30)
        status, answer, headers = api.answers.popleft() if api.answers else (200, message(), {})
        if status == 200 and (body.get("stream") or EVENTS in answer):
            return self._stream(answer, headers)
        return self._json(status, answer, headers)

    def date_time_string(self, timestamp: float | None = None) -> str:
        fixed = self.server.api.date  # type: ignore[attr-defined]
        return formatdate(fixed if fixed is not None else time.time(), usegmt=True)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, body: dict[str, Any], headers: Mapping[str, str]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"content-type": "application/json", "content-length": str(len(payload)), **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _stream(self, answer: dict[str, Any], headers: Mapping[str, str]) -> None:
        self.send_response(200)
        for name, value in {"content-type": "text/event-stream", "transfer-encoding": "chunked", **headers}.items():
            self.send_header(name, value)
        self.end_headers()
        events = answer[EVENTS] if EVENTS in answer else stream_of(answer)
        cut = self.server.api.cut_stream_after  # type: ignore[attr-defined]
        for event, data in events if cut is None else events[:cut]:
            chunk = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


def stream_of(answer: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A message as the API streams it (https://platform.claude.com/docs/en/build-with-claude/streaming): message_start,
    each block's start, deltas and stop, message_delta (stop_reason, the final usage), message_stop."""
    start = {**answer, "content": [], "stop_reason": None, "stop_details": None}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(answer["content"]):
        events.append(
            ("content_block_start", {"type": "content_block_start", "index": index, "content_block": _opening(block)})
        )
        events += [_delta(index, delta) for delta in _deltas(block)]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    stop = {k: answer.get(k) for k in ("stop_reason", "stop_sequence", "stop_details")}
    events.append(("message_delta", {"type": "message_delta", "delta": stop, "usage": answer["usage"]}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _opening(block: dict[str, Any]) -> dict[str, Any]:
    """A block as its content_block_start carries it: empty, its deltas to come
    (https://platform.claude.com/docs/en/build-with-claude/streaming, "Content block delta types")."""
    if block["type"] == "text":
        return {"type": "text", "text": ""}
    if block["type"] == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block["type"] == "tool_use":
        return {**block, "input": {}}
    return block  # whole in its start (redacted_thinking, server tool results)


def _deltas(block: dict[str, Any]) -> list[dict[str, Any]]:
    """The deltas that fill a block: text_delta (then one citations_delta a citation, as
    https://platform.claude.com/docs/en/build-with-claude/citations streams them), input_json_delta (the input's JSON
    in two pieces), thinking_delta then signature_delta."""
    if block["type"] == "text":
        return [{"type": "text_delta", "text": block["text"]}] + [
            {"type": "citations_delta", "citation": citation} for citation in block.get("citations") or ()
        ]
    if block["type"] == "thinking":
        return [
            {"type": "thinking_delta", "thinking": block["thinking"]},
            {"type": "signature_delta", "signature": block["signature"]},
        ]
    if block["type"] == "tool_use":
        written = json.dumps(block["input"])
        half = len(written) // 2
        return [{"type": "input_json_delta", "partial_json": part} for part in (written[:half], written[half:])]
    return []


def message(
    text: str = "ok", *, stop_reason: str = "end_turn", stop_details: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": "msg_01scripted",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-5-5",
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "stop_details": stop_details,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 3,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def error_body(kind: str, text: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": text}, "request_id": "req_011scripted"}


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def ratelimit_headers(limit: int, remaining: int, reset: float, *, name: str = "requests") -> dict[str, str]:
    return {
        f"anthropic-ratelimit-{name}-limit": str(limit),
        f"anthropic-ratelimit-{name}-remaining": str(remaining),
        f"anthropic-ratelimit-{name}-reset": rfc3339(reset),
    }


def ask(model: str = "claude-sonnet-5-5") -> ModelRequest:
    return ModelRequest(
        model=model, max_tokens=64, system="", tools=(), messages=({"role": "user", "content": "Refund A-1"},)
    )


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeAnthropic]:
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def claude(fake) -> AnthropicParticipant:
    return AnthropicParticipant(client=fake.client(api_key=API_KEY, max_retries=0, timeout=5.0))


# -- spend limits ---------------------------------------------------------------------------------------------------


def test_map_errors__spend_cap_429_is_permanent_and_sent_once(fake, claude):
    # https://platform.claude.com/docs/en/api/errors : the tier's monthly cap is a 429 with error_code
    # enforced_spend_limit_reached and no retry-after; "Retrying ... fails until access resumes".
    fake.enqueue(Fault.status(429, SPEND_CAP_BODY))

    with pytest.raises(ModelRequestError) as raised:
        claude.respond(ask())

    assert not isinstance(raised.value, ModelUnavailableError), "a spend cap is not transient"
    assert raised.value.status == 429
    text = str(raised.value)
    assert "monthly spend limit" in text and "higher usage tier" in text and "durable_resume" in text, text
    assert len(fake.requests) == 1, f"the spend-capped call was sent {len(fake.requests)} times, not once"


def test_map_errors__contract_spend_limit_429_is_permanent(fake, claude):
    # https://platform.claude.com/docs/en/api/errors (error codes); the SDK names it ContractSpendLimitReachedError.
    body = {
        **SPEND_CAP_BODY,
        "error": {**SPEND_CAP_BODY["error"], "details": {"error_code": "contract_spend_limit_reached"}},
    }
    fake.enqueue(Fault.status(429, body))

    with pytest.raises(ModelRequestError, match="spend limit of its contract.*ask Anthropic to raise"):
        claude.respond(ask())
    assert len(fake.requests) == 1


def test_map_errors__own_spend_limit_400_names_the_limit(fake, claude):
    # https://platform.claude.com/docs/en/api/errors : a spend limit the organization set is a 400 whose message
    # begins "You have reached your specified API usage limits".
    fake.enqueue(
        Fault.status(400, "You have reached your specified API usage limits. You will regain access on 2027-01-01.")
    )

    with pytest.raises(ModelRequestError, match="a spend limit it set") as raised:
        claude.respond(ask())
    assert "raise that limit in the Claude Console" in str(raised.value) and "durable_resume" in str(raised.value)


def test_map_errors__spend_cap_outranks_x_should_retry_true(fake, claude):
    # https://platform.claude.com/docs/en/api/errors : "branch on error_code"; the cap holds until the limit is raised.
    fake.enqueue(Fault.status(429, SPEND_CAP_BODY, {"x-should-retry": "true"}))

    with pytest.raises(ModelRequestError, match="monthly spend limit"):
        claude.respond(ask())


def test_map_errors__a_rate_limit_429_stays_transient(fake, claude):
    # https://platform.claude.com/docs/en/api/rate-limits : a 429 "along with a retry-after header"; retry after it.
    fake.enqueue(Fault.status(429, "Number of requests has exceeded your per-minute rate limit", {"retry-after": "7"}))

    with pytest.raises(ModelUnavailableError) as raised:
        claude.respond(ask())
    assert raised.value.status == 429 and raised.value.retry_after == 7.0


# -- x-should-retry -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "header", "expected"),
    [
        (400, "true", ModelUnavailableError),
        (403, "true", ModelUnavailableError),
        (400, None, ModelRequestError),
        (409, None, ModelUnavailableError),  # conflict_error, retried as the SDK's _should_retry does
        (409, "false", ModelRequestError),
        (429, "false", ModelRequestError),
        (500, "false", ModelRequestError),
        (529, "false", ModelRequestError),
        (529, None, ModelUnavailableError),
        (529, "true", ModelUnavailableError),
    ],
)
def test_map_errors__x_should_retry_flips_the_class(fake, claude, status, header, expected):
    # The SDK obeys `x-should-retry` before any status rule (anthropic/_base_client.py `_should_retry`), and the
    # errors page lists the statuses it would otherwise go by: https://platform.claude.com/docs/en/api/errors
    fake.enqueue(Fault.status(status, headers={"x-should-retry": header} if header else {}))

    with pytest.raises(StepError) as raised:
        claude.respond(ask())

    assert type(raised.value) is expected, f"{status} with x-should-retry {header}: got {type(raised.value).__name__}"
    assert raised.value.status == status
    if header == "false":
        assert "x-should-retry: false" in str(raised.value), "the message must say why a transient status is final"
    if expected is ModelUnavailableError and status in (400, 403):
        assert "x-should-retry: true" in str(raised.value)
    assert len(fake.requests) == 1, "the participant never retries by itself: the engine owns retries"


# -- stop_details ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_respond__keeps_the_refusal_stop_details(stream):
    # https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons : a refusal is a 200 whose
    # stop_details gives the category and an explanation; stop_details is null for every other stop reason.
    details = {"type": "refusal", "category": "cyber", "explanation": "This could help write malware."}
    with ScriptedAPI() as api:
        api.answer(message("", stop_reason="refusal", stop_details=details))
        api.answer(message("fine"))
        claude = AnthropicParticipant(client=api.client(), stream=stream)

        refused = claude.respond(ask())
        answered = claude.respond(ask())

    assert refused.stop_reason == "refusal" and refused.stop_details == details
    assert answered.stop_details is None


def test_respond__drops_the_null_fields_of_stop_details():
    # https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons : category, explanation may be null.
    with ScriptedAPI() as api:
        api.answer(message("", stop_reason="refusal", stop_details={"type": "refusal", "category": None}))
        refused = AnthropicParticipant(client=api.client()).respond(ask())
    assert refused.stop_details == {"type": "refusal"}


def test_respond__reads_the_answer_off_the_body_as_the_api_wrote_it():
    # https://platform.claude.com/docs/en/api/messages : `content` an array of blocks, `usage` with
    # `cache_creation.ephemeral_1h_input_tokens`; https://platform.claude.com/docs/en/api/errors : every response has a
    # `request-id` header. The body is decoded once, not built into the SDK's Message.
    answer = message(stop_reason="tool_use")
    answer["content"] = [
        {"type": "text", "text": "Looking.", "citations": None},
        {"type": "tool_use", "id": "toolu_01", "name": "look_up", "input": {"zeta": 1, "alpha": 2}},
    ]
    answer["usage"] = {
        "input_tokens": 40,
        "output_tokens": 9,
        "cache_creation_input_tokens": 30,
        "cache_read_input_tokens": 20,
        "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 20},
    }
    with ScriptedAPI() as api:
        api.answer(answer, headers={"request-id": "req_011body"})
        response = AnthropicParticipant(client=api.client()).respond(ask())

    assert response.content == (
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_01", "name": "look_up", "input": {"zeta": 1, "alpha": 2}},
    )
    assert list(response.content[1]["input"]) == ["zeta", "alpha"], "the model's key order"
    assert (response.stop_reason, response.model) == ("tool_use", "claude-sonnet-5-5")
    assert response.request_id == "req_011body"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (40, 9)
    assert (usage.cache_write_tokens, usage.cache_write_1h_tokens, usage.cache_read_tokens) == (30, 20, 20)


def test_respond__a_streamed_answer_carries_its_request_id():
    # https://platform.claude.com/docs/en/api/errors : every response has a `request-id` header, streamed ones too.
    with ScriptedAPI() as api:
        api.answer(message("streamed"), headers={"request-id": "req_011stream"})
        response = AnthropicParticipant(client=api.client(), stream=True).respond(ask())
    assert (response.content, response.request_id) == (({"type": "text", "text": "streamed"},), "req_011stream")


def test_respond__a_streamed_answer_is_journaled_as_the_same_answer_unstreamed():
    # A citation's `document_title` is null when the document had none (https://platform.claude.com/docs/en/
    # build-with-claude/citations), and is `Required[Optional[str]]` in the SDK's request types
    # (anthropic/types/citation_char_location_param.py): a history sent back without the key is not what the API wrote.
    # Streamed or not, the journaled blocks are the same: nulls inside a block kept, a block's own null fields left out.
    answer = message(stop_reason="tool_use")
    citation = {
        "type": "char_location",
        "cited_text": "Refunds within 30 days.",
        "document_index": 0,
        "document_title": None,
        "start_char_index": 0,
        "end_char_index": 23,
    }
    answer["content"] = [
        {"type": "thinking", "thinking": "The policy allows it.", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA"},
        {"type": "text", "text": "Within the window.", "citations": [citation]},
        {"type": "text", "text": "Refunding.", "citations": None},
        {"type": "tool_use", "id": "toolu_01", "name": "refund", "input": {"zeta": 1, "alpha": {"n": None}}},
    ]
    with ScriptedAPI() as api:
        api.answer(answer)
        api.answer(answer)
        unstreamed = AnthropicParticipant(client=api.client()).respond(ask())
        streamed = AnthropicParticipant(client=api.client(), stream=True).respond(ask())

    assert streamed.content == unstreamed.content
    assert streamed.content[1]["citations"] == [citation], "document_title: null kept"
    assert streamed.content[2] == {"type": "text", "text": "Refunding."}
    assert streamed.content[3]["input"] == {"zeta": 1, "alpha": {"n": None}}
    assert list(streamed.content[3]["input"]) == ["zeta", "alpha"], "the model's key order"


@pytest.mark.parametrize(
    ("opening", "delta"),
    [
        ({"type": "compaction", "content": None}, {"type": "compaction_delta", "content": "Summary so far."}),
        (
            {"type": "mcp_tool_use", "id": "mcptoolu_01", "name": "look_up", "server_name": "orders", "input": {}},
            {"type": "input_json_delta", "partial_json": '{"order": "A-1"}'},
        ),
    ],
    ids=["a-new-delta-type", "a-known-delta-on-a-new-block"],
)
def test_respond__a_stream_with_a_delta_the_sdk_does_not_assemble_is_refused(opening, delta):
    # https://platform.claude.com/docs/en/api/versioning : the API may add "new variants to enum-like output values
    # (for example, streaming event types)". The SDK's accumulator skips a delta it does not know (anthropic/lib/
    # streaming/_messages.py): the block would be journaled empty, a tool call without its arguments.
    events = stream_of(message())  # message_start, the text block's start, delta and stop, message_delta, message_stop
    events[4:4] = [
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": opening}),
        _delta(1, delta),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    ]
    with ScriptedAPI() as api:
        api.answer_stream(events)
        with pytest.raises(ModelRequestError, match=f"streamed a '{delta['type']}' for a '{opening['type']}' block"):
            AnthropicParticipant(client=api.client(), stream=True).respond(ask())


def test_respond__a_stream_cut_after_a_message_delta_is_asked_again():
    # https://platform.claude.com/docs/en/build-with-claude/streaming : "one or more message_delta events", then
    # message_stop; their usage counts are cumulative. Cut before the last, the first's output_tokens are not the bill.
    answer = message()
    answer["usage"] = {"input_tokens": 12, "output_tokens": 300}
    events = stream_of(answer)
    early = {"type": "message_delta", "delta": events[-2][1]["delta"], "usage": {"output_tokens": 5}}
    events.insert(-2, ("message_delta", early))
    with ScriptedAPI() as api:
        api.answer_stream(events[:-2])  # the stream ends after the first message_delta
        with pytest.raises(ModelUnavailableError, match="ended before its message did"):
            AnthropicParticipant(client=api.client(), stream=True).respond(ask())


def _start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def _stop(index: int) -> tuple[str, dict[str, Any]]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def _tool_call(*partials: str, stop_reason: str = "tool_use", stopped: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """A stream of one tool call whose input JSON comes in `partials`."""
    answer = message(stop_reason=stop_reason)
    answer["content"] = []
    events = stream_of(answer)
    tool = {"type": "tool_use", "id": "toolu_01", "name": "refund", "input": {}}
    json_deltas = [_delta(0, {"type": "input_json_delta", "partial_json": part}) for part in partials]
    events[1:1] = [_start(0, tool), *json_deltas, *([_stop(0)] if stopped else [])]
    return events


def _text_then(*more: tuple[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """A whole stream of one text block ("Hello"), `more` events after its block's stop."""
    events = stream_of(message("Hello"))
    events[4:4] = list(more)
    return events


def _no_message_delta() -> list[tuple[str, dict[str, Any]]]:
    events = stream_of(message("Hello"))
    events[0][1]["message"] |= {"stop_reason": "end_turn", "usage": {"input_tokens": 12, "output_tokens": 1}}
    del events[-2]
    return events


def _after_the_stop() -> list[tuple[str, dict[str, Any]]]:
    events = stream_of(message("Refund approved."))
    later = {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 99}}
    return [*events, _delta(0, {"type": "text_delta", "text": " Actually, denied."}), ("message_delta", later)]


# Each breaks https://platform.claude.com/docs/en/build-with-claude/streaming's event flow ("Each content block will
# have an index that corresponds to its index in the final Message content array"; a block's deltas between its
# content_block_start and content_block_stop; "one or more message_delta events", their usage cumulative, with its
# output_tokens; "a final message_stop event"), and the SDK's accumulator takes it without a word.
BROKEN_STREAMS = {
    # Parsed in the SDK's partial mode, a cut input is journaled as what it makes of it ({} here), and executed.
    "a-tool-input-cut-short": lambda: _tool_call('{"order": "A-', '1", "amount": 4'),
    "a-tool-input-with-more-after-it": lambda: _tool_call('{"order": "A-1"}', ' {"amount": 40}'),
    "a-block-never-stopped": lambda: _tool_call('{"order": "A-1"}', stopped=False),
    "a-block-started-twice": lambda: _text_then(_start(0, {"type": "text", "text": ""}), _stop(0)),
    "a-block-out-of-order": lambda: _text_then(_start(2, {"type": "text", "text": ""}), _stop(2)),
    "a-delta-for-a-negative-index": lambda: _text_then(_delta(-1, {"type": "text_delta", "text": " (negative)"})),
    "no-message-delta": _no_message_delta,
    "events-after-message-stop": _after_the_stop,
}


@pytest.mark.parametrize("broken", BROKEN_STREAMS.values(), ids=BROKEN_STREAMS.keys())
def test_respond__a_stream_out_of_the_documented_order_is_asked_again(broken):
    with ScriptedAPI() as api:
        api.answer_stream(broken())
        with pytest.raises(ModelUnavailableError, match="held no whole message"):
            AnthropicParticipant(client=api.client(), stream=True).respond(ask())


def test_respond__a_message_delta_without_its_output_tokens_is_asked_again():
    # MessageDeltaUsage.output_tokens is required (anthropic/types/message_delta_usage.py): without it the SDK bills 0.
    events = stream_of(message("Hello"))
    events[-2][1]["usage"] = {}
    with ScriptedAPI() as api:
        api.answer_stream(events)
        with pytest.raises(ModelUnavailableError, match="without its output_tokens"):
            AnthropicParticipant(client=api.client(), stream=True).respond(ask())


def test_respond__a_tool_call_cut_by_max_tokens_is_the_loop_s_to_set_aside():
    # https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons : max_tokens may cut a tool call;
    # that is an answer (the agent loop sets the turn aside and asks with more room), not a broken stream.
    with ScriptedAPI() as api:
        api.answer_stream(_tool_call('{"order": "A-', stop_reason="max_tokens"))
        cut = AnthropicParticipant(client=api.client(), stream=True).respond(ask())
    assert cut.stop_reason == "max_tokens" and cut.content[0]["type"] == "tool_use"


def test_respond__a_tool_without_parameters_streams_an_empty_input():
    # A tool with no parameters streams one input_json_delta of "" (streaming docs): its input is {}.
    with ScriptedAPI() as api:
        api.answer_stream(_tool_call(""))
        called = AnthropicParticipant(client=api.client(), stream=True).respond(ask())
    assert called.content == ({"type": "tool_use", "id": "toolu_01", "name": "refund", "input": {}},)


def test_respond__a_stream_with_a_delta_for_no_block_is_asked_again():
    # A delta names its block by index (streaming docs); one for a block never started is a broken stream (the SDK
    # raises IndexError): transient, like a stream cut short, never a raw error.
    events = stream_of(message())
    events.insert(2, _delta(5, {"type": "text_delta", "text": "x"}))
    with ScriptedAPI() as api:
        api.answer_stream(events)
        with pytest.raises(ModelUnavailableError, match="held no whole message"):
            AnthropicParticipant(client=api.client(), stream=True).respond(ask())


def test_respond__a_streamed_answer_bills_the_cache_writes_its_last_message_delta_counts():
    # Usage counts on a message_delta are cumulative (streaming docs): its totals win over message_start's, and so
    # does its 5 min / 1 h split when it carries one (the SDK keeps message_start's; 1 h writes cost more).
    answer = message()
    answer["usage"] = {
        "input_tokens": 40,
        "output_tokens": 9,
        "cache_creation_input_tokens": 50,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 40},
    }
    events = stream_of(answer)
    started = {**answer["usage"], "output_tokens": 1, "cache_creation_input_tokens": 30}
    started["cache_creation"] = {"ephemeral_5m_input_tokens": 10, "ephemeral_1h_input_tokens": 20}
    events[0][1]["message"]["usage"] = started
    with ScriptedAPI() as api:
        api.answer_stream(events)
        api.answer(answer)
        streamed = AnthropicParticipant(client=api.client(), stream=True).respond(ask())
        unstreamed = AnthropicParticipant(client=api.client()).respond(ask())
    assert streamed.usage == unstreamed.usage
    assert (streamed.usage.cache_write_tokens, streamed.usage.cache_write_1h_tokens) == (50, 40)


@pytest.mark.parametrize(("events", "said"), [(0, "held no whole message"), (3, "ended before its message did")])
def test_respond__a_stream_that_ends_before_its_message_is_asked_again(events, said):
    # https://platform.claude.com/docs/en/build-with-claude/streaming : a stream is message_start, the blocks, then
    # message_delta (stop_reason, final usage) and message_stop. One that ends before (none at all; a text delta, then
    # nothing) holds no answer to journal: transient, not half an answer with no stop_reason.
    with ScriptedAPI() as api:
        api.cut_stream_after = events
        api.answer(message("The refund is approved and the money is on its way"))
        with pytest.raises(ModelUnavailableError, match=said):
            AnthropicParticipant(client=api.client(), stream=True).respond(ask())


@pytest.mark.parametrize(
    "body", [{"type": "message", "usage": {"input_tokens": 1}}, ["not", "a", "message"]], ids=["no-content", "a-list"]
)
def test_respond__a_200_that_is_no_message_is_asked_again(body):
    # A 200 whose body is not a Messages API answer (a proxy's page, say) has nothing to journal: transient, like a 5xx.
    with ScriptedAPI() as api:
        api.answer(body)
        with pytest.raises(ModelUnavailableError, match="no message in the body"):
            AnthropicParticipant(client=api.client()).respond(ask())


# -- anthropic-ratelimit-* headers, read offline --------------------------------------------------------------------


def test_allowances__reads_each_limit_against_the_answers_date():
    # https://platform.claude.com/docs/en/api/rate-limits : anthropic-ratelimit-{requests,tokens,input-tokens,
    # output-tokens}-{limit,remaining,reset}, reset in RFC 3339.
    answered = 1_800_000_000.0
    headers = {
        "date": formatdate(answered, usegmt=True),
        **ratelimit_headers(50, 49, answered + 1.2),
        **ratelimit_headers(30_000, 1_000, answered + 58, name="input-tokens"),
        **ratelimit_headers(8_000, 8_000, answered, name="output-tokens"),
    }

    found = {a.name: a for a in rate_limits.allowances(headers)}

    assert set(found) == {"requests", "input-tokens", "output-tokens"}
    assert found["requests"].resets_in == pytest.approx(1.2) and not found["requests"].is_low
    assert found["input-tokens"].is_low, "1,000 of 30,000 left is under the headroom"
    assert found["input-tokens"].resets_in == pytest.approx(58)
    assert rate_limits.header_hold(headers) == pytest.approx(58)


def test_header_hold__nothing_low_or_nothing_readable_holds_nothing():
    # https://platform.claude.com/docs/en/api/rate-limits : the headers refine pacing; unreadable ones are ignored.
    now = 1_800_000_000.0
    assert rate_limits.header_hold(ratelimit_headers(50, 40, now + 30), now) == 0.0
    assert rate_limits.header_hold({}, now) == 0.0
    garbled = {**ratelimit_headers(50, 0, now + 30), "anthropic-ratelimit-requests-reset": "soon"}
    assert rate_limits.header_hold(garbled, now) == 0.0


def test_header_hold__a_reset_far_ahead_is_capped_at_a_minute():
    # https://platform.claude.com/docs/en/api/rate-limits : the limits are per minute (a token bucket refilled
    # continuously), so a reset an hour ahead says more about a clock than about the limit.
    now = 1_800_000_000.0
    assert rate_limits.header_hold(ratelimit_headers(50, 0, now + 3600), now) == rate_limits.LONGEST_HEADER_HOLD_SECONDS


def test_header_hold__without_a_date_reads_this_machines_clock():
    # https://platform.claude.com/docs/en/api/rate-limits : reset is an absolute RFC 3339 time.
    hold = rate_limits.header_hold(ratelimit_headers(50, 0, time.time() + 20))
    assert 15 < hold <= 20, hold


# -- count_tokens, offline of the limiter ---------------------------------------------------------------------------


def test_count_input_tokens__sends_the_prompt_not_the_generation_parameters():
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : the same inputs as a message (system,
    # tools, messages), no max_tokens; the answer is {"input_tokens": N}.
    request = ModelRequest(
        model="claude-sonnet-5-5",
        max_tokens=512,
        system="You handle refunds.",
        tools=({"name": "refund", "description": "Refund", "input_schema": {"type": "object"}},),
        messages=({"role": "user", "content": "Refund A-1"},),
        metadata={"user_id": "conv-1"},
    ).as_kwargs()
    with ScriptedAPI() as api:
        api.count({"input_tokens": 321})
        assert count_input_tokens(api.client(), request) == 321
        (path, body), *_ = api.requests
    assert path == "/v1/messages/count_tokens"
    assert set(body) == {"model", "messages", "system", "tools"}, body


@pytest.mark.parametrize(
    "answer",
    [(429, error_body("rate_limit_error", "count_tokens limit")), (500, error_body("api_error", "boom")), (200, {})],
    ids=["429", "500", "no-count"],
)
def test_count_input_tokens__any_failure_is_none(answer):
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : free, but rate-limited on its own.
    with ScriptedAPI() as api:
        api.count(answer[1], status=answer[0])
        assert count_input_tokens(api.client(), ask().as_kwargs()) is None


def test_count_input_tokens__an_unreachable_api_is_none():
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : a count refines an estimate, no more.
    client = anthropic.Anthropic(api_key=API_KEY, base_url="http://127.0.0.1:9", max_retries=0, timeout=2.0)
    assert count_input_tokens(client, ask().as_kwargs()) is None
