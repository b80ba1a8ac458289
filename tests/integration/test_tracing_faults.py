"""Tracing never changes what the engine does: a broken tracer, a missing OpenTelemetry API or a hostile stored trace
context never fails a start, a step, a decision, a cancel, a fork or a sweep; and with TRACE_CONTENT off no prompt
reaches a trace, not even through the text of an exception a participant raises.

The rules: the OpenTelemetry specification's error handling principle ("API methods MUST NOT throw unhandled
exceptions when used incorrectly by end users"; the instrumentation must not let a broken SDK change what the
instrumented code does), W3C Trace Context's "if the vendor failed to parse traceparent, it MUST NOT attempt to
parse tracestate ... and start a new trace", and the GenAI semantic conventions' rule that prompts
(`gen_ai.input.messages`) are opt-in content.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Sampler

from durable_agents import api, tracing
from durable_agents.agents.messages import ModelRequest, ModelResponse
from durable_agents.agents.participants import participants
from durable_agents.engine.sweep import sweep
from durable_agents.models import Run, Wait, WaitStatus
from durable_agents.testing import drive
from durable_agents.workflows import registry, workflow
from tests.testapp.workflows import LEAKED_KEY

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "Refund order Q-77 for Margaret Hamilton at 12 Elm Street"


class _Hostile:
    """A span of a broken tracing SDK: every method raises."""

    def __getattr__(self, name: str) -> Any:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"a broken span ({name})")

        return broken


class _HostileTracer:
    def start_span(self, *args: Any, **kwargs: Any) -> _Hostile:
        return _Hostile()


@pytest.fixture
def hostile_spans(spans, monkeypatch):
    """Tracing on; every span the engine starts is one whose every method raises."""
    monkeypatch.setattr(tracing._api(), "tracer", lambda: _HostileTracer())
    return spans


def test_tracing_faults__spans_that_raise_never_fail_a_start_step_decision_cancel_fork_or_sweep(hostile_spans):
    run = api.start("approve_charge", {"order_id": "H-1"})
    assert drive(run.id).status == "waiting"
    wait = Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN)
    api.decide(wait.pk, True, by="ann", via="api")
    assert drive(run.id).status == "completed"

    other = api.start("approve_charge", {"order_id": "H-2"})
    assert drive(other.id).status == "waiting"
    assert api.cancel(other.id, reason="not needed", actor="ops").status == "cancelled"

    fork = api.fork(run.id, "charge")
    assert drive(fork.id).status == "completed"
    sweep()


def test_tracing_faults__tracing_on_without_the_opentelemetry_api_never_fails_the_engine(spans, monkeypatch):
    """TRACING on where opentelemetry-api is not installed: a configuration slip, logged; runs go on untraced."""
    for name in ("opentelemetry", "opentelemetry.trace", "opentelemetry.context"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` raises ImportError
    monkeypatch.setattr(tracing, "_loaded", None)
    monkeypatch.setattr(tracing, "_unimportable", False)

    run = api.start("approve_charge", {"order_id": "N-1"})
    assert drive(run.id).status == "waiting"
    api.decide(Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN).pk, True, by="ann")
    assert drive(run.id).status == "completed"
    other = api.start("noop", {"steps": 2})
    api.cancel(other.id, actor="ops")
    sweep()
    assert Run.objects.get(pk=run.id).trace_context == ""


@pytest.mark.parametrize(
    "stored",
    [
        "garbage",
        "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
        "00-" + "a" * 32 + "-" + "b" * 16 + "-01\n",
        "ff-" + "A" * 32 + "-" + "B" * 16 + "-zz",
        "x" * 64,
    ],
)
def test_tracing_faults__a_hostile_stored_trace_context_never_fails_a_step(spans, stored):
    run = api.start("approve_charge", {"order_id": "G-1"})
    Run.objects.filter(pk=run.id).update(trace_context=stored)
    assert drive(run.id).status == "waiting"
    api.decide(Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN).pk, True, by="ann")
    assert drive(run.id).status == "completed"
    api.fork(run.id, "charge")

    attempts = spans.named("step ")
    assert attempts, "the steps are still traced"
    assert len({s.context.trace_id for s in attempts}) == 1, "one trace for the run's attempts"


class _QuotingParticipant:
    """A participant of the application's whose error quotes what it was asked (as many clients' errors do)."""

    name = "quoting"
    remote = False

    def respond(self, request: ModelRequest) -> ModelResponse:
        raise ValueError(f"cannot answer {request.messages!r}")


@pytest.fixture
def quoting_agent():
    workflow(
        "quoting_agent",
        steps=[api.agent("assistant", instructions="Help.", prompt=lambda ctx: ctx.input["message"])],
        replace=True,
    )
    with participants.isolated():
        participants.register("anthropic", _QuotingParticipant())
        yield
    registry.unregister("quoting_agent")


def test_tracing_faults__a_participants_error_quoting_the_prompt_stays_out_of_the_trace(spans, quoting_agent):
    run = api.start("quoting_agent", {"message": PROMPT})
    drive(run.id)

    chats = spans.named("chat ")
    assert chats, [s.name for s in spans.all]
    for span in spans.all:
        texts = [str(v) for v in (span.attributes or {}).values()]
        texts += [str(v) for event in span.events for v in (event.attributes or {}).values()]
        assert not any("Margaret Hamilton" in t for t in texts), (
            f"{span.name} carries the prompt with TRACE_CONTENT off: an exception's text is content unless the "
            "library wrote it"
        )
    (raised,) = [e for e in chats[0].events if e.name == "exception"]
    assert raised.attributes["exception.type"] == "ValueError"
    assert chats[0].status.status_code == trace.StatusCode.ERROR


def test_tracing_faults__a_step_whose_error_quotes_secrets_leaves_them_out_of_the_trace(spans, monkeypatch):
    """The step raises with an API key, a bearer token and a password in its message (tests/testapp `_leaks_secrets`):
    its attempt's span says it failed, and no span or event carries any of them."""
    monkeypatch.setenv("DURABLE_TEST_SERVICE_TOKEN", "svc-token-7f3a9c")
    run = api.start("leaks_secrets", {})
    assert drive(run.id).status == "failed"

    (attempt,) = spans.named("step leak")
    assert attempt.status.status_code == trace.StatusCode.ERROR
    for span in spans.all:
        texts = [span.name, *(str(v) for v in (span.attributes or {}).values())]
        texts += [str(v) for event in span.events for v in (event.attributes or {}).values()]
        leaked = [t for t in texts if LEAKED_KEY in t or "svc-token-7f3a9c" in t or "hunter2" in t]
        assert not leaked, f"{span.name} carries a secret: {leaked}"


