"""Structured engine logs: every line carries run id, step id and attempt, as text and as `extra` fields.

`JsonFormatter` renders them as one JSON object per line for log pipelines::

    LOGGING = {..., "formatters": {"json": {"()": "durable_agents.logs.JsonFormatter"}}, ...}

With `DURABLE_AGENTS["TRACING"]` on, a line written inside a span (a step attempt, a model call) also carries the
span's `trace_id` and `span_id` (hex, as trace viewers show them), so a log search and a trace open each other.
The engine's own lines have them as record attributes; `JsonFormatter` adds them to any line logged inside a span.
A text format naming `%(trace_id)s` needs them on every record, including Django's and those logged outside any
span or with tracing off: add the `TraceIds` filter to the handler, which sets them, empty when there is no span::

    LOGGING = {
        ...,
        "filters": {"trace_ids": {"()": "durable_agents.logs.TraceIds"}},
        "formatters": {"text": {"format": "%(levelname)s %(message)s trace_id=%(trace_id)s span_id=%(span_id)s"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "text", "filters": ["trace_ids"]}},
    }
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from typing import Any

from durable_agents import tracing

CONTEXT_FIELDS = ("run_id", "step_id", "attempt")
TRACE_FIELDS = ("trace_id", "span_id")


class RunLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger bound to one run (and step, attempt): `log.warning("step error %s", kind)`."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        context = {k: v for k, v in (self.extra or {}).items() if v not in (None, "")}
        kwargs["extra"] = {**context, **_trace_fields(), **kwargs.get("extra", {})}
        prefix = " ".join(f"{k}={context[k]}" for k in CONTEXT_FIELDS if k in context)
        return (f"{prefix} {msg}" if prefix else msg), kwargs


def run_logger(name: str, run_id: Any, step_id: str = "", attempt: int | None = None) -> RunLogger:
    return RunLogger(logging.getLogger(name), {"run_id": str(run_id), "step_id": step_id, "attempt": attempt})


class TraceIds(logging.Filter):
    """Sets `trace_id` and `span_id` on every record the handler sees: the current span's, or "" outside one (or
    with tracing off), so a format naming them never fails. Keeps ids a record already has (the engine's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "trace_id"):
            found = _trace_fields()
            record.trace_id = found.get("trace_id", "")
            record.span_id = found.get("span_id", "")
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the run context fields and the trace ids when present."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in (*CONTEXT_FIELDS, "event", "actor"):
            if hasattr(record, field):
                data[field] = getattr(record, field)
        # A record carries the ids of the span it was logged in; else this thread's span, when formatted in it.
        ids = {field: getattr(record, field, "") for field in TRACE_FIELDS}
        data.update({k: v for k, v in (ids if ids["trace_id"] else _trace_fields()).items() if v})
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


def _trace_fields() -> dict[str, str]:
    found = tracing.current_ids()
    return dict(zip(TRACE_FIELDS, found, strict=True)) if found else {}
