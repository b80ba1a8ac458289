"""OpenTelemetry traces of runs, steps, model calls, tools, effects and waits (`DURABLE_AGENTS["TRACING"]`).

Off by default, and then free: nothing of OpenTelemetry is imported, each hook is one settings read. On, spans go
to whatever tracer provider the application configured through the OpenTelemetry API (`opentelemetry-api`, the
`durable-agents[otel]` extra); the SDK, its exporters and sampling stay the application's choice.

One trace per run, however long it lives. `start_run` opens the run's span (`run <workflow>`) as a child of
whatever span is current (the Django request that started it, a parent run's step, a schedule's sweep) and keeps
its W3C `traceparent` in the run's row (`Run.trace_context`): every later span of the run is a child of that
span, taken from the row, not from a Celery message (which the sweep may replace), so a run recovered on another
machine days later goes on in the same trace. The run span itself ends when the start commits: a trace viewer
draws it as the root of the run's tree, with each step attempt, wait and operator action under it, and each
model call, tool call and effect under its attempt. Where a span starts inside another trace (Celery's task span
under opentelemetry-instrumentation-celery, an operator's admin request), it links to it instead of joining it.

Nothing secret becomes an attribute: ids, names, counts, outcomes. Prompts, answers and tool arguments only with
`DURABLE_AGENTS["TRACE_CONTENT"]`, redacted as the logs are (the callers pass redacted text).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import re
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from durable_agents.conf import settings

TRACER_NAME = "durable_agents"

logger = logging.getLogger("durable_agents.tracing")

# Attributes of this library's own spans (the GenAI ones are OpenTelemetry's: gen_ai.*).
RUN_ID = "durable_agents.run.id"
WORKFLOW = "durable_agents.workflow.name"
WORKFLOW_VERSION = "durable_agents.workflow.version"
STEP_ID = "durable_agents.step.id"
STEP_NAME = "durable_agents.step.name"
STEP_KIND = "durable_agents.step.kind"
ATTEMPT = "durable_agents.step.attempt"
OUTCOME = "durable_agents.step.outcome"
WORKER = "durable_agents.worker"
LEASE_TOKEN = "durable_agents.lease.token"
COST_USD = "durable_agents.cost_usd"
MODEL_TURN = "durable_agents.model.turn"
MODEL_PURPOSE = "durable_agents.model.purpose"
MODEL_BATCHED = "durable_agents.model.batched"
MODEL_REQUEST_ID = "durable_agents.model.request_id"
EFFECT_KEY = "durable_agents.effect.key"
EFFECT_OUTCOME = "durable_agents.effect.outcome"
WAIT_ID = "durable_agents.wait.id"
WAIT_KIND = "durable_agents.wait.kind"
WAIT_DECISION = "durable_agents.wait.decision"
WAIT_DECIDED_BY = "durable_agents.wait.decided_by"
WAIT_VIA = "durable_agents.wait.via"
ACTOR = "durable_agents.actor"

# OpenTelemetry's GenAI semantic conventions (opentelemetry-semantic-conventions 0.66b2,
# `opentelemetry.semconv._incubating.attributes.gen_ai_attributes`, now kept in the semantic-conventions-genai
# repository under the same names), and the general `server.address` and `error.type`.
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"  # "chat" (a model call), "execute_tool" (a tool call)
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"  # "anthropic" for Claude
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS = "gen_ai.usage.cache_creation.input_tokens"
GEN_AI_INPUT_MESSAGES = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES = "gen_ai.output.messages"
GEN_AI_TOOL_NAME = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID = "gen_ai.tool.call.id"
GEN_AI_TOOL_CALL_ARGUMENTS = "gen_ai.tool.call.arguments"
GEN_AI_TOOL_CALL_RESULT = "gen_ai.tool.call.result"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
CHAT = "chat"
EXECUTE_TOOL = "execute_tool"

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


class Span:
    """A span being recorded, or nothing (`OFF`): the same calls either way."""

    __slots__ = ("_failed", "_span")

    def __init__(self, span: Any = None) -> None:
        self._span = span
        self._failed = False

    def set(self, attributes: Mapping[str, Any]) -> None:
        """Set attributes; None values are left out."""
        if self._span is not None:
            _safely(lambda: self._span.set_attributes(_clean(attributes)))

    def rename(self, name: str) -> None:
        if self._span is not None:
            _safely(lambda: self._span.update_name(name))

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        if self._span is not None:
            _safely(lambda: self._span.add_event(name, _clean(attributes)))

    def fail(self, error: BaseException | str, kind: str = "", *, message: str = "") -> None:
        """Mark the span failed (status ERROR, `error.type`: `kind`, else the exception's class or the text),
        recording the exception if one is given. Once: the first cause stands, so a caller that named the error
        more precisely (an HTTP status) is not overwritten by the exception leaving the span's block.

        An exception's text may quote what it failed on (a tool's arguments, a prompt): the event shows its class
        and its frames, and its text only as `message`, which the caller passes redacted."""
        if self._span is None or self._failed:
            return
        self._failed = True
        # Called while an exception leaves a step or a tool: a broken SDK must not replace that exception.
        _safely(lambda: self._fail(error, kind, message))

    def _fail(self, error: BaseException | str, kind: str, message: str) -> None:
        api = _api()
        if api is None:
            return
        kind = kind or (type(error).__qualname__ if isinstance(error, BaseException) else str(error))
        if isinstance(error, BaseException):
            name = type(error).__qualname__
            frames = "".join(traceback.format_tb(error.__traceback__))
            shown = {"exception.message": message or name, "exception.stacktrace": f"{frames}{name}"}
            self._span.record_exception(error, attributes=shown)
        self._span.set_attribute(ERROR_TYPE, kind)
        self._span.set_status(api.Status(api.StatusCode.ERROR, kind))

    @property
    def traceparent(self) -> str:
        """The span's W3C traceparent; "" when there is none to continue (no SDK, or a broken one)."""
        if self._span is None:
            return ""
        context = _safely(self._span.get_span_context)
        if context is None or not context.is_valid:  # the API without an SDK: nothing to continue
            return ""
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


