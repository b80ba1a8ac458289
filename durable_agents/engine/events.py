"""Recording history: every retry, takeover, rejected commit and operator action becomes an Event row."""

from __future__ import annotations

import uuid
from typing import Any

from durable_agents.logs import run_logger
from durable_agents.models import Event


def record_event(run_id: uuid.UUID | str, kind: str, *, step_id: str = "", actor: str = "", **detail: Any) -> Event:
    """Append one event to the run's history and log it with the run and step ids."""
    event = Event.objects.create(run_id=run_id, kind=kind, step_id=step_id, actor=actor, detail=detail)
    run_logger("durable_agents.events", run_id, step_id, detail.get("attempt")).info(
        "%s %s", kind, _loggable(detail), extra={"event": kind, "actor": actor}
    )
    return event


def _loggable(detail: dict[str, Any]) -> dict[str, Any]:
    """The detail for one log line: an error's traceback is left out, the step error's warning prints it."""
    error = detail.get("error")
    if isinstance(error, dict) and "traceback" in error:
        return {**detail, "error": {k: v for k, v in error.items() if k != "traceback"}}
    return detail
