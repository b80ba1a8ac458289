"""Fidelity checks of the strict stand-in of the Messages API (durable_agents.testing.fake_anthropic) and on the
error mapping of durable_agents.agents.claude, through the real SDK over real HTTP.

Two kinds of tests live here:

* unmarked: a documented rule the fake (or the mapping) already keeps; they guard it;
* ``test_hole__*``: a request the docs say the real API refuses that the fake once accepted (or a shape or error
  class the code once got wrong), found by an attack and fixed since. Each names the rule and the page.

Each test cites the documentation page of its rule.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import Message

from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.messages import ModelRequest
from durable_agents.errors import ContextWindowExceededError, ModelRequestError, ModelUnavailableError, StepError
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, Reply

HELLO = [{"role": "user", "content": "hello"}]
TOOLS = [
    {
        "name": "search",
        "description": "Search the web",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
    }
]
API_KEY = "sk-ant-test-secret-fidelity-0123456789"


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeAnthropic]:
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def client(fake: FakeAnthropic) -> anthropic.Anthropic:
    return fake.client(api_key=API_KEY, max_retries=0, timeout=20.0)


def ask(client: anthropic.Anthropic, **kwargs: Any) -> Message:
    kwargs.setdefault("model", "claude-opus-5-5")
    kwargs.setdefault("max_tokens", 64)
    kwargs.setdefault("messages", HELLO)
    return client.messages.create(**kwargs)


def refused(client: anthropic.Anthropic, **kwargs: Any) -> str:
    """The 400 message of a request the API refuses (fails the test if the fake accepts it)."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, **kwargs)
    return caught.value.body["error"]["message"]  # type: ignore[index]


