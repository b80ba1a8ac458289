"""The spans inside and around a run's steps: model calls, tool calls and effects, waits, operator actions, the sweep.

Checked against OpenTelemetry's GenAI semantic conventions (opentelemetry-semantic-conventions 0.66b2,
`opentelemetry.semconv._incubating.attributes.gen_ai_attributes`): a model call is an inference span named
`{gen_ai.operation.name} {gen_ai.request.model}` ("chat claude-..."), SpanKind CLIENT, with `gen_ai.provider.name`
"anthropic" (GenAiProviderNameValues.ANTHROPIC), `gen_ai.request.model`, `gen_ai.request.max_tokens`,
`gen_ai.response.model`, `gen_ai.response.id`, `gen_ai.response.finish_reasons` (a string array),
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`, `gen_ai.usage.cache_read.input_tokens`,
`gen_ai.usage.cache_creation.input_tokens`, `server.address` (server_attributes.SERVER_ADDRESS) and, on failure,
`error.type` (error_attributes.ERROR_TYPE). A tool call is an `execute_tool {gen_ai.tool.name}` span with
`gen_ai.operation.name` "execute_tool" and `gen_ai.tool.call.id`. Prompts, answers and tool arguments
(`gen_ai.input.messages`, `gen_ai.output.messages`, `gen_ai.tool.call.arguments`, `gen_ai.tool.call.result`) are
opt-in content in the conventions: here only with DURABLE_AGENTS["TRACE_CONTENT"], redacted.

The model is the project's fake Messages API server, spoken to through the real SDK; runs are driven in this
process (`drive`), and the spans read back from the OpenTelemetry SDK's in-memory exporter.
"""

from __future__ import annotations

import itertools
from decimal import Decimal
from typing import Any

import anthropic
import pytest
from opentelemetry.trace import SpanKind, StatusCode

from durable_agents import api
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants
from durable_agents.engine.sweep import sweep
from durable_agents.errors import RetryableError, ToolFailedError
from durable_agents.models import Turn, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.testing.fake_anthropic import FakeAnthropic, Reply
from durable_agents.testing.fake_replies import tool_use_block
from durable_agents.tools import tool
from durable_agents.workflows import registry, workflow
from tests.integration.batch_helpers import settle
from tests.testapp.models import LedgerEntry
from tests.testapp.workflows import charge

pytestmark = pytest.mark.django_db(transaction=True)

API_KEY = "sk-ant-test-secret-0123456789"
MODEL = "claude-sonnet-5-5"
# A secret the redaction knows by its shape (`password=...`), planted in what the model is asked and in a tool's
# arguments.
SECRET = "hunter2-very-secret"
_flaky_calls = itertools.count()


