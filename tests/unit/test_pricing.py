"""Prices, prompt estimates, compaction cuts and cache breakpoints: the token arithmetic, without a database."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from durable_agents.agents.budget import PromptSize, estimate_prompt
from durable_agents.agents.compaction import (
    COMPACTION_INSTRUCTION,
    Compacted,
    Conversation,
    cacheable_system,
    cacheable_tools,
    deterministic_summary,
    summary_of,
)
from durable_agents.agents.participants import ModelRequest, Usage, text, tool_use
from durable_agents.agents.pricing import cost_usd


def test_cost__every_kind_of_token_has_its_price():
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000, cache_write_tokens=1_000_000, cache_read_tokens=10)
    # The model table's Sonnet 5.5 row (https://platform.claude.com/docs/en/models/sonnet-5-5/overview):
    # $2 input, $10 output, $2.50 5-minute cache write, $0.20 cache read per million tokens.
    assert cost_usd("claude-sonnet-5-5", usage) == Decimal("14.500002")  # 2 + 10 + 2.5 + 0.000002


def test_cost__one_hour_cache_writes_cost_twice_the_input_price():
    usage = Usage(cache_write_tokens=2_000_000, cache_write_1h_tokens=1_000_000)
    assert cost_usd("claude-sonnet-5-5", usage) == Decimal("6.5")  # 1M at 2.50 (5 min) + 1M at 4.00 (1 h)


def test_cost__the_longest_prefix_wins_and_unpriced_models_are_free(settings):
    prices = {"claude-opus": (5, 25, 6.25, 0.5), "claude-opus-4-1": (15, 75, 18.75, 1.5)}
    settings.DURABLE_AGENTS = {"MODEL_PRICES": prices}
    assert cost_usd("claude-opus-4-1", Usage(input_tokens=1_000_000)) == Decimal(15)
    assert cost_usd("claude-opus-5", Usage(input_tokens=1_000_000)) == Decimal(5)
    assert cost_usd("scripted:claude-opus-5", Usage(input_tokens=1_000_000)) == 0


def test_estimate__adds_what_came_after_the_last_measured_prompt():
    messages = [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": [text("y" * 400)]}]
    assert estimate_prompt({"messages": messages}, messages, None) > 200, "unmeasured: ~4 characters a token"
    grown = estimate_prompt({}, messages, PromptSize(tokens=5000, messages=1))
    assert 5200 < grown < 5300, "the measured prompt plus the messages since (from the last one it held)"


def _conversation(turns: int, compacted: Compacted | None = None) -> Conversation:
    conversation = Conversation("Tick 20 times.", compacted)
    for i in range(turns):
        conversation.add_turn(i, [tool_use("tick", {"n": i + 1}, id=f"t{i}")], "tool_use")
        conversation.add_results([{"type": "tool_result", "tool_use_id": f"t{i}", "content": json.dumps({"n": i + 1})}])
    return conversation


def test_conversation__a_fold_keeps_the_recent_turns_after_the_prompt_and_summary():
    conversation = _conversation(10)
    point = conversation.fold_point(keep=4)
    assert point is not None and point.covers_until == 6
    conversation.fold(Compacted(summary="ticked 1-6", covers_until=6, turn=10, compactions=1), point)

    opening, first_kept = conversation.messages[0], conversation.messages[1]
    assert opening["content"][0] == text("Tick 20 times.") and summary_of(conversation.messages) == "ticked 1-6"
    assert first_kept["role"] == "assistant" and first_kept["content"][0]["id"] == "t6"
    assert len(conversation.messages) == 1 + 2 * 4
    assert conversation.fold_point(keep=4) is None, "nothing left to fold until more turns come"


def test_conversation__never_cuts_inside_a_continued_answer():
    conversation = _conversation(3)
    conversation.add_turn(3, [text("Half an ans")], "max_tokens")
    conversation.add_turn(4, [text("wer.")], "end_turn")
    point = conversation.fold_point(keep=2)
    assert point is not None and point.covers_until == 3, "turn 4 continues turn 3: they stay together"


def test_breakpoints__tools_system_summary_and_last_user_block_only():
    conversation = _conversation(6)
    conversation.fold(Compacted("s", 2, 6, 1), conversation.fold_point(keep=4))
    conversation.add_turn(7, [text("Partly")], "max_tokens")
    messages = conversation.sendable()
    marked = [b for m in messages for b in m["content"] if isinstance(b, dict) and "cache_control" in b]
    assert [b["type"] for b in marked] == ["text", "tool_result"], "the summary and the newest tool results"
    assert "cache_control" not in messages[-1]["content"][-1], "the assistant prefill is sent as journaled"
    assert "cache_control" in cacheable_tools([{"name": "a"}, {"name": "b"}])[-1]
    assert cacheable_system("Be brief.")[0]["cache_control"] == {"type": "ephemeral"}


@pytest.mark.parametrize("folds", [1, 5])
def test_deterministic_summary__folds_the_previous_one_and_stays_bounded(folds):
    summary = None
    for fold in range(folds):
        conversation = _conversation(12, Compacted(summary, 0, 0, fold) if summary else None)
        request = ModelRequest(model="m", max_tokens=10, system="", tools=[], messages=conversation.messages)
        summary = deterministic_summary(request)
    parsed = json.loads(summary)
    assert parsed["turns"] == parsed["calls"]["tick"] == 12 * folds
    assert len(parsed["recent"]) == 5 and len(summary) < 1500
    assert COMPACTION_INSTRUCTION not in summary