def tool_round(client: anthropic.Anthropic, **kwargs: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One served assistant turn that calls `search` (after a thinking block when the request thinks):
    (its content blocks as sent back, its tool_use block)."""
    message = ask(client, messages=HELLO, tools=TOOLS, **kwargs)
    blocks = [b.model_dump(mode="json", exclude_none=True) for b in message.content]
    return blocks, next(b for b in blocks if b["type"] == "tool_use")


def answered(content: list[dict[str, Any]], tool_use: dict[str, Any], *extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        HELLO[0],
        {"role": "assistant", "content": content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": "r"}, *extra]},
    ]


HAIKU_THINKING = {
    "model": "claude-haiku-4-5",
    "max_tokens": 4000,
    "thinking": {"type": "enabled", "budget_tokens": 2000},
}


# ======================================================================================================================
# Part 1: requests the real API refuses. First the rules that held.
# ======================================================================================================================


def test_held__tool_result_must_come_first_in_its_message(client, fake):
    # https://platform.claude.com/docs/en/agents-and-tools/tool-use/handle-tool-calls : tool_result blocks FIRST.
    fake.enqueue(Reply.tool_use("search", {"q": "x"}))
    content, call = tool_round(client, model="claude-haiku-4-5")
    messages = answered(content, call)
    messages[2]["content"].insert(0, {"type": "text", "text": "here you go"})
    assert "must come first" in refused(client, model="claude-haiku-4-5", tools=TOOLS, messages=messages)


@pytest.mark.parametrize("model", ["claude-opus-5-5", "claude-opus-5"], ids=["prefix-checked", "no-prefix-check"])
def test_held__a_modified_thinking_block_in_the_latest_assistant_turn_is_refused(client, fake, model):
    # https://platform.claude.com/docs/en/build-with-claude/thinking-troubleshooting : "`thinking` or
    # `redacted_thinking` blocks in the latest assistant message cannot be modified"; the preserved-thinking page:
    # a tampered signature is always 400 "Invalid `signature` in `thinking` block".
    fake.enqueue(Reply.thinking("plan the search", Reply.tool_use("search", {"q": "x"})))
    content, call = tool_round(client, model=model)
    assert content[0]["type"] == "thinking"
    content[0]["thinking"] = "plan the search, edited"
    assert "Invalid `signature`" in refused(client, model=model, tools=TOOLS, messages=answered(content, call))


def test_held__an_altered_redacted_thinking_block_is_refused(client, fake):
    # https://platform.claude.com/docs/en/build-with-claude/preserved-thinking : redacted_thinking is opaque, passed
    # back unchanged, subject to the same checks.
    from durable_agents.testing.fake_anthropic import redacted_thinking_block, tool_use_block

    fake.enqueue(
        Reply(content=[redacted_thinking_block(), tool_use_block("search", {"q": "x"})], stop_reason="tool_use")
    )
    content, call = tool_round(client)
    assert content[0]["type"] == "redacted_thinking"
    content[0]["data"] = content[0]["data"][:-4] + "AAAA"
    assert "Invalid `signature`" in refused(client, tools=TOOLS, messages=answered(content, call))


def test_held__cache_control_on_a_thinking_block_is_refused(client, fake):
    # https://platform.claude.com/docs/en/build-with-claude/prompt-caching : thinking blocks "cannot be cached
    # directly with cache_control".
    fake.enqueue(Reply.thinking("plan", Reply.tool_use("search", {"q": "x"})))
    content, call = tool_round(client)
    content[0]["cache_control"] = {"type": "ephemeral"}
    assert "cannot be cached" in refused(client, tools=TOOLS, messages=answered(content, call))


@pytest.mark.parametrize(("model", "limit"), [("claude-haiku-4-5", 64_000), ("claude-sonnet-4-6", 64_000)])
def test_held__max_tokens_over_the_models_limit_is_refused(client, model, limit):
    # https://platform.claude.com/docs/en/api/messages : "Different models have different maximum values".
    message = refused(client, model=model, max_tokens=limit + 1, thinking={"type": "disabled"})
    assert f"{limit + 1} > {limit}" in message


@pytest.mark.parametrize("effort", ["xhigh", "max"])
def test_held__between_tools_at_xhigh_or_max_is_refused(client, effort):
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide : between_tools at xhigh/max → 400.
    refused(client, model="claude-sonnet-5-5", thinking={"type": "between_tools"}, output_config={"effort": effort})


@pytest.mark.parametrize(("name", "value"), [("temperature", 0.3), ("top_p", 0.9), ("top_k", 5)])
def test_held__sampling_parameters_on_sonnet_5_5_are_refused(client, name, value):
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide : non-default sampling → 400.
    assert "deprecated" in refused(client, model="claude-sonnet-5-5", extra_body={name: value})


def test_held__forced_tool_choice_on_count_tokens_is_refused(client):
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide : forced tool choice refused, and on
    # count_tokens too.
    with pytest.raises(anthropic.BadRequestError, match='"tool" and "any" are not supported'):
        client.messages.count_tokens(
            model="claude-sonnet-5-5", messages=HELLO, tools=TOOLS, tool_choice={"type": "tool", "name": "search"}
        )


def test_held__effort_on_haiku_4_5_is_refused(client):
    # https://platform.claude.com/docs/en/models/opus-5/overview (model table: Haiku 4.5 "Default effort: —").
    refused(client, model="claude-haiku-4-5", output_config={"effort": "low"})


def test_held__thinking_blocks_another_model_cannot_read_are_dropped_silently(client, fake):
    # https://platform.claude.com/docs/en/build-with-claude/preserved-thinking : model check drops the block
    # "without an error"; Sonnet 5.5 cannot read Opus 5.5 blocks (sonnet-5-5 migration guide).
    fake.enqueue(Reply.thinking("plan", Reply.tool_use("search", {"q": "x"})))
    content, call = tool_round(client, model="claude-opus-5-5")
    ask(client, model="claude-sonnet-5-5", tools=TOOLS, messages=answered(content, call))
    assert [n.reason for n in fake.dropped_thinking] == ["model_binding_mismatch"]


def test_held__a_signature_from_another_fake_is_a_forgery(client, fake):
    # https://platform.claude.com/docs/en/build-with-claude/preserved-thinking : undecryptable signature → 400.
    with FakeAnthropic() as other:
        other.enqueue(Reply.thinking("plan", Reply.tool_use("search", {"q": "x"})))
        content, call = tool_round(other.client(max_retries=0))
    assert "Invalid `signature`" in refused(client, tools=TOOLS, messages=answered(content, call))


def test_held__a_change_in_system_alone_breaks_the_prefix(client, fake):
    # https://platform.claude.com/docs/en/build-with-claude/preserved-thinking/prefix-checks : system is part of the
    # prefix; the 400 names what changed.
    fake.enqueue(Reply.thinking("plan", Reply.tool_use("search", {"q": "x"})))
    content, call = tool_round(client, system="You are careful.")
    message = refused(client, tools=TOOLS, system="You are careful!", messages=answered(content, call))
    assert "bound to a different conversation" in message and "`system`" in message


def test_held__cache_ttl_2h_is_refused(client):
    # https://platform.claude.com/docs/en/build-with-claude/prompt-caching : ttl "5m" | "1h".
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}
    refused(client, messages=[{"role": "user", "content": [block]}])


def test_held__a_fifth_breakpoint_across_tools_system_and_messages_is_refused(client):
    # https://platform.claude.com/docs/en/build-with-claude/prompt-caching : at most 4 breakpoints.
    mark = {"cache_control": {"type": "ephemeral"}}
    message = refused(
        client,
        tools=[{**TOOLS[0], **mark}],
        system=[{"type": "text", "text": "a", **mark}, {"type": "text", "text": "b", **mark}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "x", **mark}]}],
        extra_body={"cache_control": {"type": "ephemeral"}},  # the automatic one takes a slot too
    )
    assert "Found 5" in message


def test_held__consecutive_user_messages_are_refused_by_default(client):
    # https://platform.claude.com/docs/en/api/messages says they are combined; the fake refuses on purpose.
    refused(client, messages=[*HELLO, {"role": "user", "content": "again"}])


def test_held__an_empty_assistant_content_list_mid_conversation_is_refused(client):
    # Observed 400 "all messages must have non-empty content except for the optional final assistant message".
    refused(
        client,
        model="claude-haiku-4-5",
        messages=[*HELLO, {"role": "assistant", "content": []}, {"role": "user", "content": "x"}],
    )


# ----------------------------------------------------------------------------------------------------------------------
# Holes the attack found, now closed: the fake used to accept these (each was an xfail until its rule was added).
# ----------------------------------------------------------------------------------------------------------------------


def test_held__a_prompt_longer_than_the_context_window_is_refused(client):
    # https://platform.claude.com/docs/en/build-with-claude/context-windows : an input over the window is a 400
    # "prompt is too long: N tokens > 200000 maximum" (observed). Haiku 4.5's window is 200K; ~250K tokens here by
    # the fake's own 4-characters-a-token estimate.
    message = refused(client, model="claude-haiku-4-5", messages=[{"role": "user", "content": "word " * 200_000}])
    assert message.startswith("prompt is too long: ") and message.endswith(" tokens > 200000 maximum"), message


@pytest.mark.parametrize("how", ["dropped", "moved after tool_use"])
def test_held__extended_thinking_tool_loop_must_send_back_the_thinking_block_first(client, fake, how):
    # https://platform.claude.com/docs/en/build-with-claude/extended-thinking : "During tool use, you must pass
    # thinking blocks back to the API for the last assistant message. Include the complete unmodified block"; the
    # API's 400: "Expected `thinking` or `redacted_thinking`, but found `tool_use`. When `thinking` is enabled, a
    # final `assistant` message must start with a thinking block". Haiku 4.5 (enabled thinking, no prefix check).
    fake.enqueue(Reply.thinking("plan", Reply.tool_use("search", {"q": "x"})))
    content, call = tool_round(client, **HAIKU_THINKING)
    thinking = content[0]
    assert thinking["type"] == "thinking"
    sent = [call] if how == "dropped" else [call, thinking]
    message = refused(client, tools=TOOLS, messages=answered(sent, call), **HAIKU_THINKING)
    assert "Expected `thinking` or `redacted_thinking`, but found `tool_use`" in message


@pytest.mark.parametrize(
    ("model", "extra"),
    [
        ("claude-haiku-4-5", {"temperature": 0.5}),
        ("claude-sonnet-4-6", {"top_k": 5}),
        ("claude-sonnet-4-6", {"top_p": 0.5}),
    ],
)
def test_held__sampling_parameters_while_thinking_are_refused(client, model, extra):
    # https://platform.claude.com/docs/en/build-with-claude/extended-thinking (feature compatibility): thinking
    # "isn't compatible with temperature or top_k modifications"; top_p only between 0.95 and 1 while thinking.
    refused(client, model=model, max_tokens=4000, thinking={"type": "enabled", "budget_tokens": 2000}, extra_body=extra)


def test_held__tool_use_history_without_a_tools_list_is_refused(client):
    # Observed 400 "Requests which include `tool_use` or `tool_result` blocks must define tools." (the API reference
    # https://platform.claude.com/docs/en/api/messages documents the blocks only alongside `tools`; wording is 3P).
    messages = [
        HELLO[0],
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]},
    ]
    assert refused(client, model="claude-haiku-4-5", messages=messages) == (
        "Requests which include `tool_use` or `tool_result` blocks must define tools."
    )


def test_held__a_1h_breakpoint_after_a_5m_one_is_refused(client):
    # https://platform.claude.com/docs/en/build-with-claude/prompt-caching (mixing TTLs): entries with the longer TTL
    # must come before shorter ones (tools → system → messages order).
    message = refused(
        client,
        system=[{"type": "text", "text": "a" * 40, "cache_control": {"type": "ephemeral", "ttl": "5m"}}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            }
        ],
    )
    assert message.startswith("messages.0.content.0.cache_control.ttl: a ttl='1h' cache_control block must not come")


def test_held__text_after_the_results_of_a_deferred_server_tool_is_refused(client):
    # https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons and
    # https://platform.claude.com/docs/en/agents-and-tools/tool-use/server-tools : a server_tool_use with no result
    # beside a client tool_use runs when the tool_result comes back; that user message must hold ONLY tool_result
    # blocks, else 400 "`web_search` tool use with id `srvtoolu_…` was found without a corresponding
    # `web_search_tool_result` block".
    assistant = [
        {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {"query": "otters"}},
        {"type": "tool_use", "id": "toolu_01", "name": "search", "input": {"q": "otters"}},
    ]
    messages = [
        HELLO[0],
        {"role": "assistant", "content": assistant},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "r"},
                {"type": "text", "text": "and also look at beavers"},
            ],
        },
    ]
    tools = [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}]
    message = refused(client, model="claude-haiku-4-5", tools=tools, messages=messages)
    assert "`web_search` tool use with id `srvtoolu_01` was found without a corresponding `web_search_tool_result`" in (
        message
    )


@pytest.mark.parametrize(
    ("model", "tool"),
    [
        (
            "claude-opus-5-5",
            {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768},
        ),
        (
            "claude-sonnet-5-5",
            {"type": "computer_20251124", "name": "computer", "display_width_px": 1024, "display_height_px": 768},
        ),
        ("claude-opus-5-5", {"type": "bogus_tool_20990101", "name": "bogus"}),
    ],
    ids=["computer_20250124-everywhere", "computer_20251124-on-sonnet-5-5", "unknown-type"],
)
def test_held__tool_types_the_model_does_not_take_are_refused(client, model, tool):
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide : computer_20251124 with Sonnet 5.5 /
    # Opus 5.5 on the Claude API → 400; computer_20250124 → 400 everywhere. An unknown tool `type` fails the
    # request schema (https://platform.claude.com/docs/en/api/messages lists the tool union).
    refused(client, model=model, tools=[tool])


@pytest.mark.parametrize("path", ["messages", "count_tokens"])
def test_held__unknown_top_level_fields_are_refused(client, path):
    # The API's request schema refuses extra inputs ("... Extra inputs are not permitted", as quoted for
    # block_binding on https://platform.claude.com/docs/en/build-with-claude/preserved-thinking); count_tokens takes
    # no generation parameters (https://platform.claude.com/docs/en/build-with-claude/token-counting).
    if path == "messages":
        assert "Extra inputs are not permitted" in refused(client, extra_body={"temprature": 0.5})
    else:
        with pytest.raises(anthropic.BadRequestError, match="Extra inputs"):
            client.messages.count_tokens(model="claude-opus-5-5", messages=HELLO, extra_body={"max_tokens": 64})


@pytest.mark.parametrize(
    "system",
    [[{"type": "text", "text": ""}], [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]],
    ids=["empty-text", "non-text-block"],
)
def test_held__system_blocks_are_validated_like_message_blocks(client, system):
    # https://platform.claude.com/docs/en/api/messages : `system` is a string or a list of text blocks; empty text
    # blocks are refused in messages (observed "text content blocks must be non-empty"), the fake refuses those.
    assert refused(client, system=system).startswith("system")


def test_held__a_malformed_system_is_a_400_not_a_dropped_connection(client):
    # Any malformed body is a 400 invalid_request_error (https://platform.claude.com/docs/en/api/errors); the fake's
    # PromptCache.usage used to iterate `system` unchecked, and the handler thread died (fake_cache.blocks).
    assert refused(client, extra_body={"system": 123}).startswith("system: ")


@pytest.mark.parametrize("case", ["additionalProperties-missing", "strict-tool-additionalProperties", "prefill"])
def test_held__structured_output_rules_are_enforced(client, case):
    # https://platform.claude.com/docs/en/build-with-claude/structured-outputs and .../tool-use/strict-tool-use :
    # `additionalProperties: false` on every object; JSON outputs are incompatible with prefill.
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    if case == "additionalProperties-missing":
        refused(client, output_config={"format": {"type": "json_schema", "schema": schema}})
    elif case == "strict-tool-additionalProperties":
        refused(client, tools=[{**TOOLS[0], "strict": True}])
    else:
        closed = {**schema, "additionalProperties": False}
        refused(
            client,
            model="claude-haiku-4-5",
            messages=[*HELLO, {"role": "assistant", "content": "{"}],
            output_config={"format": {"type": "json_schema", "schema": closed}},
        )


CLOSED = {
    "type": "object",
    "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {}, "additionalProperties": False}}
    },
    "additionalProperties": False,
}
COMPUTER = {"name": "computer", "display_width_px": 1024, "display_height_px": 768}


@pytest.mark.parametrize(
    "kwargs",
    [
        {
            "system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}
            ],
        },
        {
            "model": "claude-sonnet-4-6",
            "max_tokens": 4000,
            "thinking": {"type": "enabled", "budget_tokens": 2000},
            "extra_body": {"top_p": 0.95, "temperature": 1},
        },
        {"output_config": {"format": {"type": "json_schema", "schema": CLOSED}}},
        {"tools": [{**TOOLS[0], "input_schema": CLOSED, "strict": True}]},
        {"model": "claude-sonnet-5-5", "tools": [{"type": "computer_toolset_20260801", "name": "computer"}]},
        {"model": "claude-opus-5", "tools": [{"type": "computer_20251124", **COMPUTER}]},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"stop_sequences": ["END"], "metadata": {"user_id": "u"}, "service_tier": "auto", "speed": "standard"},
        {"system": [{"type": "text", "text": "You are careful."}], "extra_body": {"stream": False}},
    ],
    ids=[
        "1h-then-5m",
        "top_p-0.95-while-thinking",
        "closed-format-schema",
        "closed-strict-tool",
        "computer-toolset-on-sonnet-5-5",
        "computer_20251124-on-opus-5",
        "web-search",
        "sdk-generation-fields",
        "text-system-blocks",
    ],
)
def test_held__the_nearest_good_requests_still_pass(client, kwargs):
    # Each closed hole's rule stops at the documented line: the request just on the good side of it is served.
    assert ask(client, **kwargs).type == "message"


def test_held__the_nearest_good_tool_loops_still_pass(client, fake):
    # extended-thinking: the latest assistant turn sent back whole, thinking block first, is served; a deferred
    # server tool's results-only message is served (handling-stop-reasons); count_tokens takes its SDK fields.
    fake.enqueue(Reply.thinking("plan", Reply.tool_use("search", {"q": "x"})))
    content, call = tool_round(client, **HAIKU_THINKING)
    assert ask(client, tools=TOOLS, messages=answered(content, call), **HAIKU_THINKING).type == "message"
    deferred = [
        {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {"query": "otters"}},
        {"type": "tool_use", "id": "toolu_01", "name": "search", "input": {"q": "otters"}},
    ]
    tools = [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}]
    messages = [
        HELLO[0],
        {"role": "assistant", "content": deferred},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "r"}]},
    ]
    assert ask(client, model="claude-haiku-4-5", tools=tools, messages=messages).type == "message"
    counted = client.messages.count_tokens(
        model="claude-opus-5-5",
        messages=HELLO,
        system="s",
        tools=TOOLS,
        tool_choice={"type": "auto"},
        thinking={"type": "adaptive"},
        output_config={"effort": "low"},
        cache_control={"type": "ephemeral"},
        speed="standard",
    )
    assert counted.input_tokens > 0


def test_held__no_malformed_body_drops_the_connection(fake):
    # https://platform.claude.com/docs/en/api/errors : a malformed body is a 400 invalid_request_error. Every field
    # of a request the fake serves is swapped, one to three at a time, for JSON values of the wrong shape (seeded,
    # so a failure replays): each answer must be a JSON 200/400/404, never a dropped connection or a 500.
    import json
    import random
    import urllib.error
    import urllib.request

    base = {
        "model": "claude-haiku-4-5",
        "max_tokens": 4000,
        "system": [{"type": "text", "text": "be careful", "cache_control": {"type": "ephemeral"}}],
        "tools": [{**TOOLS[0], "strict": False}],
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "u"},
        "stop_sequences": ["END"],
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}]},
        ],
    }
    values = [None, 0, -5, 1.5, True, "", "x", [], [1], [None], {}, {"type": "text"}, {"a": [{"b": None}]}, [[[]]]]

    def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
        if prefix:
            yield prefix
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, child in items:
            yield from paths(child, (*prefix, key))

    def post(path: str, body: Any) -> tuple[int, bytes]:
        headers = {"content-type": "application/json", "x-api-key": "k"}
        request = urllib.request.Request(fake.url + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    assert post("/v1/messages", base)[0] == 200, "the base request must be one the fake serves"
    rng = random.Random(20261201)
    statuses = set()
    for _ in range(300):
        body = copy.deepcopy(base)
        for _ in range(rng.choice([1, 1, 2, 3])):
            where = rng.choice(list(paths(body)))
            parent = body
            for key in where[:-1]:
                parent = parent[key]
            parent[where[-1]] = copy.deepcopy(rng.choice(values))
        path = rng.choice(["/v1/messages", "/v1/messages/count_tokens"])
        if path.endswith("count_tokens"):
            for name in ("max_tokens", "metadata", "stop_sequences"):
                body.pop(name, None)
        status, raw = post(path, body)
        assert status in (200, 400, 404), f"{status} for {json.dumps(body)}: {raw[:300]!r}"
        assert json.loads(raw), f"an empty answer for {json.dumps(body)}"
        statuses.add(status)
    assert statuses >= {200, 400}, "the mutations must reach both the rules and the serving path"
    assert not fake.errors


# ======================================================================================================================
# Part 2: claude.py's error classes.
# ======================================================================================================================


def request(model: str = "claude-sonnet-5-5") -> ModelRequest:
    return ModelRequest(model=model, max_tokens=64, system="", tools=(), messages=({"role": "user", "content": "hi"},))


@pytest.fixture
def claude(fake) -> AnthropicParticipant:
    return AnthropicParticipant(client=fake.client(api_key=API_KEY, max_retries=0, timeout=5.0))


def raised_by(claude: AnthropicParticipant, model: str = "claude-sonnet-5-5") -> StepError:
    with pytest.raises(StepError) as caught:
        claude.respond(request(model))
    return caught.value


def test_held__529_without_x_should_retry_is_transient(fake, claude):
    # https://platform.claude.com/docs/en/api/errors : 529 overloaded_error, "temporarily overloaded".
    fake.enqueue(Fault.status(529))
    assert type(raised_by(claude)) is ModelUnavailableError


@pytest.mark.parametrize("status", [413, 402])
def test_held__413_and_402_are_permanent(fake, claude, status):
    # https://platform.claude.com/docs/en/api/errors : 413 request_too_large, 402 billing_error.
    fake.enqueue(Fault.too_large() if status == 413 else Fault.status(402))
    error = raised_by(claude)
    assert isinstance(error, ModelRequestError) and error.status == status


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_held__an_overloaded_error_event_inside_a_200_stream_is_transient(fake, stream):
    # https://platform.claude.com/docs/en/api/errors : "errors after a 200 arrive as SSE `error` events".
    fake.enqueue(Fault.stream_error("overloaded_error", "Overloaded", partial_text="Half an ans"))
    participant = AnthropicParticipant(client=fake.client(api_key=API_KEY, max_retries=0, timeout=5.0), stream=stream)
    with pytest.raises(ModelUnavailableError):
        participant.respond(request())


def test_held__the_spend_cap_429_with_its_error_code_is_permanent(fake, claude):
    # https://platform.claude.com/docs/en/api/errors : error_code enforced_spend_limit_reached, no retry-after.
    fake.enqueue(Fault.spend_limit())
    error = raised_by(claude)
    assert isinstance(error, ModelRequestError) and "monthly spend limit" in str(error)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_held__a_retired_model_is_permanent_and_named(fake, claude):
    # https://platform.claude.com/docs/en/about-claude/model-deprecations : requests to retired models fail (404).
    error = raised_by(claude, model="claude-sonnet-4-20250514")
    assert isinstance(error, ModelRequestError) and error.status == 404
    assert "claude-sonnet-4-20250514" in str(error)


@pytest.mark.parametrize("status", [409, 408])
def test_hole__409_and_408_without_x_should_retry_are_transient(fake, claude, status):
    # https://platform.claude.com/docs/en/api/errors lists 409 conflict_error; the SDK (anthropic/_base_client.py
    # `_should_retry`) retries 408 and 409 ("lock timeouts") when x-should-retry is absent, and claude.py says it
    # follows that policy with the SDK's retries switched off.
    fake.enqueue(Fault.status(status))
    assert type(raised_by(claude)) is ModelUnavailableError


def test_hole__the_spend_cap_429_without_details_is_still_permanent(fake, claude):
    # https://platform.claude.com/docs/en/api/errors and .../api/rate-limits : the tier's monthly cap is a 429 with
    # NO retry-after that keeps failing until the 1st of next month. A body without `details` (older shape, or a
    # proxy that strips it) still says so in words; retrying it for a month is wrong.
    body = Fault.spend_limit().body
    body = copy.deepcopy(dict(body))  # type: ignore[arg-type]
    del body["error"]["details"]
    fake.enqueue(Fault.status(429, body))
    assert isinstance(raised_by(claude), ModelRequestError)


def test_hole__a_402_linked_organization_spend_limit_says_it_is_a_spend_limit(fake, claude):
    # https://platform.claude.com/docs/en/api/errors (402 billing_error); the SDK's error codes include 402
    # `linked_organization_spend_limit_reached`. It is permanent already; the message should name the limit.
    body = Fault.status(402, "Access for this organization is paused by its parent organization.").body
    body = copy.deepcopy(dict(body))  # type: ignore[arg-type]
    body["error"]["details"] = {"error_code": "linked_organization_spend_limit_reached"}
    fake.enqueue(Fault.status(402, body))
    error = raised_by(claude)
    assert isinstance(error, ModelRequestError) and "spend limit" in str(error)


def test_hole__prompt_is_too_long_is_a_context_window_problem(fake, claude):
    # https://platform.claude.com/docs/en/build-with-claude/context-windows : an input over the window is a 400
    # "prompt is too long: N tokens > M maximum". The fix is compaction, not "check the model name, tools and
    # messages"; the loop already handles ContextWindowExceededError for the stop reason of the same cause.
    fake.enqueue(Fault.status(400, "prompt is too long: 205000 tokens > 200000 maximum"))
    error = raised_by(claude)
    assert isinstance(error, ContextWindowExceededError) or "context window" in str(error)