@tool(name="traced_refund", effectful=True, transactional=True, needs_approval=True)
def traced_refund(order_id: str, amount: Decimal, *, idempotency_key: str) -> dict[str, Any]:
    """Refund an order (a human approves it first)."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=-amount, kind="refund")
    return {"refunded": str(amount)}


@tool(name="traced_charge", effectful=True, transactional=True)
def traced_charge(order_id: str, note: str = "", *, idempotency_key: str) -> dict[str, Any]:
    """Charge an order."""
    LedgerEntry.objects.create(idempotency_key=idempotency_key, order_id=order_id, amount=Decimal(1), kind="charge")
    return {"charged": order_id}


@tool(name="traced_flaky", parallel_safe=False)
def traced_flaky(order_id: str) -> dict[str, Any]:
    """Look something up; the first call of the process fails for a moment."""
    if next(_flaky_calls) == 0:
        raise RetryableError("the lookup service blinked")
    return {"order_id": order_id}


@tool(name="traced_picky")
def traced_picky(order_id: str) -> dict[str, Any]:
    """Look an order up; it never finds one, and says which it looked for."""
    raise ToolFailedError(f"no order {order_id}")


@pytest.fixture
def fake():
    with FakeAnthropic() as server:
        yield server


@pytest.fixture
def model(fake):
    """The 'anthropic' participant of this process talks to the fake server through the real SDK."""
    client = anthropic.Anthropic(api_key=API_KEY, base_url=fake.url, max_retries=0, timeout=5.0)
    previous = participants._participants.get("anthropic")
    participants.register("anthropic", AnthropicParticipant(client=client))
    yield fake
    if previous is None:
        participants._participants.pop("anthropic", None)
    else:
        participants.register("anthropic", previous)


@pytest.fixture
def traced_workflows():
    workflow(
        "traced_agent",
        steps=[
            api.agent(
                "assistant",
                instructions="You refund orders.",
                tools=[traced_refund, traced_charge, traced_flaky, traced_picky, charge],
                prompt=lambda ctx: ctx.input["message"],
                model=MODEL,
                max_tokens=512,
            )
        ],
        replace=True,
    )
    yield
    registry.unregister("traced_agent")


@pytest.fixture
def traced(spans):  # noqa: F811 - the fixture imported above
    """The spans of this test (tracing on, the SDK's in-memory exporter)."""
    return spans


def tool_reply(*calls: tuple[str, dict[str, Any], str]) -> Reply:
    return Reply(
        content=[tool_use_block(name, args, id=use_id) for name, args, use_id in calls], stop_reason="tool_use"
    )


def attributes(span) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_spans__an_agent_run_with_a_tool_and_an_approval_draws_one_tree(traced, model, traced_workflows):
    """run -> step attempts -> chat spans (GenAI attributes, SpanKind CLIENT) and an execute_tool span with the
    effect's outcome; the approval's `wait approval` span, drawn once decided, sits under the run span."""
    model.enqueue(
        tool_reply(("traced_refund", {"order_id": "R-1", "amount": "80.00"}, "toolu_refund")),
        Reply.text("Refunded 80.00."),
    )
    run = api.start("traced_agent", {"message": "Refund R-1."})
    assert drive(run.id).status == "waiting"
    wait = Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN)
    api.decide(wait.pk, True, by="ann", via="api")
    assert drive(run.id).status == "completed"

    root = traced.one("run traced_agent")
    assert root.parent is None
    steps = traced.named("step assistant")
    assert len(steps) == 2 and all(traced.parent_of(s) is root for s in steps)
    parked, finished = sorted(steps, key=lambda s: s.start_time)
    assert any(
        e.name == "wait opened" and e.attributes["durable_agents.wait.kind"] == "approval" for e in parked.events
    )

    chats = traced.named(f"chat {MODEL}")
    assert [traced.parent_of(c) for c in chats] == [parked, finished], "the journaled turn 0 is not asked again"
    assert any(
        e.name == "model turn replayed from journal" and e.attributes["durable_agents.model.turn"] == 0
        for e in finished.events
    )
    first = chats[0]
    assert first.kind == SpanKind.CLIENT
    got = attributes(first)
    assert got["gen_ai.operation.name"] == "chat"
    assert got["gen_ai.provider.name"] == "anthropic"
    assert got["gen_ai.request.model"] == MODEL and got["gen_ai.response.model"] == MODEL
    assert got["gen_ai.request.max_tokens"] == 512
    assert got["gen_ai.response.id"].startswith("msg_")
    assert list(got["gen_ai.response.finish_reasons"]) == ["tool_use"]
    assert got["gen_ai.usage.input_tokens"] > 0 and got["gen_ai.usage.output_tokens"] > 0
    assert "gen_ai.usage.cache_read.input_tokens" in got and "gen_ai.usage.cache_creation.input_tokens" in got
    assert got["server.address"] == "127.0.0.1"
    assert got["gen_ai.conversation.id"] == str(run.id)
    assert got["durable_agents.cost_usd"] == float(Turn.objects.get(run_id=run.id, index=0).cost_usd) > 0

    refund = traced.one("execute_tool traced_refund")
    assert traced.parent_of(refund) is finished
    got = attributes(refund)
    assert got["gen_ai.operation.name"] == "execute_tool"
    assert got["gen_ai.tool.name"] == "traced_refund" and got["gen_ai.tool.call.id"] == "toolu_refund"
    assert got["durable_agents.effect.outcome"] == "applied"
    assert got["durable_agents.effect.key"].endswith("toolu_refund")

    waited = traced.one("wait approval")
    assert traced.parent_of(waited) is root
    got = attributes(waited)
    assert got["durable_agents.wait.id"] == wait.pk
    assert got["durable_agents.wait.decision"] == "approved"
    assert got["durable_agents.wait.decided_by"] == "ann" and got["durable_agents.wait.via"] == "api"
    assert waited.start_time <= waited.end_time
    assert traced.orphans() == []
    assert {s.context.trace_id for s in traced.all} == {root.context.trace_id}
    # One CLIENT span per model call: the SDK's own (anthropic.messages.create) is turned off while ours is on.
    assert [s.name for s in traced.all if s.kind == SpanKind.CLIENT] == [c.name for c in chats]


