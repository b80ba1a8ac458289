"""The model fault matrix: every error and stop reason of the Messages API, through the real SDK.

Each case drives a one-agent run in-process against the fake server and asserts the persisted outcome:
retried and completed, or failed with the right error. Backoffs are skipped by clearing `wake_at`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import anthropic
import pytest

from durable_agents import api, clock
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants
from durable_agents.engine.advance import advance
from durable_agents.models import Event, Run, RunStatus, Turn
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, Reply, text_block
from durable_agents.workflows import registry, workflow

pytestmark = pytest.mark.django_db(transaction=True)
API_KEY = "sk-ant-test-secret-0123456789"


@contextmanager
def claude_on_the_fake(monkeypatch, *, timeout: float, api_key: str = API_KEY) -> Iterator[FakeAnthropic]:
    """The "anthropic" participant, the real SDK pointed at a fresh fake Messages API; the previous one after."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", api_key)
    with FakeAnthropic() as server:
        client = anthropic.Anthropic(api_key=api_key, base_url=server.url, max_retries=0, timeout=timeout)
        previous = participants._participants.get("anthropic")
        participants.register("anthropic", AnthropicParticipant(client=client))
        try:
            yield server
        finally:
            participants._participants.pop("anthropic", None)
            if previous is not None:
                participants.register("anthropic", previous)


# A client's timeout is its patience with every call, the ones meant to succeed too: ten seconds, so a busy
# machine's stall is not a timeout; the timeout test has its own short one.
PATIENT = 10.0


@pytest.fixture
def fake(monkeypatch):
    with claude_on_the_fake(monkeypatch, timeout=PATIENT) as server:
        yield server


@pytest.fixture
def streaming_fake(fake):
    client = anthropic.Anthropic(api_key=API_KEY, base_url=fake.url, max_retries=0, timeout=PATIENT)
    participants.register("anthropic", AnthropicParticipant(client=client, stream=True))
    return fake


def run_to_end(max_advances: int = 30) -> Run:
    run = api.start("agent_charge", {"message": "Charge A-1"})
    for _ in range(max_advances):
        Run.objects.filter(pk=run.id).update(wake_at=None)
        advance(run.id)
        run.refresh_from_db()
        if run.is_finished:
            return run
    raise AssertionError(f"run still {run.status} after {max_advances} advances")


def finishing(fake) -> None:
    fake.enqueue(Reply.text("All done."))


@pytest.mark.parametrize(
    "fault",
    [
        Fault.status(429, headers={"retry-after": "0"}),
        Fault.status(500),
        Fault.status(502),
        Fault.status(503),
        Fault.status(529),
        Fault.reset(),
    ],
    ids=["429", "500", "502", "503", "529", "connection-reset"],
)
def test_faults__transient_errors_are_retried_and_the_run_completes(fake, fault):
    fake.enqueue(fault, fault)
    finishing(fake)

    run = run_to_end()

    assert_completed_after_two_retries(run)


def test_faults__a_call_past_the_clients_timeout_is_retried_and_the_run_completes(monkeypatch):
    # The one client here with little patience: its calls that succeed have a second, against the fake's answer
    # in milliseconds; the two that time out are answered after four.
    with claude_on_the_fake(monkeypatch, timeout=1.0) as fake:
        fake.enqueue(Fault.delay(4.0), Fault.delay(4.0))
        finishing(fake)

        run = run_to_end()

    assert_completed_after_two_retries(run)


def assert_completed_after_two_retries(run: Run) -> None:
    assert run.status == RunStatus.COMPLETED, run.error
    retries = Event.objects.filter(run=run, kind="step_retry")
    assert retries.count() == 2 and {e.detail["error"]["type"] for e in retries} == {"ModelUnavailableError"}
    assert Turn.objects.filter(run=run).count() == 1, "failed attempts are not journaled as turns"


@pytest.mark.parametrize("seconds", [5, 90])
def test_faults__429_retry_after_is_honoured_even_past_a_minute(fake, seconds):
    fake.enqueue(Fault.status(429, headers={"retry-after": str(seconds)}))
    run = api.start("agent_charge", {"message": "Charge A-1"})
    before = clock.now()

    assert advance(run.id) == "retry"

    run.refresh_from_db()
    assert run.wake_at >= before + timedelta(seconds=seconds), "the retry must wait as long as the server asked"
    event = Event.objects.get(run=run, kind="step_retry")
    assert event.detail["delay_seconds"] >= seconds and "429" in event.detail["error"]["message"]


@pytest.mark.parametrize(
    ("status", "hint"),
    [
        (400, "the request is invalid"),
        (401, "set ANTHROPIC_API_KEY"),
        (403, "may not use this model"),
        (404, "check DURABLE_AGENTS['DEFAULT_MODEL']"),
        (413, "compact the conversation"),
    ],
)
def test_faults__client_errors_fail_the_run_at_once_with_a_clear_error(fake, status, hint):
    fake.enqueue(Fault.status(status))

    run = run_to_end()

    assert run.status == RunStatus.FAILED
    assert run.error["type"] == "ModelRequestError" and hint in run.error["message"]
    assert run.error["step"] == "assistant"
    assert not Event.objects.filter(run=run, kind="step_retry").exists(), "a permanent error is not retried"


def test_faults__refusal_fails_the_run_with_its_reason(fake):
    fake.enqueue(Reply.text("I can't help with that.", stop_reason="refusal"))
    run = run_to_end()
    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRefusalError"
    assert "can't help" in run.error["message"]


def test_faults__context_window_exceeded_is_a_clear_failure(fake):
    fake.enqueue(Reply.text("", stop_reason="model_context_window_exceeded"))
    run = run_to_end()
    assert run.status == RunStatus.FAILED and run.error["type"] == "ContextWindowExceededError"


