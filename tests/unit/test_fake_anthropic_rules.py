"""The fake Anthropic API refuses what the documented API refuses, through the real SDK: a known-bad request gets
the 400 (or 404) with the documented words, and the nearest good request passes. Rules: /tmp/rules.md, citing
the Claude docs pages named in `durable_agents.testing.api_rules` and `thinking_binding`."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types import Message

from durable_agents.testing.fake_anthropic import (
    FakeAnthropic,
    Fault,
    Reply,
    redacted_thinking_block,
    text_block,
    thinking_block,
    tool_use_block,
)

HELLO = [{"role": "user", "content": "hello"}]
BETA = {"anthropic-beta": "thinking-binding-controls-2026-08-01"}
TOOLS = [
    {
        "name": "search",
        "description": "Search the web",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}, "limit": {"type": "integer"}}},
    }
]
SYSTEM = "You are a careful research agent."


@pytest.fixture
def fake() -> Iterator[FakeAnthropic]:
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def client(fake: FakeAnthropic) -> anthropic.Anthropic:
    return fake.client(max_retries=0)


def ask(client: anthropic.Anthropic, **kwargs: Any) -> Message:
    kwargs.setdefault("model", "claude-opus-5-5")
    kwargs.setdefault("max_tokens", 64)
    kwargs.setdefault("messages", HELLO)
    return client.messages.create(**kwargs)


def refused(
    client: anthropic.Anthropic, error: type[anthropic.APIStatusError] = anthropic.BadRequestError, **kwargs: Any
) -> str:
    """The error message of a request the fake must refuse."""
    with pytest.raises(error) as caught:
        ask(client, **kwargs)
    return caught.value.body["error"]["message"]  # type: ignore[index]


# -- models ----------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK warns about a deprecated name before sending
@pytest.mark.parametrize("model", ["claude-sonnet-4-20250514", "claude-3-7-sonnet-20250219", "claude-mythos-preview"])
def test_rules_model__retired_is_404_naming_it(client: anthropic.Anthropic, model: str) -> None:
    assert refused(client, anthropic.NotFoundError, model=model) == f"model: {model}"


@pytest.mark.parametrize("model", ["claude-haiku-4-5-20251001", "claude-haiku-4-5", "claude-fable-5-2", "claude-test"])
def test_rules_model__known_and_unknown_ids_are_served(client: anthropic.Anthropic, model: str) -> None:
    assert ask(client, model=model).model == model


def test_rules_model__unknown_is_404_under_strict_models() -> None:
    with FakeAnthropic(strict_models=True) as fake:
        client = fake.client(max_retries=0)
        assert refused(client, anthropic.NotFoundError, model="claude-test") == "model: claude-test"
        assert ask(client, model="claude-sonnet-5-5").model == "claude-sonnet-5-5"
        assert fake.requests[0].refused == "model: claude-test" and fake.requests[1].refused is None


def test_rules_model__unknown_gets_the_newest_rules(client: anthropic.Anthropic) -> None:
    prefill = [*HELLO, {"role": "assistant", "content": "Sure"}]
    assert "prefill" in refused(client, model="m", messages=prefill)
    assert refused(client, model="m", tools=TOOLS, tool_choice={"type": "any"}).startswith("tool_choice:")
    assert refused(client, model="m", extra_body={"temperature": 0.2}) == "`temperature` is deprecated for this model."
    assert ask(client, model="m").content[0].type == "thinking", "thinking is on by default for an unknown model"


# -- max_tokens ------------------------------------------------------------------------------------------------


def test_rules_max_tokens__over_the_model_maximum_is_refused(client: anthropic.Anthropic) -> None:
    assert refused(client, model="claude-haiku-4-5-20251001", max_tokens=999999, timeout=30) == (
        "max_tokens: 999999 > 64000, which is the maximum allowed number of output tokens for claude-haiku-4-5-20251001"
    )
    assert ask(client, model="claude-haiku-4-5-20251001", max_tokens=64000, timeout=30).stop_reason == "end_turn"


def test_rules_max_tokens__zero_prewarms_without_stream_only(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Reply.text("scripted"))
    assert "max_tokens: 0" in refused(client, max_tokens=0, extra_body={"stream": True})

    warm = ask(client, max_tokens=0)

    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    assert fake.pending == 1, "a cache pre-warm must not consume the script"


# -- thinking --------------------------------------------------------------------------------------------------

ENABLED = (
    '"thinking.type.enabled" is not supported for this model. Use "thinking.type.adaptive" and '
    '"output_config.effort" to control thinking behavior.'
)


@pytest.mark.parametrize(
    ("model", "thinking", "message"),
    [
        ("claude-opus-5-5", {"type": "enabled", "budget_tokens": 2048}, ENABLED),
        ("claude-opus-4-7", {"type": "enabled", "budget_tokens": 2048}, ENABLED),
        (
            "claude-opus-5-5",
            {"type": "disabled"},
            '"thinking.type.disabled" is not supported for this model. Use "thinking.type.adaptive" and '
            '"output_config.effort" to control thinking behavior.',
        ),
        (
            "claude-sonnet-5-5",
            {"type": "disabled"},
            '"thinking.type.disabled" is not supported for this model. Use "thinking.type.between_tools" for the '
            'lowest thinking setting, or "thinking.type.adaptive" and "output_config.effort" to control thinking '
            "behavior.",
        ),
        (
            "claude-fable-5-2",
            {"type": "disabled"},
            '"thinking.type.disabled" is not supported for this model. Thinking defaults to adaptive mode when not '
            'specified; use "thinking.type.enabled" with "budget_tokens" for extended thinking.',
        ),
        ("claude-haiku-4-5", {"type": "adaptive"}, "adaptive thinking is not supported on this model"),
    ],
)
def test_rules_thinking__refused_types_use_the_documented_words(
    client: anthropic.Anthropic, model: str, thinking: dict[str, Any], message: str
) -> None:
    assert refused(client, model=model, max_tokens=4096, thinking=thinking) == message


@pytest.mark.parametrize(
    ("model", "thinking", "effort"),
    [
        ("claude-opus-5-5", {"type": "adaptive"}, None),
        ("claude-sonnet-5-5", {"type": "between_tools"}, "high"),
        ("claude-haiku-5-5", {"type": "disabled"}, "high"),
        ("claude-opus-4-7", {"type": "disabled"}, None),
        ("claude-haiku-4-5", {"type": "enabled", "budget_tokens": 1024}, None),
    ],
)
def test_rules_thinking__accepted_types_pass(
    client: anthropic.Anthropic, model: str, thinking: dict[str, Any], effort: str | None
) -> None:
    extra = {"output_config": {"effort": effort}} if effort else {}
    assert ask(client, model=model, max_tokens=4096, thinking=thinking, extra_body=extra).stop_reason == "end_turn"


def test_rules_thinking__between_tools_takes_no_other_field_and_no_high_effort(client: anthropic.Anthropic) -> None:
    sonnet = {"model": "claude-sonnet-5-5"}
    between = {"thinking": {"type": "between_tools", "display": "summarized"}}
    assert "display: Extra inputs are not permitted" in refused(client, **sonnet, extra_body=between)
    xhigh = {"thinking": {"type": "between_tools"}, "output_config": {"effort": "xhigh"}}
    assert "between_tools" in refused(client, **sonnet, extra_body=xhigh)
    assert "disabled" in refused(
        client,
        model="claude-haiku-5-5",
        extra_body={"thinking": {"type": "disabled"}, "output_config": {"effort": "max"}},
    )


def test_rules_thinking__budget_at_least_1024_and_below_max_tokens(client: anthropic.Anthropic) -> None:
    haiku = {"model": "claude-haiku-4-5", "max_tokens": 2048}
    assert "greater than or equal to 1024" in refused(
        client, **haiku, thinking={"type": "enabled", "budget_tokens": 1000}
    )
    assert "`max_tokens` must be greater than" in refused(
        client, **haiku, thinking={"type": "enabled", "budget_tokens": 2048}
    )
    assert ask(client, **haiku, thinking={"type": "enabled", "budget_tokens": 2047}).content[0].type == "thinking"


def test_rules_effort__levels_per_model_and_json_schema_format(client: anthropic.Anthropic) -> None:
    assert "output_config.effort" in refused(
        client, model="claude-haiku-4-5", extra_body={"output_config": {"effort": "low"}}
    )
    assert "output_config.effort" in refused(
        client, model="claude-opus-4-6", extra_body={"output_config": {"effort": "xhigh"}}
    )
    assert ask(client, model="claude-opus-4-6", extra_body={"output_config": {"effort": "max"}})
    schema = {"type": "json_schema", "schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    assert ask(client, extra_body={"output_config": {"format": schema, "effort": "low"}})
    assert "format.type" in refused(client, extra_body={"output_config": {"format": {"type": "xml"}}})


# -- sampling --------------------------------------------------------------------------------------------------


def test_rules_sampling__refused_on_new_models_one_of_two_on_haiku_4_5(client: anthropic.Anthropic) -> None:
    assert refused(client, extra_body={"temperature": 0.5}) == "`temperature` is deprecated for this model."
    assert refused(client, extra_body={"top_k": 5}) == "`top_k` is deprecated for this model."
    assert ask(client, extra_body={"temperature": 1.0}), "the default temperature is not a change"
    haiku = {"model": "claude-haiku-4-5"}
    assert "cannot both be specified" in refused(client, **haiku, extra_body={"temperature": 0.5, "top_p": 0.9})
    assert ask(client, **haiku, extra_body={"temperature": 0.5})
    assert ask(client, model="claude-sonnet-4-6", extra_body={"temperature": 0.5, "top_p": 0.9})


# -- prefill and forced tool choice ----------------------------------------------------------------------------

PREFILL = [*HELLO, {"role": "assistant", "content": "Certainly:"}]


def test_rules_prefill__refused_on_no_prefill_models_and_while_thinking(client: anthropic.Anthropic) -> None:
    assert refused(client, model="claude-sonnet-5-5", messages=PREFILL) == (
        "This model does not support assistant message prefill. The conversation must end with a user message."
    )
    assert ask(client, model="claude-haiku-4-5", messages=PREFILL).stop_reason == "end_turn"
    thinking = {"type": "enabled", "budget_tokens": 1024}
    assert "prefill" in refused(client, model="claude-haiku-4-5", max_tokens=2048, messages=PREFILL, thinking=thinking)


def test_rules_tool_choice__forced_refused_per_model_and_while_thinking(client: anthropic.Anthropic) -> None:
    forced = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "search"}}
    assert refused(client, model="claude-opus-5-5", **forced) == (
        'tool_choice: type "tool" and "any" are not supported for this model.'
    )
    assert "Thinking may not be enabled" in refused(client, model="claude-opus-5", **forced)
    assert ask(client, model="claude-opus-5", thinking={"type": "disabled"}, **forced).stop_reason == "end_turn"
    wrong = {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "browse"}}
    assert "browse" in refused(client, model="claude-opus-5", thinking={"type": "disabled"}, **wrong)
    assert ask(client, model="claude-opus-5-5", tools=TOOLS, tool_choice={"type": "auto"})


def test_rules_tool_choice__count_tokens_applies_it_too(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="not supported for this model"):
        client.messages.count_tokens(
            model="claude-sonnet-5-5", messages=HELLO, tools=TOOLS, tool_choice={"type": "any"}
        )  # type: ignore[arg-type]
    assert client.messages.count_tokens(model="claude-sonnet-5-5", messages=HELLO, tools=TOOLS).input_tokens > 0  # type: ignore[arg-type]


# -- messages --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([{"role": "assistant", "content": "hi"}, *HELLO], 'messages: first message must use the "user" role'),
        ([*HELLO, *HELLO], 'but found multiple "user" roles in a row'),
        ([{"role": "user", "content": ""}], "must have non-empty content"),
        ([{"role": "user", "content": []}], "must have non-empty content"),
        ([{"role": "user", "content": [text_block("")]}], "messages: text content blocks must be non-empty"),
        (
            [{"role": "user", "content": [text_block(" \n")]}],
            "messages: text content blocks must contain non-whitespace text",
        ),
        ([{"role": "system", "content": "be nice"}, *HELLO], "role: Input should be 'user' or 'assistant'"),
    ],
)
def test_rules_messages__malformed_conversations_are_refused(
    client: anthropic.Anthropic, messages: list[dict[str, Any]], message: str
) -> None:
    assert message in refused(client, messages=messages)


def test_rules_messages__consecutive_roles_combined_when_not_strict() -> None:
    with FakeAnthropic(strict_roles=False) as fake:
        assert ask(fake.client(max_retries=0), messages=[*HELLO, {"role": "user", "content": "again"}])


# -- tool_use / tool_result pairing ----------------------------------------------------------------------------

CALL = {"role": "assistant", "content": [tool_use_block("search", {"q": "otters"}, id="toolu_1")]}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 otters"}


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [*HELLO, CALL, {"role": "user", "content": "go on"}],
            "tool_use ids were found without tool_result blocks immediately after: toolu_1",
        ),
        (
            [*HELLO, CALL, {"role": "user", "content": [text_block("here"), RESULT]}],
            "`tool_result` blocks must come first",
        ),
        (
            [*HELLO, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [RESULT]}],
            "unexpected `tool_use_id`",
        ),
        ([*HELLO, CALL, {"role": "user", "content": [RESULT, RESULT]}], "Found multiple `tool_result` blocks"),
        (
            [*HELLO, CALL, {"role": "user", "content": [RESULT]}, CALL, {"role": "user", "content": [RESULT]}],
            "messages: `tool_use` ids must be unique",
        ),
    ],
)
def test_rules_pairing__broken_pairs_are_refused(
    client: anthropic.Anthropic, messages: list[dict[str, Any]], message: str
) -> None:
    assert message in refused(client, messages=messages, tools=TOOLS)


def test_rules_pairing__results_first_then_text_pass(client: anthropic.Anthropic) -> None:
    parallel = {
        "role": "assistant",
        "content": [
            tool_use_block("search", {"q": "a"}, id="toolu_a"),
            tool_use_block("search", {"q": "b"}, id="toolu_b"),
        ],
    }
    results = [{"type": "tool_result", "tool_use_id": i, "content": "x"} for i in ("toolu_b", "toolu_a")]
    messages = [*HELLO, parallel, {"role": "user", "content": [*results, text_block("and then?")]}]
    assert ask(client, messages=messages, tools=TOOLS)


# -- cache_control and tools -----------------------------------------------------------------------------------


def test_rules_cache_control__four_breakpoints_ephemeral_ttl(client: anthropic.Anthropic) -> None:
    def marked(n: int, **control: Any) -> list[dict[str, Any]]:
        return [
            {"type": "text", "text": f"rule {i}", "cache_control": {"type": "ephemeral", **control}} for i in range(n)
        ]

    assert refused(client, system=marked(5)) == "A maximum of 4 blocks with cache_control may be provided. Found 5."
    assert ask(client, system=marked(4))
    assert "ttl" in refused(client, system=marked(1, ttl="10m"))
    assert ask(client, system=marked(1, ttl="1h"))
    assert "Found 5" in refused(client, system=marked(4), extra_body={"cache_control": {"type": "ephemeral"}})


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([{**TOOLS[0], "name": "web search"}], "String should match pattern"),
        ([TOOLS[0], TOOLS[0]], "Tool names must be unique"),
        ([{**TOOLS[0], "input_schema": {"type": "array"}}], "input_schema.type: Input should be 'object'"),
    ],
)
def test_rules_tools__names_and_schemas(client: anthropic.Anthropic, tools: list[dict[str, Any]], message: str) -> None:
    assert message in refused(client, tools=tools)


# -- thinking signatures ---------------------------------------------------------------------------------------


def first_turn(client: anthropic.Anthropic, model: str = "claude-opus-5-5", **kwargs: Any) -> list[dict[str, Any]]:
    reply = ask(client, model=model, **kwargs)
    return [
        *HELLO,
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": "more"},
    ]


def test_rules_signature__forged_or_edited_blocks_are_refused(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Reply.thinking("I should greet them."))
    messages = first_turn(client)
    assert ask(client, messages=messages), "an unchanged block goes back"
    edited = copy.deepcopy(messages)
    edited[1]["content"][0]["thinking"] = "I should insult them."
    assert refused(client, messages=edited) == "messages.1.content.0: Invalid `signature` in `thinking` block"
    forged = copy.deepcopy(messages)
    forged[1]["content"][0]["signature"] = "EqQBCkYIARgCKkD"
    assert "Invalid `signature`" in refused(client, messages=forged)
    with FakeAnthropic() as other:
        assert "Invalid `signature`" in refused(other.client(max_retries=0), messages=messages), "another fake's block"
    unsigned = copy.deepcopy(messages)
    del unsigned[1]["content"][0]["signature"]
    assert "signature: Field required" in refused(client, messages=unsigned)
    assert fake.requests[2].refused and "Invalid `signature`" in fake.requests[2].refused


def test_rules_signature__no_cache_control_on_thinking(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    messages = first_turn(client)
    messages[1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    assert "cannot be cached directly" in refused(client, messages=messages)


def test_rules_signature__another_models_block_is_dropped_silently(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    messages = first_turn(client, model="claude-fable-5-2")

    assert ask(client, model="claude-opus-5-5", messages=messages), "Opus 5.5 cannot read Fable 5.2 blocks: dropped"
    raw = client.messages.with_raw_response.create(
        model="claude-opus-5-5",
        max_tokens=64,
        messages=messages,
        extra_headers=BETA,  # type: ignore[arg-type]
    )

    assert [(n.path, n.reason) for n in fake.dropped_thinking] == [
        ("messages.1.content.0", "model_binding_mismatch")
    ] * 2
    assert raw.http_response.json()["input_transformations"] == [
        {"type": "thinking_dropped", "path": "messages.1.content.0", "reason": "model_binding_mismatch"}
    ]


# -- preserved thinking: the prefix check ----------------------------------------------------------------------


def three_turns(
    fake: FakeAnthropic, client: anthropic.Anthropic, model: str = "claude-opus-5-5"
) -> list[dict[str, Any]]:
    """messages 1, 3, 5 are assistant turns opening with thinking blocks A, B, C; 6 is a new question."""
    fake.enqueue(
        Reply.tool_use("search", {"q": "otters", "limit": 3}),
        Reply.tool_use("search", {"q": "seals", "limit": 1}),
        Reply.text("Otters and seals."),
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "find otters"}]
    for _ in range(3):
        reply = ask(client, model=model, max_tokens=256, system=SYSTEM, tools=TOOLS, messages=messages)
        assert reply.content[0].type == "thinking" and reply.content[0].signature
        messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if calls:
            messages.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "found"} for c in calls],
                }
            )
    return [*messages, {"role": "user", "content": "thanks"}]


def send(
    client: anthropic.Anthropic, messages: list[dict[str, Any]], model: str = "claude-opus-5-5", **kwargs: Any
) -> Message:
    kwargs = {"system": SYSTEM, "tools": TOOLS, **kwargs}
    return ask(client, model=model, max_tokens=256, messages=messages, **kwargs)


def drop_thinking(messages: list[dict[str, Any]], *indexes: int) -> list[dict[str, Any]]:
    changed = copy.deepcopy(messages)
    for i in indexes:
        changed[i]["content"] = [b for b in changed[i]["content"] if b["type"] != "thinking"]
    return changed


BOUND = "Invalid `signature` in `thinking` block. The block is bound to a different conversation."


def test_prefix__unchanged_history_passes(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    messages = three_turns(fake, client)

    assert send(client, messages, extra_body={"output_config": {"effort": "low"}}, tool_choice={"type": "auto"})
    assert client.messages.count_tokens(model="claude-opus-5-5", system=SYSTEM, tools=TOOLS, messages=messages)  # type: ignore[arg-type]
    cached = copy.deepcopy(messages)
    cached[4]["content"][0]["cache_control"] = {"type": "ephemeral"}
    assert send(client, cached), "cache_control is not part of the prefix"


def _mutations() -> list[tuple[str, Any, str]]:
    def system(m: list[dict[str, Any]], kw: dict[str, Any]) -> None:
        kw["system"] = "You are a hasty research agent."

    def tool_description(m: list[dict[str, Any]], kw: dict[str, Any]) -> None:
        kw["tools"] = [{**TOOLS[0], "description": "Search the whole web"}]

    def reorder_input(m: list[dict[str, Any]], kw: dict[str, Any]) -> None:
        call = m[1]["content"][1]
        call["input"] = dict(reversed(list(call["input"].items())))

    def edit_earlier(m: list[dict[str, Any]], kw: dict[str, Any]) -> None:
        m[0]["content"] = "find seals"

    def string_to_block(m: list[dict[str, Any]], kw: dict[str, Any]) -> None:
        m[0]["content"] = [text_block("find otters")]

    def drop_middle(m: list[dict[str, Any]], kw: dict[str, Any]) -> None:
        m[3]["content"] = [b for b in m[3]["content"] if b["type"] != "thinking"]

    return [
        ("system", system, "messages.1.content.0"),
        ("tool_description", tool_description, "messages.1.content.0"),
        ("tool_use_input_reordered", reorder_input, "messages.3.content.0"),
        ("earlier_message_edited", edit_earlier, "messages.1.content.0"),
        ("string_content_made_a_block", string_to_block, "messages.1.content.0"),
        ("middle_block_dropped", drop_middle, "messages.5.content.0"),
    ]


@pytest.mark.parametrize(("change", "path"), [(m[1], m[2]) for m in _mutations()], ids=[m[0] for m in _mutations()])
def test_prefix__a_changed_prefix_is_refused_on_new_accounts(
    fake: FakeAnthropic, client: anthropic.Anthropic, change: Any, path: str
) -> None:
    messages = three_turns(fake, client)
    kwargs: dict[str, Any] = {}
    change(messages, kwargs)

    message = refused(client, messages=messages, **{"system": SYSTEM, "tools": TOOLS, "max_tokens": 256, **kwargs})

    assert message.startswith(f"{path}: {BOUND}"), message
    assert "thinking-binding-controls-2026-08-01" in message, "without the beta header the error says it is needed"


@pytest.mark.parametrize(("change", "path"), [(m[1], m[2]) for m in _mutations()], ids=[m[0] for m in _mutations()])
def test_prefix__a_changed_prefix_is_logged_on_old_accounts(change: Any, path: str) -> None:
    with FakeAnthropic(preserved_thinking="allow") as fake:
        client = fake.client(max_retries=0)
        messages = three_turns(fake, client)
        kwargs: dict[str, Any] = {}
        change(messages, kwargs)

        assert send(client, messages, **kwargs)

    assert fake.prefix_mismatches and fake.prefix_mismatches[0].path == path
    assert {n.reason for n in fake.prefix_mismatches} == {"prefix_binding_mismatch"}


@pytest.mark.parametrize(
    ("dropped", "why"),
    [((1, 3, 5), "all of them"), ((1,), "the oldest"), ((1, 3), "the two oldest"), ((5,), "the newest, from the end")],
)
def test_prefix__dropping_from_the_old_end_or_all_passes(
    fake: FakeAnthropic, client: anthropic.Anthropic, dropped: tuple[int, ...], why: str
) -> None:
    messages = three_turns(fake, client)

    assert send(client, drop_thinking(messages, *dropped)), f"dropping {why} must pass"
    assert fake.requests[-1].refused is None


def test_prefix__drop_block_drops_the_failing_block_and_later_ones(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    messages = three_turns(fake, client)
    changed = copy.deepcopy(messages)
    changed[2]["content"][0]["content"] = "nothing found"
    binding = {"thinking": {"type": "adaptive", "block_binding": {"prefix_mismatch_behavior": "drop_block"}}}

    assert "block_binding: Extra inputs are not permitted" in refused(
        client, messages=changed, system=SYSTEM, tools=TOOLS, extra_body=binding
    )
    raw = client.messages.with_raw_response.create(
        model="claude-opus-5-5",
        max_tokens=256,
        system=SYSTEM,
        tools=TOOLS,
        messages=changed,  # type: ignore[arg-type]
        extra_body=binding,
        extra_headers=BETA,
    )

    paths = [t["path"] for t in raw.http_response.json()["input_transformations"]]
    assert paths == ["messages.3.content.0", "messages.5.content.0"], "B failed, so C is invalidated with it"


def test_prefix__fable_5_2_enforces_on_every_account_mythos_5_1_never() -> None:
    with FakeAnthropic(preserved_thinking="allow") as fake:
        client = fake.client(max_retries=0)
        for model, enforced in (("claude-fable-5-2", True), ("claude-mythos-5-1", False)):
            messages = three_turns(fake, client, model=model)
            if enforced:
                assert BOUND in refused(
                    client, model=model, messages=messages, system="changed", tools=TOOLS, max_tokens=256
                )
            else:
                assert send(client, messages, model=model, system="changed")
        assert fake.prefix_mismatches == [], "Mythos 5.1 runs no prefix check"


def test_prefix__count_tokens_runs_the_check(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    messages = three_turns(fake, client)
    with pytest.raises(anthropic.BadRequestError, match="bound to a different conversation"):
        client.messages.count_tokens(model="claude-opus-5-5", system="changed", tools=TOOLS, messages=messages)  # type: ignore[arg-type]


def test_prefix__unknown_models_run_it_too(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    messages = three_turns(fake, client, model="claude-test")
    assert BOUND in refused(
        client, model="claude-test", messages=messages, system="changed", tools=TOOLS, max_tokens=256
    )


# -- response shapes -------------------------------------------------------------------------------------------


def test_shapes__scripted_thinking_redacted_and_interleaved(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(
        Reply(
            content=[
                thinking_block("Look it up first."),
                tool_use_block("search", {"q": "a"}),
                redacted_thinking_block(),
                tool_use_block("search", {"q": "b"}),
            ],
            stop_reason="tool_use",
        )
    )
    with client.messages.stream(model="claude-opus-5-5", max_tokens=64, messages=HELLO, tools=TOOLS) as stream:  # type: ignore[arg-type]
        message = stream.get_final_message()

    assert [b.type for b in message.content] == ["thinking", "tool_use", "redacted_thinking", "tool_use"]
    assert message.content[0].thinking == "Look it up first." and message.content[0].signature  # type: ignore[union-attr]
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": "x"} for b in message.content if b.type == "tool_use"
    ]
    history = [
        *HELLO,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": results},
    ]
    assert ask(client, messages=history, tools=TOOLS), "streamed signatures and redacted data go back intact"


def test_shapes__refusal_has_stop_details_others_null(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Reply.refusal("cyber", "Looks like malware."), Reply.refusal("bio"), Reply.text("fine"))

    plain = ask(client)
    with client.messages.stream(model="claude-opus-5-5", max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    normal = ask(client)

    assert plain.stop_reason == "refusal" and plain.stop_details is not None
    assert (plain.stop_details.category, plain.stop_details.explanation) == ("cyber", "Looks like malware.")
    assert streamed.stop_details is not None and streamed.stop_details.category == "bio", (
        "stop_details in message_delta"
    )
    assert normal.stop_details is None
    with pytest.raises(ValueError, match="stop_details"):
        Reply(stop_reason="end_turn", stop_details={"type": "refusal"})


def test_shapes__pause_turn_parallel_and_context_window(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(
        Reply.pause_turn("web_search", {"query": "otters"}),
        Reply.parallel_tool_use(("search", {"q": "a"}), ("search", {"q": "b"})),
        Reply.context_window_exceeded(),
    )

    paused, parallel, full = ask(client, tools=TOOLS), ask(client, tools=TOOLS), ask(client)

    assert paused.stop_reason == "pause_turn" and paused.content[-1].type == "server_tool_use"
    assert paused.content[-1].id.startswith("srvtoolu_")  # type: ignore[union-attr]
    assert [b.type for b in parallel.content] == ["thinking", "tool_use", "tool_use"]
    assert full.stop_reason == "model_context_window_exceeded"
    resumed = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in paused.content]}]
    assert ask(client, messages=resumed, tools=TOOLS), "a paused turn goes back as-is: not a prefill"


@pytest.mark.parametrize("stream", [False, True])
def test_shapes__truncated_tool_use_at_max_tokens(
    fake: FakeAnthropic, client: anthropic.Anthropic, stream: bool
) -> None:
    fake.enqueue(Reply.truncated_tool_use("search", {"q": "ott"}))
    if stream:
        with client.messages.stream(model="claude-opus-5-5", max_tokens=64, messages=HELLO, tools=TOOLS) as events:  # type: ignore[arg-type]
            message = events.get_final_message()
    else:
        message = ask(client, tools=TOOLS)

    assert message.stop_reason == "max_tokens" and message.content[-1].type == "tool_use"
    assert message.content[-1].input == {"q": "ott"}  # type: ignore[union-attr]


def test_shapes__auto_thinking_follows_display_and_can_be_off() -> None:
    with FakeAnthropic() as fake:
        client = fake.client(max_retries=0)
        omitted = ask(client, model="claude-opus-5-5").content[0]
        summary = ask(client, model="claude-sonnet-4-6", max_tokens=4096, thinking={"type": "adaptive"}).content[0]
        off = ask(client, model="claude-sonnet-4-6").content[0]
    with FakeAnthropic(auto_thinking=False) as fake:
        plain = ask(fake.client(max_retries=0)).content[0]

    assert omitted.type == "thinking" and omitted.thinking == "" and omitted.signature  # type: ignore[union-attr]
    assert summary.type == "thinking" and summary.thinking, "Sonnet 4.6 summarizes by default"  # type: ignore[union-attr]
    assert off.type == "text", "Sonnet 4.6 does not think when thinking is omitted"
    assert plain.type == "text"


# -- faults and headers ----------------------------------------------------------------------------------------


def test_faults__spend_limit_is_429_without_retry_after(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Fault.spend_limit("2027-01-01"))

    with pytest.raises(anthropic.RateLimitError) as caught:
        ask(client)

    error = caught.value.body["error"]  # type: ignore[index]
    assert error["details"] == {"error_code": "enforced_spend_limit_reached"}
    assert (
        error["message"].startswith("You have reached your API usage limits")
        and "2027-01-01 at 00:00 UTC" in error["message"]
    )
    assert "retry-after" not in caught.value.response.headers


def test_faults__retired_model_and_too_large(fake: FakeAnthropic, client: anthropic.Anthropic) -> None:
    fake.enqueue(Fault.retired_model(), Fault.too_large())

    assert refused(client, anthropic.NotFoundError, model="claude-opus-5") == "model: claude-opus-5"
    with pytest.raises(anthropic.APIStatusError) as caught:
        ask(client)
    assert (caught.value.status_code, caught.value.body["error"]["type"]) == (413, "request_too_large")  # type: ignore[index]


def test_headers__ratelimit_headers_on_success() -> None:
    with FakeAnthropic(requests_per_second=50) as fake:
        raw = fake.client(max_retries=0).messages.with_raw_response.create(
            model="claude-opus-5-5",
            max_tokens=8,
            messages=HELLO,  # type: ignore[arg-type]
        )

    assert raw.headers["anthropic-ratelimit-requests-limit"] == "50"
    assert int(raw.headers["anthropic-ratelimit-requests-remaining"]) == 49
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")


def test_log__refusals_are_recorded_and_do_not_consume_the_queue(
    fake: FakeAnthropic, client: anthropic.Anthropic
) -> None:
    fake.enqueue(Reply.text("for the good one"))

    refused(client, model="claude-sonnet-5-5", messages=PREFILL)
    good = ask(client)

    assert fake.requests[0].refused and "prefill" in fake.requests[0].refused
    assert json.dumps(good.content[-1].model_dump()).count("for the good one") == 1