def test_spans__a_failed_model_call_says_its_http_status(traced, model, traced_workflows):
    """`error.type` of a failed inference span: the HTTP status the API answered (GenAI conventions, error.type)."""
    from durable_agents.testing.fake_anthropic import Fault

    model.enqueue(Fault.status(500), Reply.text("done"))
    run = api.start("traced_agent", {"message": "Hello."})
    assert drive(run.id).status == "completed"
    failed, answered = traced.named(f"chat {MODEL}")
    assert failed.status.status_code == StatusCode.ERROR and attributes(failed)["error.type"] == "500"
    assert answered.status.status_code == StatusCode.UNSET
    assert traced.orphans() == []


def test_spans__a_re_executed_step_reuses_its_applied_effect(traced, model, traced_workflows):
    """The step retried after a tool's transient error runs the turn's calls again: the applied effect's result is
    returned (outcome "reused"), not applied twice, and the journaled turn makes no second chat span."""
    model.enqueue(
        tool_reply(
            ("traced_charge", {"order_id": "C-1"}, "toolu_charge"),
            ("traced_flaky", {"order_id": "C-1"}, "toolu_flaky"),
        ),
        Reply.text("Charged."),
    )
    run = api.start("traced_agent", {"message": "Charge C-1."})
    assert drive(run.id).status == "completed"
    outcomes = [attributes(s)["durable_agents.effect.outcome"] for s in traced.named("execute_tool traced_charge")]
    assert outcomes == ["applied", "reused"]
    assert LedgerEntry.objects.filter(order_id="C-1", kind="charge").count() == 1
    assert len(traced.named(f"chat {MODEL}")) == 2, "turn 0 asked once, turn 1 once"
    flaky = traced.named("execute_tool traced_flaky")
    assert flaky[0].status.status_code == StatusCode.ERROR and attributes(flaky[0])["error.type"] == "RetryableError"
    assert traced.orphans() == []


def test_spans__parallel_tool_calls_nest_under_their_attempt(traced, model, traced_workflows):
    """Calls of one response run on threads of their own: each execute_tool span is still the attempt's child."""
    model.enqueue(
        tool_reply(
            ("traced_charge", {"order_id": "P-1"}, "toolu_p1"),
            ("traced_charge", {"order_id": "P-2"}, "toolu_p2"),
        ),
        Reply.text("Charged both."),
    )
    run = api.start("traced_agent", {"message": "Charge P-1 and P-2."})
    assert drive(run.id).status == "completed"
    step = traced.one("step assistant")
    calls = traced.named("execute_tool traced_charge")
    assert sorted(attributes(c)["gen_ai.tool.call.id"] for c in calls) == ["toolu_p1", "toolu_p2"]
    assert all(traced.parent_of(c) is step for c in calls)
    assert traced.orphans() == []


