"""Log lines written inside a traced step attempt carry its trace and span ids; lines outside a span, or with
tracing off, carry none and a format naming them still renders (the `TraceIds` filter).

The ids are rendered as the W3C Trace Context `traceparent` and OpenTelemetry's log data model write them:
`trace_id` as 32 lowercase hex digits, `span_id` as 16 (OTel spec, logs/data-model.md "TraceId", "SpanId").
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from durable_agents import api, tracing
from durable_agents.logs import JsonFormatter, TraceIds
from durable_agents.testing import drive
from tests.integration import tracing_helpers

pytestmark = pytest.mark.django_db(transaction=True)

spans = tracing_helpers.spans

TEXT_FORMAT = "%(levelname)s %(message)s trace_id=%(trace_id)s span_id=%(span_id)s"


def _ids(span) -> tuple[str, str]:
    return f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}"


def _step_errors(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "durable_agents.engine" and "step error" in r.getMessage()]


def test_logs__a_line_inside_a_step_attempt_carries_the_attempt_span_ids(spans, caplog):
    caplog.set_level(logging.INFO, logger="durable_agents")
    run = drive(api.start("broken").id)
    errors = _step_errors(caplog)
    assert errors, "a failing step logs a warning"
    trace_id, span_id = _ids(spans.one("step broken"))
    record = errors[0]
    assert (record.trace_id, record.span_id) == (trace_id, span_id), "the engine's line names its attempt's span"
    run.refresh_from_db()
    assert trace_id == tracing.trace_id(run.trace_context), "the attempt's trace is the run's, from its row"

    rendered = json.loads(JsonFormatter().format(record))
    assert (rendered["trace_id"], rendered["span_id"]) == (trace_id, span_id)
    text = logging.Formatter(TEXT_FORMAT).format(record)
    assert text.endswith(f"trace_id={trace_id} span_id={span_id}"), text


def test_logs__a_line_from_another_logger_inside_the_attempt_gets_its_ids_from_the_filter(spans):
    """An application's own logger (a tool, a step body) has no run context: the filter and the JSON formatter
    take the ids of the span current when the line is written."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.addFilter(TraceIds())
    logger = logging.getLogger("durable_agents.tests.app")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    json_stream = io.StringIO()
    json_handler = logging.StreamHandler(json_stream)
    json_handler.setFormatter(JsonFormatter())
    logger.addHandler(json_handler)
    try:
        with tracing.span("app work") as current:
            logger.info("inside")
        logger.info("outside")
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(json_handler)
    made = spans.one("app work")
    trace_id, span_id = _ids(made)
    inside, outside = stream.getvalue().splitlines()
    assert inside == f"INFO inside trace_id={trace_id} span_id={span_id}"
    assert outside == "INFO outside trace_id= span_id=", "outside any span the ids are empty, the format holds"
    json_inside, json_outside = (json.loads(line) for line in json_stream.getvalue().splitlines())
    assert (json_inside["trace_id"], json_inside["span_id"]) == (trace_id, span_id)
    assert "trace_id" not in json_outside and "span_id" not in json_outside
    assert current.traceparent.split("-")[1:3] == [trace_id, span_id]


def test_logs__with_tracing_off_lines_carry_no_ids_and_a_format_naming_them_renders(caplog):
    caplog.set_level(logging.INFO, logger="durable_agents")
    drive(api.start("broken").id)
    record = _step_errors(caplog)[0]
    assert not hasattr(record, "trace_id"), "tracing off: the engine adds no trace fields"
    assert "trace_id" not in json.loads(JsonFormatter().format(record))
    TraceIds().filter(record)
    assert logging.Formatter(TEXT_FORMAT).format(record).endswith("trace_id= span_id=")