def test_faults__pause_turn_sends_the_paused_answer_back_as_it_is(fake):
    # "continue by sending the assistant content back as-is":
    # https://platform.claude.com/docs/en/build-with-claude/handling-stop-reasons
    fake.enqueue(Reply.pause_turn("web_search", {"query": "order A-1"}), Reply.text("Order A-1 is charged."))
    run = run_to_end()
    assert run.status == RunStatus.COMPLETED, run.error
    first, last = [r for r in fake.requests if r.path == "/v1/messages"][-2:]
    paused = last.body["messages"][-1]
    assert paused["role"] == "assistant", "the paused turn goes on from its own content"
    assert [b["type"] for b in paused["content"]] == ["thinking", "server_tool_use"], paused
    step_result = Run.objects.get(pk=run.id).steps.get(step_id="assistant").result
    assert step_result["text"] == "Order A-1 is charged."


def test_faults__max_tokens_continues_with_a_user_message_on_a_model_refusing_prefill(fake):
    # Sonnet 5.5 refuses an assistant prefill (400); the migration guide moves the continuation to a user message:
    # https://platform.claude.com/docs/en/models/sonnet-5-5/migration-guide
    fake.enqueue(Reply.text("Order A-1 is ", stop_reason="max_tokens"), Reply.text("charged."))
    run = run_to_end()
    assert run.status == RunStatus.COMPLETED
    last = [r for r in fake.requests if r.path == "/v1/messages"][-1]
    assert last.body["model"] == "claude-sonnet-5-5" and last.body["messages"][-1]["role"] == "user"
    assert "Continue exactly from where it stopped" in last.last_user_text
    step_result = Run.objects.get(pk=run.id).steps.get(step_id="assistant").result
    assert step_result["text"] == "Order A-1 is charged.", "the answer is both parts, in order"


def test_faults__max_tokens_continues_as_a_prefill_on_a_model_taking_one(fake, settings):
    # Haiku 4.5 without thinking takes a prefill: the cut answer is the last message, and the model goes on.
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "DEFAULT_MODEL": "claude-haiku-4-5"}
    fake.enqueue(Reply.text("Order A-1 is ", stop_reason="max_tokens"), Reply.text("charged."))
    run = run_to_end()
    assert run.status == RunStatus.COMPLETED
    last = [r for r in fake.requests if r.path == "/v1/messages"][-1]
    assert last.body["messages"][-1] == {"role": "assistant", "content": [text_block("Order A-1 is")]}, (
        "the continuation request ends with the partial answer as a prefill"
    )
    step_result = Run.objects.get(pk=run.id).steps.get(step_id="assistant").result
    assert step_result["text"] == "Order A-1 is charged."


def test_faults__unknown_tool_and_bad_arguments_go_back_to_the_model(fake):
    fake.enqueue(
        Reply.tool_use("delete_everything", {}, id="t1"),
        Reply.tool_use("charge", {"order_id": "A-1", "amount": "lots"}, id="t2"),
        Reply.text("Sorry, done."),
    )
    run = run_to_end()
    assert run.status == RunStatus.COMPLETED
    results = list(Turn.objects.filter(run=run).order_by("index").values_list("tool_results", flat=True))
    assert results[0][0]["is_error"] and "unknown tool 'delete_everything'" in results[0][0]["content"]
    assert results[1][0]["is_error"] and "amount" in results[1][0]["content"]
    sent = [r for r in fake.requests if r.path == "/v1/messages"][1]
    assert sent.tool_results[0]["is_error"] is True, "the model saw its mistake"


def test_faults__too_many_invalid_tool_calls_stop_the_run(fake):
    for i in range(5):
        fake.enqueue(Reply.tool_use("nope", {}, id=f"t{i}"))
    run = run_to_end()
    assert run.status == RunStatus.FAILED and run.error["type"] == "AgentLimitError"


def test_faults__max_turns_bounds_the_loop(fake):
    workflow(
        "short_agent",
        steps=[api.agent("assistant", instructions="x", tools=[], max_turns=2)],
        replace=True,
    )
    try:
        fake.responder = lambda request: Reply.text("more", stop_reason="pause_turn")
        run = api.start("short_agent", {})
        for _ in range(5):
            advance(run.id)
        run.refresh_from_db()
    finally:
        registry.unregister("short_agent")
    assert run.status == RunStatus.FAILED and "2 turns" in run.error["message"]


def test_faults__error_event_mid_stream_is_retried(streaming_fake):
    streaming_fake.enqueue(Fault.stream_error(partial_text="Order"))
    finishing(streaming_fake)
    run = run_to_end()
    assert run.status == RunStatus.COMPLETED, run.error
    assert Event.objects.get(run=run, kind="step_retry").detail["error"]["type"] == "ModelUnavailableError"


def test_faults__the_api_key_is_never_persisted(fake):
    fake.enqueue(Fault.status(401), Fault.status(500))
    run_to_end()
    for model in (Run, Turn, Event):
        for row in model.objects.all():
            assert API_KEY not in str(row.__dict__), f"the API key leaked into {model.__name__}"
    assert all(r.headers.get("authorization", "[redacted]") == "[redacted]" for r in fake.requests)


def test_faults__default_model_is_current(fake):
    from anthropic._data import DEPRECATED_MODELS

    from durable_agents.conf import settings

    fake.enqueue(Reply.text("ok"))
    run_to_end()
    sent = [r for r in fake.requests if r.path == "/v1/messages"][0]
    assert sent.body["model"] == settings.DEFAULT_MODEL and settings.DEFAULT_MODEL not in DEPRECATED_MODELS
    assert "billing assistant" in str(sent.body["system"]), "the instructions are the system prompt"