def test_spans__a_compensation_is_its_own_span(traced, model, traced_workflows):
    """Cancelled with compensation, the run undoes its charge: a `compensate charge` span, outcome "compensated",
    under the compensation step's attempt."""
    model.enqueue(
        tool_reply(("charge", {"order_id": "K-1", "amount": "30.00"}, "toolu_k1")),
        tool_reply(("traced_refund", {"order_id": "K-1", "amount": "5.00"}, "toolu_k2")),
    )
    run = api.start("traced_agent", {"message": "Charge K-1."})
    assert drive(run.id).status == "waiting"
    api.cancel(run.id, compensate=True, actor="ops")
    assert drive(run.id).status == "cancelled"
    undo = traced.one("compensate charge")
    assert attributes(undo)["durable_agents.effect.outcome"] == "compensated"
    assert traced.parent_of(undo).name.startswith("step ")
    assert traced.parent_of(traced.one("cancel run")) is traced.one("run traced_agent")
    assert traced.orphans() == []


def test_spans__a_turn_answered_in_a_message_batch(traced, batch_fake, batched_workflows):
    """A turn sent in a Message Batch: its chat span is drawn in the attempt that takes the answer up (marked
    batched, usage and cost at the batch price), and the run's `wait batch` span spans the time it waited."""
    batched_workflows(
        "traced_batched",
        [api.agent("assistant", instructions="Answer.", model=MODEL, max_tokens=256, delivery="batch")],
    )
    batch_fake.enqueue(Reply.text("Batched answer."))
    run = api.start("traced_batched", {})
    assert settle(batch_fake, run.id).status == "completed"
    chat = traced.one(f"chat {MODEL}")
    got = attributes(chat)
    assert got["durable_agents.model.batched"] is True
    assert got["gen_ai.usage.output_tokens"] > 0
    assert got["durable_agents.cost_usd"] == float(Turn.objects.get(run_id=run.id, index=0).cost_usd)
    assert traced.parent_of(chat).name == "step assistant"
    assert attributes(traced.one("wait batch"))["durable_agents.wait.decided_by"] == "batch"
    assert traced.orphans() == []


def test_spans__content_is_absent_by_default(traced, model, traced_workflows):
    """Prompts, answers and tool arguments are opt-in (gen_ai.input.messages, gen_ai.output.messages,
    gen_ai.tool.call.arguments, gen_ai.tool.call.result): off, no span or event carries them — not even the text of
    an exception event (exception.message, exception.stacktrace) of a tool whose error quotes its arguments."""
    model.enqueue(
        tool_reply(
            ("traced_charge", {"order_id": "S-1", "note": f"password={SECRET}"}, "toolu_s"),
            ("traced_picky", {"order_id": f"Z-{SECRET}"}, "toolu_picky"),
        ),
        Reply.text(f"Done, the password={SECRET}."),
    )
    run = api.start("traced_agent", {"message": f"Charge S-1, my password={SECRET}."})
    assert drive(run.id).status == "completed"
    content_keys = {
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
    }
    for span in traced.all:
        assert not content_keys & set(attributes(span)), span.name
        texts = [str(v) for v in attributes(span).values()]
        texts += [str(v) for event in span.events for v in (event.attributes or {}).values()]
        assert not any(SECRET in t or "Charge S-1" in t for t in texts), span.name
    picky = traced.one("execute_tool traced_picky")
    (raised,) = [e for e in picky.events if e.name == "exception"]
    assert raised.attributes["exception.type"].endswith("ToolFailedError"), (
        "the exception's class and frames, not its text"
    )