OFF = Span()


def enabled() -> bool:
    """True when spans are made: TRACING on, and the OpenTelemetry API importable."""
    return bool(settings.TRACING) and _api() is not None


def content_enabled() -> bool:
    """True when prompts, answers and tool arguments may be attributes (redacted by the caller)."""
    return enabled() and bool(settings.TRACE_CONTENT)


def current() -> Span:
    """The span current in this context (a step attempt, a model call), to add to; `OFF` when off or none."""
    api = _on()
    if api is None:
        return OFF
    found = api.trace.get_current_span()
    return Span(found) if _safely(found.is_recording) else OFF


def start_run(workflow: str, version: int, run_id: Any, *, links_to: str = "") -> Span:
    """The span of a run being started, child of the current span (linked to the run span `links_to` names: a
    fork's source); the caller ends it once the run is stored (`end_on_commit`)."""
    api = _on()
    if api is None:
        return OFF
    attributes = _clean({RUN_ID: str(run_id) if run_id else None, WORKFLOW: workflow, WORKFLOW_VERSION: version})
    source = _span_context(api, links_to)
    links = [api.trace.Link(source)] if source is not None else []
    made = _safely(lambda: api.tracer().start_span(f"run {workflow}", attributes=attributes, links=links))
    return OFF if made is None else Span(made)


def end(span: Span) -> None:
    if span._span is not None:
        _safely(span._span.end)


def end_on_commit(span: Span) -> None:
    """End the run's span when the start commits; a start rolled back never exports it."""
    if span._span is not None:
        made = span._span
        transaction.on_commit(lambda: _safely(made.end))


@contextlib.contextmanager
def run_span(
    name: str, trace_context: str, attributes: Mapping[str, Any] | None = None, *, run_id: uuid.UUID | None = None
) -> Iterator[Span]:
    """A span of the run whose row holds `trace_context` (a step attempt, an operator's action), current while the
    block runs; linked to the span that was current (a Celery task's, a request's) rather than its child."""
    api = _on()
    if api is None:
        yield OFF
        return

    def start() -> Any:
        parent, links = _run_parent(api, trace_context, run_id)
        return api.tracer().start_span(name, context=parent, links=links, attributes=_clean(attributes))

    made = _safely(start)
    with _current(api, made) as handle:
        yield handle


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None, *, client: bool = False) -> Iterator[Span]:
    """A child of the current span (a model call, a tool call, an effect, a sweep pass); `client`: a call out of
    this process (SpanKind CLIENT, as the GenAI conventions ask of a model call)."""
    api = _on()
    if api is None:
        yield OFF
        return
    kind = api.trace.SpanKind.CLIENT if client else api.trace.SpanKind.INTERNAL
    made = _safely(lambda: api.tracer().start_span(name, kind=kind, attributes=_clean(attributes)))
    with _current(api, made) as handle:
        yield handle


def record_run_span(
    name: str,
    trace_context: str,
    start: datetime | None,
    end_at: datetime | None,
    attributes: Mapping[str, Any] | None = None,
    *,
    error: str = "",
    run_id: uuid.UUID | None = None,
) -> None:
    """A span of the run drawn after the fact from the database's times: a wait from its opening to its decision,
    an attempt whose worker died (from its claim to its lease's expiry)."""
    api = _on()
    if api is None:
        return

    # A missing time is the other one (a span of no length, never one that ends before it starts); both missing: now.
    began, finish = _nanos(start), _nanos(end_at)
    began, finish = began or finish, finish or began
    if began is not None and finish is not None:
        finish = max(began, finish)

    def draw() -> None:
        parent, links = _run_parent(api, trace_context, run_id)
        made = api.tracer().start_span(
            name, context=parent, links=links, attributes=_clean(attributes), start_time=began
        )
        if error:
            Span(made).fail(error)
        made.end(end_time=finish)

    _safely(draw)


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span, as hex, for log lines; None when off, outside a span, or before
    Django's settings are configured (a log line written that early)."""
    try:
        api = _on()
    except ImproperlyConfigured:
        return None
    if api is None:
        return None
    context = _safely(api.trace.get_current_span().get_span_context)
    if context is None or not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def trace_id(trace_context: str) -> str:
    """The trace id (32 hex digits) a run's stored `traceparent` names, or "" (none, or not one)."""
    found = _TRACEPARENT.match(trace_context or "")
    return found.group(1) if found else ""


