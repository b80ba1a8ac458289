"""The fake Anthropic server, exercised through the real `anthropic` SDK over loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx2
import pytest
from anthropic.types import Message, TextBlock, ThinkingBlock, ToolUseBlock

from durable_agents.testing.fake_anthropic import (
    STOP_REASONS,
    FakeAnthropic,
    Fault,
    RecordedRequest,
    Reply,
    text_block,
    tool_use_block,
)

MODEL = "claude-fake-1"  # not a real model: the SDK warns about deprecated names
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def client(fake: FakeAnthropic) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="test-key", base_url=fake.url, max_retries=0)


def create(client: anthropic.Anthropic, messages: list[dict[str, Any]] = HELLO, **kwargs: Any) -> Message:
    return client.messages.create(model=MODEL, max_tokens=64, messages=messages, **kwargs)  # type: ignore[arg-type]


def visible(message: Message) -> list[Any]:
    """The reply's blocks past the thinking block the fake puts in front when a request thinks (the default for a
    model it does not know, which it serves with the newest models' rules)."""
    return [block for block in message.content if block.type not in ("thinking", "redacted_thinking")]


def post_raw(fake: FakeAnthropic, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(
        fake.url + path, data=json.dumps(body).encode(), headers={"content-type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_fake_anthropic__text_reply_parses_as_message(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Reply.text("hi there"))

    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=64, messages=HELLO)  # type: ignore[arg-type]
    message = raw.parse()

    assert raw.headers["request-id"].startswith("req_"), "every response must carry a request-id header"
    assert isinstance(message, Message)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL, "the fake should echo the requested model"
    thinking, *rest = message.content
    assert isinstance(thinking, ThinkingBlock) and thinking.signature, "a thinking request must get a signed block"
    assert rest == [TextBlock(type="text", text="hi there")]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert message.usage.input_tokens >= 1 and message.usage.output_tokens >= 1
    assert (message.usage.cache_creation_input_tokens, message.usage.cache_read_input_tokens) == (0, 0)


def test_fake_anthropic__empty_script_gives_default_end_turn(client: anthropic.Anthropic) -> None:
    message = create(client)

    assert message.stop_reason == "end_turn" and isinstance(visible(message)[0], TextBlock)


def test_fake_anthropic__tool_use_reply_parses_as_tool_use_block(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.enqueue(Reply.tool_use("search", {"q": "otters", "limit": 3}, text="Let me look."))

    message = create(client)

    assert message.stop_reason == "tool_use"
    text, call = visible(message)
    assert isinstance(text, TextBlock) and text.text == "Let me look."
    assert isinstance(call, ToolUseBlock), f"expected a ToolUseBlock, got {call!r}"
    assert call.id.startswith("toolu_") and call.name == "search" and call.input == {"q": "otters", "limit": 3}


def test_fake_anthropic__streaming_reassembles_the_same_message(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    long_text = "The quick brown fox jumps over the lazy dog, twice over. " * 3
    fake.enqueue(
        Reply(content=[text_block(long_text), tool_use_block("lookup", {"id": 7, "tags": ["a", "b"]}, id="toolu_x")])
    )

    with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
        event_types = [event.type for event in stream]
        final = stream.get_final_message()

    assert event_types[0] == "message_start" and event_types[-1] == "message_stop"
    for expected in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert expected in event_types, f"stream is missing {expected}: {event_types}"
    thinking, text, call = final.content
    assert isinstance(thinking, ThinkingBlock) and thinking.signature, "signature_delta did not reassemble"
    assert isinstance(text, TextBlock) and text.text == long_text, "text deltas did not reassemble"
    assert isinstance(call, ToolUseBlock), f"expected a ToolUseBlock, got {call!r}"
    assert (call.id, call.name, call.input) == ("toolu_x", "lookup", {"id": 7, "tags": ["a", "b"]})
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 1


@pytest.mark.parametrize("stop_reason", sorted(STOP_REASONS))
def test_fake_anthropic__every_stop_reason_round_trips(
    fake: FakeAnthropic, client: anthropic.Anthropic, stop_reason: Any
) -> None:
    stop_sequence = "###" if stop_reason == "stop_sequence" else None
    fake.enqueue(Reply.text("partial", stop_reason=stop_reason, stop_sequence=stop_sequence))
    fake.enqueue(Reply.text("partial", stop_reason=stop_reason, stop_sequence=stop_sequence))

    message = create(client)
    with client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()

    assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)
    assert (streamed.stop_reason, streamed.stop_sequence) == (stop_reason, stop_sequence)


def test_fake_anthropic__unknown_stop_reason_is_refused() -> None:
    with pytest.raises(ValueError, match="stop_reason"):
        Reply.text("x", stop_reason="bored")  # type: ignore[arg-type]


def test_fake_anthropic__429_is_rate_limit_error_with_retry_after(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.enqueue(Fault.status(429, headers={"retry-after": "2"}))

    with pytest.raises(anthropic.RateLimitError) as caught:
        create(client)

    assert caught.value.response.headers["retry-after"] == "2"
    assert caught.value.type == "rate_limit_error"
    assert caught.value.request_id and caught.value.request_id.startswith("req_")


def test_fake_anthropic__529_is_overloaded(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Fault.status(529))

    with pytest.raises(anthropic.APIStatusError) as caught:
        create(client)

    # SDK 2.x maps 529 to OverloadedError, a subclass of InternalServerError.
    assert isinstance(caught.value, anthropic.InternalServerError)
    assert (caught.value.status_code, caught.value.type) == (529, "overloaded_error")


@pytest.mark.parametrize(
    ("status", "error_class", "error_type"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (401, anthropic.AuthenticationError, "authentication_error"),
        (403, anthropic.PermissionDeniedError, "permission_error"),
        (404, anthropic.NotFoundError, "not_found_error"),
        (413, anthropic.APIStatusError, "request_too_large"),
        (500, anthropic.InternalServerError, "api_error"),
    ],
)
def test_fake_anthropic__status_faults_map_to_sdk_errors(
    fake: FakeAnthropic, client: anthropic.Anthropic, status: int, error_class: type[Exception], error_type: str
) -> None:
    fake.enqueue(Fault.status(status, "scripted failure"))

    with pytest.raises(error_class) as caught:
        create(client)

    assert isinstance(caught.value, anthropic.APIStatusError) and caught.value.status_code == status
    assert caught.value.body["error"] == {"type": error_type, "message": "scripted failure"}  # type: ignore[index]


def test_fake_anthropic__delay_past_timeout_is_api_timeout_error(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.enqueue(Fault.delay(1.5))

    with pytest.raises(anthropic.APITimeoutError):
        create(client, timeout=0.3)


def test_fake_anthropic__reset_is_api_connection_error(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Fault.reset(), Reply.text("after the reset"))

    with pytest.raises(anthropic.APIConnectionError) as caught:
        create(client)

    assert not isinstance(caught.value, anthropic.APITimeoutError), "a reset must fail fast, not time out"
    assert visible(create(client))[0].text == "after the reset", "the server must keep serving after a reset"  # type: ignore[union-attr]


def test_fake_anthropic__stream_error_raises_while_iterating(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Fault.stream_error(partial_text="half an ans"))
    seen: list[str] = []

    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream,  # type: ignore[arg-type]
    ):
        seen.extend(event.type for event in stream)

    assert seen[0] == "message_start" and "content_block_delta" in seen, f"partial stream not delivered: {seen}"
    assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


def test_fake_anthropic__stream_error_on_plain_request_is_529(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Fault.stream_error())

    with pytest.raises(anthropic.InternalServerError) as caught:
        create(client)

    assert caught.value.status_code == 529


def test_fake_anthropic__mid_stream_reset_raises_while_iterating(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.enqueue(Fault.reset(mid_stream=True))

    seen: list[str] = []

    # SDK 2.14 surfaces a body cut mid-stream as the transport's own error, not as an APIConnectionError.
    with (
        pytest.raises((anthropic.APIConnectionError, httpx2.TransportError)),
        client.messages.stream(model=MODEL, max_tokens=64, messages=HELLO) as stream,  # type: ignore[arg-type]
    ):
        seen.extend(event.type for event in stream)

    assert seen[0] == "message_start", f"the stream should have started before the reset: {seen}"


def test_fake_anthropic__request_log_counts_turns_and_redacts_key(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    conversation = [
        {"role": "user", "content": "find otters"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 otters"}]},
    ]

    # A conversation with tool blocks must define its tools:
    # https://platform.claude.com/docs/en/agents-and-tools/tool-use/implement-tool-use
    search = [{"name": "search", "description": "Search.", "input_schema": {"type": "object"}}]
    create(client, conversation[:1], tools=search)
    create(client, conversation, tools=search)
    create(client, conversation, tools=search)

    first = fake.requests[0]
    assert first.conversation.startswith("conv_") and first.turn == 0 and first.attempt == 1
    assert fake.count(first.conversation, 0) == 1
    assert fake.count(first.conversation, 1) == 2, "the same turn asked twice must count 2"
    assert [r.attempt for r in fake.requests_for(first.conversation)] == [1, 1, 2]
    assert fake.requests[2].tool_results[0]["content"] == "3 otters"
    for request in fake.requests:
        # SDK 2.x sends the API key as `authorization: Bearer ...`; older ones as `x-api-key`.
        assert request.headers["authorization"] == "[redacted]"
        assert "test-key" not in repr(request), "the API key leaked into the request log"
        assert request.retry_count == 0 and request.method == "POST" and request.path == "/v1/messages"


def test_fake_anthropic__conversation_from_metadata_or_header(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    create(client, metadata={"user_id": "run-42"})
    create(client, extra_headers={"x-durable-conversation": "run-43"})

    assert [r.conversation for r in fake.requests] == ["run-42", "run-43"]
    assert fake.count("run-42", 0) == 1


def test_fake_anthropic__responder_answers_per_conversation(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    def respond(request: RecordedRequest) -> Reply:
        if request.tool_results:
            return Reply.text(f"found {request.tool_results[0]['content']}")
        return Reply.tool_use("search", {"q": request.last_user_text})

    fake.responder = respond
    fake.enqueue(Reply.text("queued first"))

    assert visible(create(client))[0].text == "queued first", "the queue must win over the responder"  # type: ignore[union-attr]
    call = visible(create(client))[0]
    assert isinstance(call, ToolUseBlock) and call.input == {"q": "hello"}
    answer = create(
        client,
        [
            *HELLO,
            {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "2 otters"}]},
        ],
        tools=[{"name": "search", "description": "Search.", "input_schema": {"type": "object"}}],
    )
    assert visible(answer)[0].text == "found 2 otters"  # type: ignore[union-attr]


def test_fake_anthropic__responder_exception_is_a_500_and_recorded(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    def broken(request: RecordedRequest) -> Reply:
        raise KeyError("oops")

    fake.responder = broken

    with pytest.raises(anthropic.InternalServerError):
        create(client)

    assert isinstance(fake.errors[0], KeyError)


def test_fake_anthropic__prompt_cache_creation_then_read(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "You are a careful agent. " * 40, "cache_control": {"type": "ephemeral"}}]

    first = create(client, system=system).usage
    second = create(client, system=system).usage

    assert first.cache_creation_input_tokens and first.cache_creation_input_tokens > 0
    assert first.cache_read_input_tokens == 0
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens, "an identical prefix must be read"
    assert second.cache_creation_input_tokens == 0
    total = [
        u.input_tokens + (u.cache_creation_input_tokens or 0) + (u.cache_read_input_tokens or 0)
        for u in (first, second)
    ]
    assert total[0] == total[1], "prompt size must not depend on caching"
    count = client.messages.count_tokens(model=MODEL, messages=HELLO, system=system)  # type: ignore[arg-type]
    assert count.input_tokens == total[0]


def test_fake_anthropic__prompt_cache_reads_earlier_prefix_when_breakpoint_moves(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    turn_one = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a long task " * 50, "cache_control": {"type": "ephemeral"}}],
        }
    ]
    turn_two = [
        {"role": "user", "content": [{"type": "text", "text": "a long task " * 50}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]},
    ]

    first = create(client, turn_one).usage
    second = create(client, turn_two).usage

    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens and second.cache_creation_input_tokens > 0
    assert fake.requests[0].conversation == fake.requests[1].conversation, (
        "moving a breakpoint changed the conversation"
    )


def test_fake_anthropic__prompt_cache_expires_after_five_minutes(client: anthropic.Anthropic) -> None:
    now = [1000.0]
    system = [{"type": "text", "text": "policy " * 100, "cache_control": {"type": "ephemeral"}}]
    with FakeAnthropic(clock=lambda: now[0]) as fake:
        local = fake.client(max_retries=0)
        create(local, system=system)
        now[0] += 301
        late = create(local, system=system).usage

    assert late.cache_read_input_tokens == 0 and late.cache_creation_input_tokens, "a 5-minute entry outlived its TTL"


def test_fake_anthropic__prompt_cache_ignores_short_prefixes() -> None:
    system = [{"type": "text", "text": "short", "cache_control": {"type": "ephemeral"}}]
    with FakeAnthropic(min_cache_tokens=1024) as fake:
        usage = create(fake.client(max_retries=0), system=system).usage

    assert (usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == (0, 0)


def test_fake_anthropic__sdk_retries_through_529(fake: FakeAnthropic) -> None:
    retrying = anthropic.Anthropic(api_key="test-key", base_url=fake.url, max_retries=2)
    fake.enqueue(Fault.status(529, headers={"retry-after-ms": "10"}), Reply.text("made it"))

    message = create(retrying)

    assert visible(message)[0].text == "made it"  # type: ignore[union-attr]
    attempts = fake.requests
    assert [(r.attempt, r.retry_count) for r in attempts] == [(1, 0), (2, 1)]
    assert fake.count(attempts[0].conversation, 0) == 2 and fake.pending == 0


def test_fake_anthropic__fail_next_goes_ahead_of_the_queue(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Reply.text("eventually"))
    fake.fail_next(2, Fault.status(500))

    for _ in range(2):
        with pytest.raises(anthropic.InternalServerError):
            create(client)
    assert visible(create(client))[0].text == "eventually"  # type: ignore[union-attr]


def test_fake_anthropic__missing_api_key_is_401_and_unknown_path_is_404(fake: FakeAnthropic) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": HELLO}

    status, error = post_raw(fake, "/v1/messages", body, {})
    assert (status, error["error"]["type"]) == (401, "authentication_error")
    status, _message = post_raw(fake, "/v1/messages", body, {"x-api-key": "sk-secret"})
    assert status == 200, "a bare x-api-key (what SDK 0.x sends) must be accepted"
    status, error = post_raw(fake, "/v1/nope", body, {"x-api-key": "k"})
    assert (status, error["error"]["type"]) == (404, "not_found_error")
    status, error = post_raw(fake, "/v1/messages", {"model": MODEL}, {"x-api-key": "k"})
    assert (status, error["error"]["type"]) == (400, "invalid_request_error")
    assert all(r.headers.get("x-api-key") in (None, "[redacted]") for r in fake.requests)
    assert "sk-secret" not in repr(fake.requests), "the API key leaked into the request log"


def test_fake_anthropic__concurrent_clients_each_get_one_queued_reply(fake: FakeAnthropic) -> None:
    fake.enqueue(*(Reply.text(f"reply {i}") for i in range(40)))

    def ask(worker: int) -> list[str]:
        local = fake.client(max_retries=0)
        messages = [{"role": "user", "content": f"worker {worker}"}]
        return [visible(create(local, messages))[0].text for _ in range(5)]  # type: ignore[union-attr]

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = [text for batch in pool.map(ask, range(8)) for text in batch]

    assert sorted(answers) == sorted(f"reply {i}" for i in range(40)), "a queued reply was served twice or lost"
    assert len(fake.requests) == 40 and fake.pending == 0
    assert {fake.count(r.conversation, 0) for r in fake.requests} == {5}


def test_fake_anthropic__env_var_base_url(fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in fake.environ().items():
        monkeypatch.setenv(name, value)
    fake.enqueue(Reply.text("via env"))

    assert visible(create(anthropic.Anthropic(max_retries=0)))[0].text == "via env"  # type: ignore[union-attr]


def test_fake_anthropic__reset_clears_queue_log_and_cache(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "rules " * 50, "cache_control": {"type": "ephemeral"}}]
    create(client, system=system)
    fake.enqueue(Reply.text("stale"))

    fake.reset()

    assert fake.requests == [] and fake.pending == 0
    usage = create(client, system=system).usage
    assert usage.cache_read_input_tokens == 0, "reset() must forget the prompt cache"
