"""Structured engine logs: every line carries run id, step id and attempt, as text and as `extra` fields.

`JsonFormatter` renders them as one JSON object per line for log pipelines::

    LOGGING = {..., "formatters": {"json": {"()": "durable_agents.logs.JsonFormatter"}}, ...}
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from typing import Any

CONTEXT_FIELDS = ("run_id", "step_id", "attempt")


class RunLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger bound to one run (and step, attempt): `log.warning("step error %s", kind)`."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        context = {k: v for k, v in (self.extra or {}).items() if v not in (None, "")}
        kwargs["extra"] = {**context, **kwargs.get("extra", {})}
        prefix = " ".join(f"{k}={context[k]}" for k in CONTEXT_FIELDS if k in context)
        return (f"{prefix} {msg}" if prefix else msg), kwargs


def run_logger(name: str, run_id: Any, step_id: str = "", attempt: int | None = None) -> RunLogger:
    return RunLogger(logging.getLogger(name), {"run_id": str(run_id), "step_id": step_id, "attempt": attempt})


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the run context fields when present."""

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
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)