def test_tracing_faults__tracing_on_with_no_sdk_provider_runs_untraced(spans, monkeypatch):
    """The API alone (its no-op tracer: no SDK, no provider set): spans are invalid, nothing is stored or exported,
    and every operation goes on."""
    monkeypatch.setattr(tracing._api(), "tracer", lambda: trace.NoOpTracer())
    run = api.start("approve_charge", {"order_id": "P-1"})
    assert Run.objects.get(pk=run.id).trace_context == ""
    assert drive(run.id).status == "waiting"
    api.decide(Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN).pk, True, by="ann")
    assert drive(run.id).status == "completed"
    api.fork(run.id, "charge")
    api.cancel(api.start("noop", {"steps": 1}).id, actor="ops")
    sweep()
    assert spans.all == []


class _RaisingSampler(Sampler):
    def should_sample(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a broken sampler")

    def get_description(self) -> str:
        return "broken"


class _RaisingExporter(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        raise RuntimeError("a broken exporter")


def _sdk(sampler: Sampler | None = None, limits: SpanLimits | None = None, exporter: SpanExporter | None = None):
    provider = TracerProvider(sampler=sampler, span_limits=limits)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


@pytest.mark.parametrize(
    "provider",
    [
        pytest.param(lambda: _sdk(sampler=_RaisingSampler()), id="raising_sampler"),
        pytest.param(lambda: _sdk(sampler=ALWAYS_OFF), id="sampled_out"),
        pytest.param(
            lambda: _sdk(limits=SpanLimits(max_attributes=1, max_events=0, max_attribute_length=3, max_links=0)),
            id="tight_span_limits",
        ),
        pytest.param(lambda: _sdk(exporter=_RaisingExporter()), id="raising_exporter"),
    ],
)
def test_tracing_faults__an_sdk_configured_badly_never_fails_the_engine(spans, monkeypatch, provider):
    """The SDK's own knobs (OpenTelemetry SDK specification: Sampler, SpanLimits, SpanExporter) set as an application
    might set them, or broken: every operation goes on."""
    made = provider()
    monkeypatch.setattr(tracing._api(), "tracer", lambda: made.get_tracer("durable_agents"))
    run = api.start("approve_charge", {"order_id": "K-1"})
    assert drive(run.id).status == "waiting"
    api.decide(Wait.objects.get(run_id=run.id, status=WaitStatus.OPEN).pk, True, by="ann")
    assert drive(run.id).status == "completed"
    api.fork(run.id, "charge")
    api.cancel(api.start("noop", {"steps": 1}).id, actor="ops")
    sweep()