def test_spans__content_when_on_is_redacted(traced, model, traced_workflows, settings):
    """TRACE_CONTENT on: the GenAI content attributes are there, with the secret replaced as the logs replace it."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACE_CONTENT": True}
    model.enqueue(
        tool_reply(("traced_charge", {"order_id": "S-2", "note": f"password={SECRET}"}, "toolu_s2")),
        Reply.text("Done."),
    )
    run = api.start("traced_agent", {"message": f"Charge S-2, my password={SECRET}."})
    assert drive(run.id).status == "completed"
    first = attributes(traced.named(f"chat {MODEL}")[0])
    assert "Charge S-2" in first["gen_ai.input.messages"] and "[redacted]" in first["gen_ai.input.messages"]
    assert "traced_charge" in first["gen_ai.output.messages"]
    called = attributes(traced.one("execute_tool traced_charge"))
    assert "S-2" in called["gen_ai.tool.call.arguments"] and "[redacted]" in called["gen_ai.tool.call.arguments"]
    assert "charged" in called["gen_ai.tool.call.result"]
    for span in traced.all:
        texts = [str(v) for v in attributes(span).values()]
        assert not any(SECRET in t for t in texts), span.name


def test_spans__a_decision_made_twice_draws_one_wait_span(traced, model, traced_workflows):
    """The wait span is drawn once its decision committed; a second decide changes nothing and draws nothing."""
    model.enqueue(tool_reply(("traced_refund", {"order_id": "R-2", "amount": "5.00"}, "toolu_r2")), Reply.text("x"))
    run = api.start("traced_agent", {"message": "Refund R-2."})
    assert drive(run.id).status == "waiting"
    wait = Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN)
    api.decide(wait.pk, False, by="bob", via="api")
    with pytest.raises(api.WaitClosedError):
        api.decide(wait.pk, True, by="carol", via="api")
    waited = traced.one("wait approval")
    assert attributes(waited)["durable_agents.wait.decision"] == "rejected"
    assert attributes(waited)["durable_agents.wait.decided_by"] == "bob"


def test_spans__an_operator_cancel_sits_in_the_run_trace(traced, model, traced_workflows):
    model.enqueue(tool_reply(("traced_refund", {"order_id": "R-3", "amount": "5.00"}, "toolu_r3")))
    run = api.start("traced_agent", {"message": "Refund R-3."})
    assert drive(run.id).status == "waiting"
    api.cancel(run.id, reason="not needed", actor="ops")
    cancel = traced.one("cancel run")
    root = traced.one("run traced_agent")
    assert traced.parent_of(cancel) is root
    assert attributes(cancel)["durable_agents.actor"] == "ops"
    assert "not needed" not in str(attributes(cancel))
    waited = traced.one("wait approval")
    assert traced.parent_of(waited) is root and attributes(waited)["durable_agents.wait.decision"] == "cancelled"
    assert traced.orphans() == []


def test_spans__a_sweep_pass_is_one_span_with_its_counts(traced):
    report = sweep()
    swept = traced.one("durable_agents.sweep")
    assert attributes(swept)["durable_agents.sweep.woken"] == report.woken
    assert "durable_agents.sweep.fired" in attributes(swept)


def test_spans__tracing_off_records_nothing(model, traced_workflows, settings):
    """Off (the default), durable_agents starts no span. (The Anthropic SDK's own call spans, instrumentation scope
    com.anthropic.sdk.python, are the SDK's: an application turns those off with ANTHROPIC_OPEN_TELEMETRY=false.)"""
    from tests.integration.tracing_helpers import _EXPORTER, _provider

    _provider()
    _EXPORTER.clear()
    settings.DURABLE_AGENTS = {**getattr(settings, "DURABLE_AGENTS", {}), "TRACING": False}
    model.enqueue(
        tool_reply(("traced_refund", {"order_id": "R-4", "amount": "5.00"}, "toolu_r4")), Reply.text("Refunded.")
    )
    run = api.start("traced_agent", {"message": "Refund R-4."})
    assert drive(run.id).status == "waiting"
    api.decide(Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN).pk, True, by="ann")
    assert drive(run.id).status == "completed"
    sweep()
    ours = [s.name for s in _EXPORTER.get_finished_spans() if s.instrumentation_scope.name == "durable_agents"]
    assert ours == []
    assert {s.instrumentation_scope.name for s in _EXPORTER.get_finished_spans()} <= {"com.anthropic.sdk.python"}
