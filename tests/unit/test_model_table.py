"""The model table: what each model accepts, as the Claude docs state it, and how steps are checked against it.

Sources: https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide (Sonnet 5.5 refuses assistant
prefill, forced tool choice, sampling parameters, thinking budgets and thinking "disabled"; thinking is on when the
field is omitted), https://platform.claude.com/docs/en/build-with-claude/thinking-troubleshooting (accepted
thinking types per model), https://platform.claude.com/docs/en/about-claude/pricing.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest
from django.core import checks
from django.test import override_settings

from durable_agents.agents.capabilities import ModelChoice, model_profile, model_table
from durable_agents.agents.loop import agent
from durable_agents.agents.messages import Usage
from durable_agents.agents.pricing import cost_usd
from durable_agents.errors import DefinitionError
from durable_agents.judge import judge
from durable_agents.planner import planner
from durable_agents.tools import tool
from durable_agents.workflows import workflow


def test_model_table__the_default_model_refuses_prefill_and_forced_tool_choice_and_thinks_by_default():
    profile = model_profile("claude-sonnet-5-5")
    assert profile.known and profile.context_window == 1_000_000 and profile.max_output == 128_000
    assert profile.thinking_on(None), "thinking runs when the request has no thinking field"
    assert not profile.accepts_prefill(None) and not profile.accepts_forced_tool(None)
    assert not profile.sampling and profile.prefix_check
    assert profile.thinking_types == {"adaptive", "between_tools"}, "disabled and enabled are refused"


def test_model_table__an_older_model_takes_prefill_and_forced_tool_use_only_while_not_thinking():
    profile = model_profile("claude-haiku-4-5-20251001")
    assert profile.model == "claude-haiku-4-5", "a dated snapshot finds its model's row"
    assert not profile.thinking_on(None) and profile.accepts_prefill(None) and profile.accepts_forced_tool(None)
    thinking = {"type": "enabled", "budget_tokens": 2048}
    assert not profile.accepts_prefill(thinking) and not profile.accepts_forced_tool(thinking)


def test_model_table__an_unknown_model_gets_the_conservative_profile():
    profile = model_profile("claude-next-7")
    assert not profile.known and profile.model == "claude-next-7"
    assert profile.thinking_on(None) and not profile.accepts_prefill(None) and not profile.accepts_forced_tool(None)


def test_model_table__settings_add_a_model_and_change_a_row():
    models = {
        "claude-next-7": {"forced_tool_choice": True, "thinking_default": False, "prices": [1, 2, 3, 0.5]},
        "claude-sonnet-5-5": {"prices": [1, 1, 1, 0.1]},
    }
    with override_settings(DURABLE_AGENTS={"MODELS": models}):
        added = model_profile("claude-next-7")
        assert added.known and added.accepts_forced_tool(None)
        assert added.prices == (1.0, 2.0, 3.0, 0.5, 2.0), "a 4-price row gets the 1 h write at twice the input"
        assert cost_usd("claude-sonnet-5-5", Usage(input_tokens=1_000_000)) == Decimal(1)
    assert cost_usd("claude-sonnet-5-5", Usage(input_tokens=1_000_000)) == Decimal(2)


def test_model_table__cache_reads_are_priced_per_model():
    read = Usage(cache_read_tokens=1_000_000)
    assert cost_usd("claude-opus-5-5", read) == Decimal("0.2")
    assert cost_usd("claude-haiku-4-5", read) == Decimal("0.1")
    assert cost_usd("scripted:claude-opus-5-5", read) == 0, "a scripted participant costs nothing"


def test_model_choice__thinking_and_effort_are_checked_against_the_model():
    assert ModelChoice("claude-sonnet-5-5", {"type": "between_tools"}, "high").problem() is None
    assert "xhigh" not in (ModelChoice("claude-sonnet-5-5", None, "xhigh").problem() or "")
    assert "between_tools" in ModelChoice("claude-sonnet-5-5", {"type": "between_tools"}, "max").problem()
    assert "'disabled'" in ModelChoice("claude-sonnet-5-5", {"type": "disabled"}).problem()
    assert "does not take effort" in ModelChoice("claude-haiku-4-5", None, "low").problem()
    assert "over claude-haiku-4-5's limit" in ModelChoice("claude-haiku-4-5", max_tokens=100_000).problem()
    assert "budget_tokens" in ModelChoice("claude-haiku-4-5", {"type": "enabled"}).problem()


def test_steps__a_step_naming_its_model_is_checked_when_defined():
    with pytest.raises(DefinitionError, match="does not take thinking 'disabled'"):
        agent("a", instructions="x", model="claude-sonnet-5-5", thinking="disabled")
    with pytest.raises(DefinitionError, match="effort must be one of"):
        judge("j", rubric="r", subject=lambda ctx: "s", model="claude-opus-5-5", effort="extreme")
    with pytest.raises(DefinitionError, match="fallback"):
        agent("a", instructions="x", fallback_model="claude-haiku-4-5", effort="max", model="claude-sonnet-5-5")


@tool
def lookup(order_id: str) -> dict:
    """Look an order up."""
    return {"order_id": order_id}


def test_checks__a_step_on_the_default_model_is_checked_by_the_system_check(isolated_registries):
    workflow(
        "thinks_wrong",
        steps=[
            agent("a", instructions="x", thinking="disabled", participant="anthropic"),
            planner("p", instructions="plan", tools=[lookup], participant="anthropic"),
        ],
    )
    messages = [m for m in checks.run_checks(tags=["durable_agents"]) if m.id == "durable_agents.E014"]
    assert len(messages) == 1 and "thinks_wrong" in messages[0].msg and "'disabled'" in messages[0].msg
    with override_settings(DURABLE_AGENTS={"DEFAULT_MODEL": "claude-opus-4-8"}):
        ids = [m.id for m in checks.run_checks(tags=["durable_agents"])]
    assert "durable_agents.E014" not in ids, "Opus 4.8 takes thinking 'disabled'"


def test_checks__an_unknown_model_is_a_warning_and_a_bad_models_entry_an_error(isolated_registries):
    workflow("next_model", steps=[agent("a", instructions="x", model="claude-next-7", participant="anthropic")])
    with override_settings(DURABLE_AGENTS={"MODELS": {"claude-x": {"prefil": True}}}):
        found = {m.id: m for m in checks.run_checks(tags=["durable_agents"])}
    assert "durable_agents.E013" in found and "prefil" in found["durable_agents.E013"].msg
    found = {m.id: m for m in checks.run_checks(tags=["durable_agents"])}
    assert "durable_agents.W009" in found and "claude-next-7" in found["durable_agents.W009"].msg


def test_model_table__the_docs_show_the_table_as_declared():
    page = (Path(__file__).resolve().parents[2] / "docs" / "explanation" / "claude-today.md").read_text()
    found = re.search(r"<!-- model table:[^\n]*-->\n(?P<table>.*?)\n<!-- end of model table -->", page, re.DOTALL)
    assert found and found["table"].strip() == model_table(), (
        "docs/explanation/claude-today.md's model table differs from capabilities.py: paste the output of "
        "python -c 'from durable_agents.agents.capabilities import model_table; print(model_table())'"
    )