def trace_url(trace_context: str) -> str:
    """The run's trace in the operators' viewer (`TRACE_URL` with `{trace_id}`), or "" when either is missing."""
    template, found = settings.TRACE_URL, trace_id(trace_context)
    return template.replace("{trace_id}", found) if template and found else ""


class _Api:
    """The OpenTelemetry API, imported on first use with tracing on."""

    def __init__(self) -> None:
        self.trace = importlib.import_module("opentelemetry.trace")
        self.context = importlib.import_module("opentelemetry.context")
        self.Status = self.trace.Status
        self.StatusCode = self.trace.StatusCode
        version = importlib.import_module("durable_agents").__version__
        self._version = version

    def tracer(self) -> Any:
        # Asked each time: the application may set its provider after this module first ran (the API's proxy
        # tracer would follow anyway; this keeps the instrumentation scope's version right).
        return self.trace.get_tracer(TRACER_NAME, self._version)


_loaded: _Api | None = None
_unimportable = False


def _api() -> _Api | None:
    """The API, or None where it cannot be imported (TRACING on without opentelemetry-api: said once, then the
    engine runs untraced rather than failing every start and step)."""
    global _loaded, _unimportable
    if _loaded is None and not _unimportable:
        try:
            _loaded = _Api()
        except ImportError:
            _unimportable = True
            logger.error(
                'DURABLE_AGENTS["TRACING"] is on but the OpenTelemetry API cannot be imported: nothing is traced '
                "(install the durable-agents[otel] extra)",
                exc_info=True,
            )
    return _loaded


def _on() -> _Api | None:
    """The API when spans are made, else None (TRACING off: nothing imported)."""
    return _api() if settings.TRACING else None


@contextlib.contextmanager
def _current(api: _Api, made: Any) -> Iterator[Span]:
    """`made` current while the block runs, ended after it (failed if the block raised)."""
    if made is None:
        yield OFF
        return
    handle = Span(made)
    token = api.context.attach(api.trace.set_span_in_context(made))
    try:
        yield handle
    except BaseException as exc:
        handle.fail(exc)
        raise
    finally:
        api.context.detach(token)
        _safely(made.end)


def _safely(call: Callable[[], Any]) -> Any:
    """A span started or ended: a faulty processor, sampler or exporter of the application's SDK (which the API
    lets raise) never fails a step or a start that committed; it is logged, then None."""
    global _faults
    try:
        return call()
    except Exception:  # noqa: BLE001 - the application's SDK, not ours: a trace is never worth a step
        _faults += 1
        logger.log(logging.WARNING if _faults == 1 else logging.DEBUG, "tracing failed (spans go on)", exc_info=True)
        return None


_faults = 0


def _run_parent(api: _Api, trace_context: str, run_id: uuid.UUID | None) -> tuple[Any, list[Any]]:
    """The context whose span is the run's (from its row), and a link to the span current in this process when it
    is another one. A run without a stored context (started before tracing was on) is a trace of its own: the
    trace id is its run id, under a parent span never exported."""
    current = api.trace.get_current_span().get_span_context()
    run = _span_context(api, trace_context)
    if run is None and run_id is None:
        return api.context.Context(), [api.trace.Link(current)] if current.is_valid else []
    run = run or api.trace.SpanContext(
        trace_id=run_id.int,
        span_id=(run_id.int & 0xFFFF_FFFF_FFFF_FFFF) or 1,
        is_remote=True,
        trace_flags=api.trace.TraceFlags(api.trace.TraceFlags.SAMPLED),
    )
    parent = api.trace.set_span_in_context(api.trace.NonRecordingSpan(run), api.context.Context())
    linked = current.is_valid and current.span_id != run.span_id
    return parent, [api.trace.Link(current)] if linked else []


def _span_context(api: _Api, traceparent: str) -> Any:
    found = _TRACEPARENT.match(traceparent or "")
    if found is None or not int(found.group(1), 16) or not int(found.group(2), 16):
        return None
    return api.trace.SpanContext(
        trace_id=int(found.group(1), 16),
        span_id=int(found.group(2), 16),
        is_remote=True,
        trace_flags=api.trace.TraceFlags(int(traceparent[-2:], 16)),
    )


def _nanos(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp() * 1_000_000_000)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: _value(v) for k, v in (attributes or {}).items() if v is not None}


def _value(value: Any) -> Any:
    # OpenTelemetry takes str, bool, int, float and sequences of one of them; anything else is shown as text.
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return list(value)
    return str(value)
