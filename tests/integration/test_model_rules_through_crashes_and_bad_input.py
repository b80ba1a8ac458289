"""The model rules through crashes between two writes, hostile answers, swaps, old data and hostile settings.

Every test runs the real SDK against the strict stand-in (durable_agents.testing.fake_anthropic) and asserts, as
the pattern file does, that the stand-in refused nothing the engine sent: a refused request is one the real API
would refuse too. Crashes are simulated without timing: a 529 served by the stand-in (a retryable error, so the
step is re-executed from its journal), or a tool raising RetryableError once.

Each hole an attack found is a test here, fixed since: a verdict outside its schema, a judge resumed after its
asks ran out, a tool removed by a deploy after its effect landed, a turn journaled before the head was frozen, a
typo on the default model, a non-positive max_tokens, a MODELS row or price of the wrong shape at run time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from django.conf import settings as django_settings
from django.test import override_settings

from durable_agents import api
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.loop import agent
from durable_agents.agents.participants import participants
from durable_agents.engine.advance import advance
from durable_agents.errors import DefinitionError, RetryableError
from durable_agents.judge import judge
from durable_agents.models import Event, RunStatus, Step, Turn
from durable_agents.planner import planner
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, RecordedRequest, Reply
from durable_agents.tools import tool
from durable_agents.workflows import workflow
from tests.integration.stand_in import API_KEY, claude_on_the_stand_in, finish, is_compaction, refused, scripted, sent

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fake(isolated_registries) -> Iterator[FakeAnthropic]:
    """The stand-in; each test checks `refused(fake)` itself, so an expected refusal fails only its assertion."""
    with claude_on_the_stand_in() as server:
        yield server


def answered(fake: FakeAnthropic) -> list[RecordedRequest]:
    """Requests the stand-in answered with a message (billed): neither refused nor served a fault."""
    return [r for r in sent(fake) if not r.refused]


def transient() -> Fault:
    """A crash after the last journaled write: the step fails retryably and is re-executed from its journal."""
    return Fault.status(529)


def roles_alternate(request: RecordedRequest) -> bool:
    roles = [m["role"] for m in request.messages]
    return roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:], strict=False))


def with_settings(**overrides: Any) -> Any:
    return override_settings(DURABLE_AGENTS={**django_settings.DURABLE_AGENTS, **overrides})


CALLS: list[str] = []


@tool
def look_up(order_id: str) -> dict[str, Any]:
    """Look an order up."""
    CALLS.append(order_id)
    return {"order_id": order_id, "amount": "30.00"}


def agent_workflow(name: str, **options: Any) -> None:
    options.setdefault("tools", [look_up])
    workflow(
        name,
        steps=[agent("assistant", instructions="Look orders up.", prompt=lambda ctx: "A-1", **options)],
    )


VERDICT = {"passed": True, "score": 0.9, "reasons": "polite"}


# --- Judges: crashes between asks, odd answers -----------------------------------------------------------------


def test_judge__a_crash_between_two_asks_replays_the_first_answer_byte_for_byte(fake):
    workflow("judged_crash", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(Reply.text("It reads politely."), transient(), Reply.tool_use("submit_verdict", VERDICT))
    run = finish(api.start("judged_crash", {}).id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    first, crashed, again = sent(fake)
    assert json.dumps(again.messages) == json.dumps(crashed.messages), "the re-executed ask is the same request"
    assert len(answered(fake)) == 3 and Turn.objects.filter(run=run).count() == 2


def test_judge__redefined_between_asks_sends_its_frozen_head(fake):
    def define(rubric: str) -> None:
        workflow(
            "judged_redefined", replace=True, steps=[judge("review", rubric=rubric, subject=lambda ctx: "Dear Ann.")]
        )

    define("Polite.")
    fake.enqueue(Reply.text("It reads politely."), transient())
    run = api.start("judged_redefined", {})
    advance(run.id)
    define("Polite and short.")  # a deploy between the two asks
    fake.enqueue(Reply.tool_use("submit_verdict", VERDICT))
    run = finish(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert sent(fake)[-1].body["system"] == sent(fake)[0].body["system"]


def test_judge__parallel_verdict_calls_with_an_invalid_first_are_answered_and_asked_again(fake):
    workflow("judged_parallel", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(
        Reply.parallel_tool_use(("submit_verdict", {"score": 1, "reasons": "no passed"}), ("submit_verdict", VERDICT)),
        Reply.tool_use("submit_verdict", VERDICT),
    )
    run = finish(api.start("judged_parallel", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert run.output == VERDICT
    assert len(sent(fake)[1].tool_results) == 2, "every call of the turn gets its tool_result"


@pytest.mark.parametrize("bad", [{"passed": True, "score": 2, "reasons": "x"}, {"passed": False, "score": 0.1}])
def test_judge__a_verdict_outside_its_schema_is_asked_again(fake, bad):
    workflow("judged_schema", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(Reply.tool_use("submit_verdict", bad), Reply.tool_use("submit_verdict", VERDICT))
    run = finish(api.start("judged_schema", {}).id)
    assert not refused(fake), refused(fake)
    assert run.status == RunStatus.COMPLETED and run.output == VERDICT, (run.status, run.output, run.error)


def test_judge__a_call_of_another_tool_is_answered_and_asked_again(fake):
    workflow("judged_other", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(Reply.tool_use("search", {"q": "politeness"}), Reply.tool_use("submit_verdict", VERDICT))
    run = finish(api.start("judged_other", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    second = sent(fake)[1]
    assert second.tool_results and second.tool_results[0]["is_error"]


def test_judge__an_answer_of_only_thinking_is_asked_again(fake):
    workflow("judged_thought", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(Reply(content=[], stop_reason="end_turn"), Reply.tool_use("submit_verdict", VERDICT))
    run = finish(api.start("judged_thought", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)


def test_judge__max_tokens_inside_its_text_is_asked_again(fake):
    workflow("judged_cut", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(Reply.text("The verdict is", stop_reason="max_tokens"), Reply.tool_use("submit_verdict", VERDICT))
    run = finish(api.start("judged_cut", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert roles_alternate(sent(fake)[-1])


def test_judge__truncated_to_its_limit_then_a_resume_asks_again(fake):
    workflow("judged_truncated", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.responder = lambda request: Reply.truncated_tool_use("submit_verdict", {"passed": True})
    run = finish(api.start("judged_truncated", {}).id)
    assert run.status == RunStatus.FAILED and "resume the run" in run.error["message"], run.error
    asked = len(sent(fake))

    fake.responder = lambda request: Reply.tool_use("submit_verdict", VERDICT)
    api.resume(run.id)
    run = finish(run.id)
    assert len(sent(fake)) > asked, "the resume the error message advises never asks the model again"
    assert run.status == RunStatus.COMPLETED, run.error


def test_judge__a_refusal_on_its_last_ask_then_a_resume_asks_again(fake):
    workflow("judged_refused", steps=[judge("review", rubric="Polite.", subject=lambda ctx: "Dear Ann.")])
    fake.enqueue(Reply.text("Polite enough."), Reply.text("Still polite."), Reply.refusal("cyber"))
    run = finish(api.start("judged_refused", {}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRefusalError", run.error
    asked = len(sent(fake))

    fake.enqueue(Reply.tool_use("submit_verdict", VERDICT))
    api.resume(run.id)
    run = finish(run.id)
    assert len(sent(fake)) > asked, "a resume after a refusal asks the model again"
    assert run.status == RunStatus.COMPLETED, run.error


def test_planner__a_crash_between_two_asks_replays_the_first_answer(fake):
    CALLS.clear()
    workflow("planned_crash", steps=[planner("plan", instructions="Plan it.", tools=[look_up])])
    fake.enqueue(
        Reply.tool_use("submit_plan", {"steps": [{"tool": "nope", "args": {}}]}),
        transient(),
        Reply.tool_use("submit_plan", {"steps": [{"tool": "look_up", "args": {"order_id": "A-1"}}]}),
    )
    run = finish(api.start("planned_crash", {"order": "A-1"}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert CALLS == ["A-1"]
    assert len(sent(fake)) == 3


# --- Agents: a crash between two writes --------------------------------------------------------------------------


def test_truncated_tool_call__a_crash_after_it_is_journaled_asks_again_with_twice_the_max_tokens(fake):
    CALLS.clear()
    agent_workflow("truncated_crash", max_tokens=1000)
    fake.responder = scripted(
        Reply.truncated_tool_use("look_up", {"order_id": "A-"}),
        transient(),
        Reply.tool_use("look_up", {"order_id": "A-1"}),
        Reply.text("Done."),
    )
    run = finish(api.start("truncated_crash", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert [r.body["max_tokens"] for r in sent(fake)] == [1000, 2000, 2000, 1000]
    assert CALLS == ["A-1"]


def test_first_turn__a_crash_after_it_froze_the_head_sends_the_same_head(fake):
    CALLS.clear()
    failures: list[int] = []

    @tool(name="find")
    def find(order_id: str) -> dict[str, Any]:
        """Find an order."""
        if not failures:
            failures.append(1)
            raise RetryableError("down")
        return {"found": order_id}

    workflow(
        "head_crash",
        steps=[agent("assistant", instructions="Find.", tools=[find])],  # default prompt: the input as JSON
    )
    fake.responder = scripted(Reply.tool_use("find", {"order_id": "A-1"}), Reply.text("Done."))
    run = finish(api.start("head_crash", {"zeta": 1, "alpha": {"b": 2, "a": 1}}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    first, last = sent(fake)[0], sent(fake)[-1]
    assert first.messages[0]["content"][0]["text"] == last.messages[0]["content"][0]["text"]


def test_refusal__a_crash_after_the_fallback_answered_replays_it_on_the_fallback(fake):
    CALLS.clear()
    failures: list[int] = []

    @tool(name="find")
    def find(order_id: str) -> dict[str, Any]:
        """Find an order."""
        CALLS.append(order_id)
        if order_id == "A-2" and not failures:
            failures.append(1)
            raise RetryableError("down")
        return {"found": order_id}

    workflow(
        "fallback_crash",
        steps=[
            agent(
                "assistant",
                instructions="Find.",
                tools=[find],
                prompt=lambda ctx: "A-1",
                fallback_model="claude-opus-5-5",
            )
        ],
    )
    fake.responder = scripted(
        Reply.tool_use("find", {"order_id": "A-1"}),
        Reply.refusal("frontier_llm"),
        Reply.tool_use("find", {"order_id": "A-2"}),
        Reply.tool_use("find", {"order_id": "A-3"}),
        Reply.text("Done."),
    )
    run = finish(api.start("fallback_crash", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert [r.body["model"] for r in sent(fake)] == ["claude-sonnet-5-5"] * 2 + ["claude-opus-5-5"] * 3
    assert CALLS == ["A-1", "A-2", "A-2", "A-3"]
    last = sent(fake)[-1]
    kept = [b for m in last.messages if m["role"] == "assistant" for b in m["content"] if b["type"] == "thinking"]
    assert len(kept) == 2, "the fallback's own thinking blocks (turns 2 and 3) go back to it"


def test_context_window_exceeded__a_crash_after_the_compaction_compacts_once_and_asks_once(fake):
    agent_workflow("overflow_crash", keep_recent_turns=1)
    fake.responder = scripted(
        Reply.tool_use("look_up", {"order_id": "A-1"}),
        Reply.tool_use("look_up", {"order_id": "A-2"}),
        Reply.context_window_exceeded(),
        transient(),  # the ask after the compaction
        Reply.text("Done."),
    )
    run = finish(api.start("overflow_crash", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert Event.objects.filter(run=run, kind="compacted").count() == 1
    assert sum(1 for r in sent(fake) if is_compaction(r)) == 1
    assert run.output["text"] == "Done."


def test_context_window_exceeded__a_crash_in_the_compaction_call_compacts_on_the_next_attempt(fake):
    agent_workflow("overflow_compaction_crash", keep_recent_turns=1)
    compactions: list[int] = []
    queue = [
        Reply.tool_use("look_up", {"order_id": "A-1"}),
        Reply.tool_use("look_up", {"order_id": "A-2"}),
        Reply.context_window_exceeded(),
        Reply.text("Done."),
    ]

    def answer(request: RecordedRequest) -> Reply | Fault:
        if is_compaction(request):
            compactions.append(1)
            return transient() if len(compactions) == 1 else Reply.text("Summary.")
        return queue.pop(0) if queue else Reply.text("done")

    fake.responder = answer
    run = finish(api.start("overflow_compaction_crash", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert Event.objects.filter(run=run, kind="compacted").count() == 1
    assert run.output["text"] == "Done."
    assert sum(1 for r in sent(fake) if not is_compaction(r)) == 4, "the overflowed turn is not asked twice"


def test_max_tokens__text_cut_twice_then_a_tool_call_on_a_thinking_model(fake):
    CALLS.clear()
    agent_workflow("cut_cut_call")
    fake.responder = scripted(
        Reply.text("Part one, ", stop_reason="max_tokens"),
        Reply.text("part two, ", stop_reason="max_tokens"),
        Reply.tool_use("look_up", {"order_id": "A-1"}),
        Reply.text("All done."),
    )
    run = finish(api.start("cut_cut_call", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert all(roles_alternate(r) for r in sent(fake))
    assert run.output["text"] == "All done."


def test_max_tokens__a_text_cut_twice_then_ended_is_the_whole_answer(fake):
    agent_workflow("cut_cut_end")
    fake.responder = scripted(
        Reply.text("Part one, ", stop_reason="max_tokens"),
        transient(),
        Reply.text("part two, ", stop_reason="max_tokens"),
        Reply.text("end."),
    )
    run = finish(api.start("cut_cut_end", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert run.output["text"] == "Part one, part two, end."


def test_max_tokens__continued_by_prefill_on_a_model_that_takes_one(fake):
    agent_workflow("cut_prefill", model="claude-haiku-4-5")
    fake.responder = scripted(
        Reply.text("Part one, ", stop_reason="max_tokens"),
        Reply.text("part two.", stop_reason="end_turn"),
    )
    run = finish(api.start("cut_prefill", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert sent(fake)[-1].messages[-1]["role"] == "assistant"
    assert run.output["text"] == "Part one, part two."


# --- Thinking blocks across models ----------------------------------------------------------------------------


def test_fallback__a_dated_snapshot_and_its_alias_keep_each_others_thinking(fake):
    agent_workflow(
        "dated",
        model="claude-haiku-4-5-20251001",
        thinking={"type": "enabled", "budget_tokens": 2048},
        max_tokens=4096,
        fallback_model="claude-haiku-4-5",
    )
    fake.responder = scripted(
        Reply.tool_use("look_up", {"order_id": "A-1"}), Reply.refusal("frontier_llm"), Reply.text("Done.")
    )
    run = finish(api.start("dated", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert not Event.objects.filter(run=run, kind="thinking_dropped").exists()


def test_fallback__back_and_forth_between_models_sends_only_readable_thinking(fake):
    # Sonnet 5.5 answers, refuses; Opus 5.5 (the fallback) answers twice with a compaction in between.
    agent_workflow("fallback_compacts", fallback_model="claude-opus-5-5", keep_recent_turns=1)
    fake.responder = scripted(
        Reply.tool_use("look_up", {"order_id": "A-1"}),
        Reply.tool_use("look_up", {"order_id": "A-2"}),
        Reply.refusal("frontier_llm"),
        Reply.tool_use("look_up", {"order_id": "A-3"}),
        Reply.context_window_exceeded(),
        Reply.text("Done."),
    )
    run = finish(api.start("fallback_compacts", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert fake.dropped_thinking == [], "nothing the model cannot read is sent to it"


# --- The frozen head and deploys --------------------------------------------------------------------------------

REFUNDS: list[str] = []


def test_deploy__a_tool_removed_after_its_effect_landed_reports_the_effect_not_unknown_tool(fake):
    REFUNDS.clear()
    failures: list[int] = []

    @tool(name="refund", effectful=True)
    def refund(order_id: str, idempotency_key: str) -> dict[str, Any]:
        """Refund an order."""
        REFUNDS.append(order_id)
        return {"refunded": order_id}

    @tool(name="notify_customer")
    def notify(order_id: str) -> dict[str, Any]:
        """Tell the customer."""
        if not failures:
            failures.append(1)
            raise RetryableError("mail is down")
        return {"sent": order_id}

    def define(tools: list[Any]) -> None:
        workflow(
            "deployed_without",
            replace=True,
            steps=[agent("assistant", instructions="Refund.", tools=tools, prompt=lambda ctx: "A-1")],
        )

    define([refund, notify])
    fake.responder = scripted(
        Reply.parallel_tool_use(("refund", {"order_id": "A-1"}), ("notify_customer", {"order_id": "A-1"})),
        Reply.text("Done."),
    )
    run = api.start("deployed_without", {})
    advance(run.id)
    assert REFUNDS == ["A-1"] and failures, "the refund landed, the notification failed: the step is retried"
    define([notify])  # a deploy removes the refund tool
    run = finish(run.id)
    assert not refused(fake), refused(fake)
    result = next(
        b for b in sent(fake)[-1].tool_results if b["tool_use_id"] == sent(fake)[-1].messages[1]["content"][-2]["id"]
    )
    assert not result.get("is_error"), f"the model is told its refund failed though it landed: {result}"


def test_deploy__a_tool_whose_description_changed_keeps_the_frozen_tools_in_the_request(fake):
    failures: list[int] = []

    def locate(order_id: str) -> dict[str, Any]:
        if not failures:
            failures.append(1)
            raise RetryableError("down")
        return {"order_id": order_id}

    def define(description: str) -> None:
        located = tool(locate, name="locate_order", description=description)
        workflow(
            "schema_changed",
            replace=True,
            steps=[agent("assistant", instructions="Find.", tools=[located], prompt=lambda ctx: "A-1")],
        )

    define("Locate an order.")
    fake.responder = scripted(Reply.tool_use("locate_order", {"order_id": "A-1"}), Reply.text("Done."))
    run = api.start("schema_changed", {})
    advance(run.id)
    define("Locate an order by id.")
    run = finish(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert json.dumps(sent(fake)[-1].body["tools"]) == json.dumps(sent(fake)[0].body["tools"])


def test_deploy__a_turn_journaled_before_the_change_is_sent_back_as_the_api_accepts(fake):
    CALLS.clear()
    with with_settings(PROMPT_CACHE_TTL=None):
        agent_workflow("old_run")
        run = api.start("old_run", {})
        step = Step.objects.get(run_id=run.id, step_id="assistant")
        # Turn 0 as the code before the change asked for it and journaled it: the prompt a plain string.
        fake.enqueue(Reply.tool_use("look_up", {"order_id": "A-1"}))
        message = fake.client(max_retries=0).messages.create(
            model="claude-sonnet-5-5",
            max_tokens=8192,
            system="Look orders up.",
            tools=[look_up.anthropic_schema()],
            messages=[{"role": "user", "content": "A-1"}],
        )
        Turn.objects.create(
            run_id=run.id,
            step=step,
            index=0,
            purpose="turn",
            request_digest="before the change",
            content=[b.model_dump(mode="json", exclude_none=True) for b in message.content],
            stop_reason=message.stop_reason,
            model=message.model,
            participant="anthropic",
        )
        assert Step.objects.get(pk=step.pk).frozen_request is None
        fake.enqueue(Reply.text("Done."))
        run = finish(run.id)
    assert not refused(fake), refused(fake)
    assert run.status == RunStatus.COMPLETED, run.error
    assert CALLS == ["A-1"]


def test_deploy__a_turn_journaled_before_the_change_with_caching_on_is_accepted(fake):
    CALLS.clear()
    agent_workflow("old_run_cached")
    run = api.start("old_run_cached", {})
    step = Step.objects.get(run_id=run.id, step_id="assistant")
    # With caching on, the old code marked the last user message: the prompt went as a block, as it does now.
    fake.enqueue(Reply.tool_use("look_up", {"order_id": "A-1"}))
    schema = look_up.anthropic_schema()
    message = fake.client(max_retries=0).messages.create(
        model="claude-sonnet-5-5",
        max_tokens=8192,
        system=[{"type": "text", "text": "Look orders up.", "cache_control": {"type": "ephemeral"}}],
        tools=[{**schema, "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "A-1", "cache_control": {"type": "ephemeral"}}]}
        ],
    )
    Turn.objects.create(
        run_id=run.id,
        step=step,
        index=0,
        purpose="turn",
        request_digest="before the change",
        content=[b.model_dump(mode="json", exclude_none=True) for b in message.content],
        stop_reason=message.stop_reason,
        model=message.model,
        participant="anthropic",
    )
    fake.enqueue(Reply.text("Done."))
    run = finish(run.id)
    assert not refused(fake), refused(fake)
    assert run.status == RunStatus.COMPLETED, run.error


# --- Hostile definitions and settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"max_tokens": 0},
        {"max_tokens": -1},
        {"model": "claude-sonnet-5-5", "max_tokens": 10_000_000},
    ],
)
def test_agent__a_hostile_model_choice_is_a_definition_error(options, isolated_registries):
    with pytest.raises(DefinitionError):
        agent("assistant", instructions="x", **options)


@pytest.mark.parametrize("options", [{"thinking": "adaptive "}, {"effort": "MAX"}])
def test_agent__a_model_independent_typo_on_the_default_model_is_a_definition_error(options, isolated_registries):
    with pytest.raises(DefinitionError):
        agent("assistant", instructions="x", **options)


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_judge__a_non_positive_max_tokens_is_a_definition_error(max_tokens, isolated_registries):
    with pytest.raises(DefinitionError):
        judge("review", rubric="x", subject=lambda ctx: "y", max_tokens=max_tokens)


def test_planner__a_non_positive_max_tokens_is_a_definition_error(isolated_registries):
    with pytest.raises(DefinitionError):
        planner("plan", instructions="x", tools=[look_up], max_tokens=0)


def test_fallback_model__equal_to_the_model_fails_the_refusal_clearly(fake):
    agent_workflow("same_fallback", model="claude-sonnet-5-5", fallback_model="claude-sonnet-5-5")
    fake.enqueue(Reply.refusal("cyber"))
    run = finish(api.start("same_fallback", {}).id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRefusalError", run.error
    assert len(sent(fake)) == 1


def test_models_setting__a_bad_price_row_at_run_time_never_loses_a_billed_answer(fake):
    agent_workflow("bad_prices")
    with with_settings(MODELS={"claude-sonnet-5-5": {"prices": [1.0, 2.0]}}):
        run = finish(api.start("bad_prices", {}).id)
    billed = len(answered(fake))
    assert billed >= 1
    assert (
        Turn.objects.filter(run=run).count() + Event.objects.filter(run=run, kind="unjournaled_usage").count() >= billed
    ), "every answered (billed) request is journaled or counted"
    assert billed == 1, f"the model was asked {billed} times for turn 0"


@pytest.mark.parametrize("row", [{"context_window": None}, {"prefix_check": "no"}])
def test_models_setting__a_harmless_bad_row_at_run_time_still_runs(fake, row):
    agent_workflow("bad_row")
    with with_settings(MODELS={"claude-sonnet-5-5": row}):
        run = finish(api.start("bad_row", {}).id)
    assert not refused(fake), refused(fake)
    assert run.status == RunStatus.COMPLETED, run.error


@pytest.mark.parametrize("row", [{"max_output": "64000"}, {"max_output": 0}, {"bogus": 1}])
def test_models_setting__a_bad_row_at_run_time_fails_the_run_clearly_without_asking(fake, row):
    agent_workflow("bad_row")
    with with_settings(MODELS={"claude-sonnet-5-5": row}):
        run = finish(api.start("bad_row", {}).id)
    assert not refused(fake), f"a request built from a bad row reached the API: {refused(fake)}"
    assert run.status in (RunStatus.COMPLETED, RunStatus.FAILED), run.status
    if run.status == RunStatus.FAILED:
        assert "MODELS" in run.error["message"], f"the error names the setting to fix: {run.error}"


def test_truncated_thinking__an_answer_cut_inside_its_thinking_is_asked_again_after_a_crash(fake):
    CALLS.clear()
    agent_workflow("thought_cut", max_tokens=1000)
    fake.responder = scripted(
        Reply(content=[], stop_reason="max_tokens"),  # served as a lone thinking block: cut inside its thinking
        transient(),
        Reply.tool_use("look_up", {"order_id": "A-1"}),
        Reply.text("Done."),
    )
    run = finish(api.start("thought_cut", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert [r.body["max_tokens"] for r in sent(fake)] == [1000, 2000, 2000, 1000]
    assert run.output["text"] == "Done." and CALLS == ["A-1"]


def test_swap_participant__mid_run_keeps_the_conversation_the_api_accepts(fake):
    CALLS.clear()
    failures: list[int] = []

    @tool(name="seek_order")
    def find(order_id: str) -> dict[str, Any]:
        """Find an order."""
        CALLS.append(order_id)
        if not failures:
            failures.append(1)
            raise RetryableError("down")
        return {"found": order_id}

    other = anthropic.Anthropic(api_key=API_KEY, base_url=fake.url, max_retries=0, timeout=5.0)
    participants.register("anthropic_b", AnthropicParticipant(client=other))
    workflow("swapped", steps=[agent("assistant", instructions="Find.", tools=[find], prompt=lambda ctx: "A-1")])
    fake.responder = scripted(Reply.tool_use("seek_order", {"order_id": "A-1"}), Reply.text("Done."))
    run = api.start("swapped", {})
    advance(run.id)
    api.swap_participant(run.id, "anthropic_b", actor="ops")
    run = finish(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    assert not refused(fake), refused(fake)
    assert len(sent(fake)) == 2, "the swap asks only for the turn not journaled yet"
    assert Event.objects.filter(run=run, kind="participant_swapped").count() == 1
