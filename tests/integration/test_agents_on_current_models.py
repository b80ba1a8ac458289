"""Agent, judge and planner steps on today's default model, through the real SDK, against the strict stand-in.

The stand-in (durable_agents.testing.fake_anthropic) refuses what the Messages API documents it refuses for the
model asked — on `claude-sonnet-5-5`: an assistant prefill, a forced `tool_choice`, a changed prefix under a
thinking block it is sent back — and serves thinking blocks with signatures on every answer, as the model does
with thinking on by default. Every test also asserts the stand-in refused nothing the engine sent.

Rules: https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide (prefill, forced tool choice,
thinking on by default), https://platform.claude.com/docs/en/build-with-claude/preserved-thinking (prefix
checks), https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons (refusal, max_tokens in a
tool call, model_context_window_exceeded).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from durable_agents import api
from durable_agents.agents.loop import agent
from durable_agents.engine.advance import advance
from durable_agents.errors import RetryableError
from durable_agents.judge import judge
from durable_agents.models import Event, RunStatus, Turn
from durable_agents.planner import planner
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, Reply
from durable_agents.tools import tool
from durable_agents.workflows import call, workflow
from tests.integration.stand_in import claude_on_the_stand_in, finish, refused, scripted, sent, unmarked

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fake(isolated_registries) -> Iterator[FakeAnthropic]:
    """The "anthropic" participant of this process on a strict stand-in; the test fails if it refused anything."""
    with claude_on_the_stand_in() as server:
        yield server
        assert not refused(server), (
            f"the stand-in refused what the engine sent (the real API would too): {refused(server)}"
        )


CALLS: list[str] = []


@tool
def find_order(order_id: str) -> dict[str, Any]:
    """Look an order up."""
    CALLS.append(order_id)
    return {"order_id": order_id, "amount": "30.00"}


# --- 1. Judges and planners: no forced tool choice where the model refuses it ---------------------------------


def test_judge__on_the_default_model_asks_without_forced_tool_choice_and_again_when_no_verdict_comes(fake):
    workflow("reviewed", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann, thanks.")])
    fake.enqueue(
        Reply.text("It reads politely."),  # no verdict: asked again, with this answer sent back as it came
        Reply.tool_use("submit_verdict", {"passed": True, "score": 0.9, "reasons": "polite"}),
    )
    run = finish(api.start("reviewed", {}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert run.output == {"passed": True, "score": 0.9, "reasons": "polite"}
    first, second = sent(fake)
    assert first.body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    assert second.messages[1]["content"][0]["type"] == "thinking", "the thinking block goes back as received"
    assert "Call submit_verdict now" in second.last_user_text


def test_judge__a_verdict_once_journaled_is_replayed_and_never_asked_again(fake):
    attempts: list[int] = []

    def after(ctx: Any) -> dict[str, Any]:
        attempts.append(ctx.attempt)
        if len(attempts) == 1:
            raise RetryableError("the step after the verdict fails once")
        return {}

    workflow(
        "reviewed_then",
        steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann."), call("after", after)],
    )
    fake.enqueue(Reply.tool_use("submit_verdict", {"passed": True, "score": 1, "reasons": "ok"}))
    run = finish(api.start("reviewed_then", {}).id)
    assert run.status == RunStatus.COMPLETED and len(attempts) == 2
    assert len(sent(fake)) == 1, "the verdict was asked for once"


def test_judge__on_a_model_taking_forced_tool_use_forces_it(fake):
    workflow(
        "reviewed_by_haiku",
        steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.", model="claude-haiku-4-5")],
    )
    fake.enqueue(Reply.tool_use("submit_verdict", {"passed": False, "score": 0.1, "reasons": "curt"}))
    run = finish(api.start("reviewed_by_haiku", {}).id)
    assert run.status == RunStatus.FAILED and "curt" in run.error["message"]
    assert sent(fake)[0].body["tool_choice"] == {"type": "tool", "name": "submit_verdict"}


def test_planner__on_the_default_model_gets_its_plan_without_forced_tool_choice(fake):
    CALLS.clear()
    workflow("planned_find_orders", steps=[planner("plan", instructions="Plan it.", tools=[find_order])])
    fake.enqueue(
        Reply.tool_use("submit_plan", {"steps": [{"tool": "nope", "args": {}}]}),
        Reply.tool_use("submit_plan", {"steps": [{"tool": "find_order", "args": {"order_id": "A-1"}}]}),
    )
    run = finish(api.start("planned_find_orders", {"order": "A-1"}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert CALLS == ["A-1"]
    first, second = sent(fake)
    assert first.body["tool_choice"]["type"] == "auto"
    assert second.tool_results[0]["is_error"] and "unknown tool 'nope'" in second.tool_results[0]["content"]


# --- 3. Every stop reason has a road forward -------------------------------------------------------------------


def agent_workflow(name: str, **options: Any) -> None:
    workflow(
        name,
        steps=[
            agent("assistant", instructions="Look orders up.", tools=[find_order], prompt=lambda ctx: "A-1", **options)
        ],
    )


def test_truncated_tool_call__is_asked_again_with_twice_the_max_tokens(fake):
    agent_workflow("truncates", max_tokens=1000)
    fake.responder = scripted(
        Reply.truncated_tool_use("find_order", {"order_id": "A-"}), Reply.tool_use("find_order", {"order_id": "A-1"})
    )
    run = finish(api.start("truncates", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert [r.body["max_tokens"] for r in sent(fake)] == [1000, 2000, 1000]
    assert all(
        b.get("type") != "tool_use" or b["input"] == {"order_id": "A-1"}
        for m in sent(fake)[-1].messages
        for b in (m["content"] if isinstance(m["content"], list) else [])
    ), "the truncated call is never sent back"


def test_truncated_tool_call__fails_clearly_then_a_resume_asks_again(fake):
    agent_workflow("keeps_truncating", max_tokens=1000)
    fake.responder = lambda request: Reply.truncated_tool_use("find_order", {"order_id": "A-"})
    run = finish(api.start("keeps_truncating", {}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "AgentLimitError"
    assert "raise the agent's max_tokens" in run.error["message"]
    asked = len(sent(fake))
    assert [r.body["max_tokens"] for r in sent(fake)] == [1000, 2000, 4000, 8000]

    fake.responder = scripted(Reply.tool_use("find_order", {"order_id": "A-1"}))
    api.resume(run.id)
    run = finish(run.id)
    assert run.status == RunStatus.COMPLETED, "a truncated turn is not an answer a resume replays"
    assert len(sent(fake)) == asked + 2


def test_refusal__keeps_its_category_and_explanation_and_a_resume_asks_again(fake):
    agent_workflow("refused")
    fake.enqueue(Reply.refusal("cyber", "The request could enable malware development."))
    run = finish(api.start("refused", {}).id)

    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRefusalError"
    assert "cyber" in run.error["message"] and "malware development" in run.error["message"]
    event = Event.objects.get(run=run, kind="model_refused")
    assert event.detail["category"] == "cyber" and "malware" in event.detail["explanation"]
    assert Turn.objects.get(run=run).stop_details["category"] == "cyber"

    api.resume(run.id)
    run = finish(run.id)
    assert run.status == RunStatus.COMPLETED, "the refused turn is not replayed for ever: the model is asked again"


def test_refusal__the_next_attempt_asks_the_fallback_model_without_the_refused_models_thinking(fake):
    agent_workflow("falls_back", fallback_model="claude-sonnet-5")
    fake.responder = scripted(
        Reply.tool_use("find_order", {"order_id": "A-1"}), Reply.refusal("frontier_llm"), Reply.text("Done.")
    )
    run = finish(api.start("falls_back", {}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    models = [r.body["model"] for r in sent(fake)]
    assert models == ["claude-sonnet-5-5", "claude-sonnet-5-5", "claude-sonnet-5"]
    last = sent(fake)[-1]
    thinking = [b for m in last.messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "thinking"]
    assert thinking == [], "Sonnet 5.5's thinking blocks are left out for Sonnet 5, on purpose"
    assert Event.objects.get(run=run, kind="thinking_dropped").detail["asked"] == "claude-sonnet-5"


def test_context_window_exceeded__compacts_and_asks_again_once(fake):
    agent_workflow("overflows", keep_recent_turns=1)
    fake.responder = scripted(
        Reply.tool_use("find_order", {"order_id": "A-1"}),
        Reply.tool_use("find_order", {"order_id": "A-2"}),
        Reply.context_window_exceeded(),
        Reply.text("Done."),
    )
    run = finish(api.start("overflows", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert Event.objects.filter(run=run, kind="compacted").count() == 1
    assert run.output["text"] == "Done."


def test_prompt_too_long__the_400_takes_the_same_road_compacted_and_asked_again_once(fake):
    # A prompt over the window is refused before any answer: 400 "prompt is too long: N tokens > M maximum"
    # (https://platform.claude.com/docs/en/build-with-claude/context-windows).
    agent_workflow("too_long", keep_recent_turns=1)
    too_long = Fault.status(400, "prompt is too long: 1000042 tokens > 1000000 maximum")
    fake.responder = scripted()  # a summary for the compaction call, then "done"
    fake.enqueue(
        Reply.tool_use("find_order", {"order_id": "A-1"}), Reply.tool_use("find_order", {"order_id": "A-2"}), too_long
    )
    run = finish(api.start("too_long", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert Event.objects.filter(run=run, kind="compacted").count() == 1
    assert run.output["text"] == "done" and len(sent(fake)) == 5, "two turns, the refused ask, the summary, the answer"


def test_context_window_exceeded__a_second_overflow_after_compacting_fails_the_step(fake):
    agent_workflow("overflows_twice", keep_recent_turns=1)
    fake.responder = scripted(
        Reply.tool_use("find_order", {"order_id": "A-1"}),
        Reply.tool_use("find_order", {"order_id": "A-2"}),
        Reply.context_window_exceeded(),
        Reply.context_window_exceeded(),
    )
    run = finish(api.start("overflows_twice", {}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ContextWindowExceededError"
    assert "again after compaction" in run.error["message"]


# --- 4. An append-only conversation ---------------------------------------------------------------------------


def test_deploy__a_run_in_flight_keeps_the_system_tools_and_prompt_of_its_first_turn(fake):
    failures: list[int] = []

    def locate(order_id: str) -> dict[str, Any]:
        if not failures:
            failures.append(1)
            raise RetryableError("the order service is down")  # the step is retried: a re-execution
        return {"order_id": order_id}

    def define(instructions: str, description: str) -> None:
        located = tool(locate, name="locate", description=description)
        workflow(
            "deployed",
            replace=True,
            steps=[agent("assistant", instructions=instructions, tools=[located], prompt=lambda ctx: "A-1")],
        )

    define("Look orders up.", "Look an order up.")
    fake.responder = scripted(Reply.tool_use("locate", {"order_id": "A-1"}), Reply.text("Done."))
    run = api.start("deployed", {})
    advance(run.id)
    assert failures, "the first execution stopped in the tool"
    define("Look orders up, carefully.", "Look an order up by its number.")  # the deploy
    run = finish(run.id)

    assert run.status == RunStatus.COMPLETED, run.error
    first, last = sent(fake)[0], sent(fake)[-1]
    assert last.body["system"] == first.body["system"] and last.body["tools"] == first.body["tools"]
    assert "carefully" not in json.dumps(last.body)


@tool
def fetch_history(order_id: str) -> dict[str, Any]:
    """Fetch an order with its history."""
    return {"order_id": order_id, "history": "x" * (2400 if order_id.startswith("A") else 10)}


def test_compaction__kept_turns_lose_their_thinking_blocks_and_later_turns_keep_theirs(fake):
    # Two large results pass the threshold once; the fold keeps the newest turn, and the small ones after it
    # never reach it again: one fold, then turns with thinking blocks whose prefix is the new opening.
    workflow(
        "long",
        steps=[
            agent(
                "assistant",
                instructions="Fetch orders.",
                tools=[fetch_history],
                prompt=lambda ctx: "Fetch A-0, A-1, B-0, B-1.",
                compact_at_prompt_tokens=1000,
                keep_recent_turns=1,
            )
        ],
    )
    fake.responder = scripted(*[Reply.tool_use("fetch_history", {"order_id": o}) for o in ("A-0", "A-1", "B-0", "B-1")])
    run = finish(api.start("long", {}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert Event.objects.filter(run=run, kind="compacted").count() == 1
    last = sent(fake)[-1]
    assert "conversation_summary" in json.dumps(last.messages[0])
    turns = [[b["type"] for b in m["content"]] for m in last.messages if m["role"] == "assistant"]
    assert turns == [["tool_use"], ["thinking", "tool_use"]], "the kept turn lost its thinking block; B-1 kept its"


# --- 6. Journal fidelity --------------------------------------------------------------------------------------


def test_journal__a_rebuilt_request_sends_the_models_tool_input_byte_for_byte(fake):
    failures: list[int] = []

    @tool(name="find")
    def find(zone: str, area: str) -> dict[str, Any]:
        """Find a place."""
        if len(failures) < 1 and zone == "second":
            failures.append(1)
            raise RetryableError("down")
        return {"found": True}

    workflow("finds", steps=[agent("assistant", instructions="Find.", tools=[find], prompt=lambda ctx: "go")])
    # Keys in the model's order, not sorted: jsonb would send {"area": ..., "zone": ...} back.
    fake.responder = scripted(
        Reply.tool_use("find", {"zone": "first", "area": "x"}),
        Reply.tool_use("find", {"zone": "second", "area": "y"}),
        Reply.text("Done."),
    )
    run = finish(api.start("finds", {}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    before, again = sent(fake)[1], sent(fake)[2]
    assert json.dumps(unmarked(again.messages[:3])) == json.dumps(unmarked(before.messages[:3])), (
        "the rebuilt conversation is byte-identical (cache breakpoints aside: they are not part of the prompt)"
    )
    use = next(b for b in again.messages[1]["content"] if b["type"] == "tool_use")
    assert list(use["input"]) == ["zone", "area"]


def test_compaction__under_extended_thinking_on_an_older_model_the_kept_turns_keep_their_thinking(fake):
    # Haiku 4.5 runs no prefix check, and under `enabled` thinking the last tool-use turn must go back with its
    # thinking block first (https://platform.claude.com/docs/en/build-with-claude/extended-thinking).
    workflow(
        "long_on_haiku",
        steps=[
            agent(
                "assistant",
                instructions="Fetch orders.",
                tools=[fetch_history],
                prompt=lambda ctx: "Fetch A-0, A-1, B-0, B-1.",
                model="claude-haiku-4-5",
                thinking={"type": "enabled", "budget_tokens": 2048},
                compact_at_prompt_tokens=1000,
                keep_recent_turns=1,
            )
        ],
    )
    fake.responder = scripted(*[Reply.tool_use("fetch_history", {"order_id": o}) for o in ("A-0", "A-1", "B-0", "B-1")])
    run = finish(api.start("long_on_haiku", {}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert Event.objects.filter(run=run, kind="compacted").count() == 1
    turns = [[b["type"] for b in m["content"]] for m in sent(fake)[-1].messages if m["role"] == "assistant"]
    assert turns == [["thinking", "tool_use"], ["thinking", "tool_use"]], "the kept turn keeps its thinking"


def test_cache_ttl__changed_while_a_run_is_in_flight_marks_the_frozen_head_at_the_new_ttl(fake, settings):
    # A 1 h breakpoint may not follow a 5 min one (https://platform.claude.com/docs/en/build-with-claude/prompt-caching).
    failures: list[int] = []

    def flaky_find(order_id: str) -> dict[str, Any]:
        if not failures:
            failures.append(1)
            raise RetryableError("down")
        return {"order_id": order_id}

    located = tool(flaky_find, name="flaky_find", description="Find an order.")
    workflow("ttl_changes", steps=[agent("assistant", instructions="Find.", tools=[located], prompt=lambda ctx: "A")])
    fake.responder = scripted(Reply.tool_use("flaky_find", {"order_id": "A-1"}))
    run = api.start("ttl_changes", {})
    advance(run.id)
    assert failures, "the first execution stopped in the tool, its head frozen at the 5 min TTL"
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "PROMPT_CACHE_TTL": "1h"}
    run = finish(run.id)

    assert run.status == RunStatus.COMPLETED, run.error
    last = sent(fake)[-1].body
    assert last["tools"][-1]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
