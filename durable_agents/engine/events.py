"""Recording history: every retry, takeover, rejected commit and operator action becomes an Event row."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from durable_agents.models import Event

logger = logging.getLogger("durable_agents.events")


def record_event(run_id: uuid.UUID | str, kind: str, *, step_id: str = "", actor: str = "", **detail: Any) -> Event:
    """Append one event to the run's history and log it with the run and step ids."""
    event = Event.objects.create(run_id=run_id, kind=kind, step_id=step_id, actor=actor, detail=detail)
    logger.info(
        "%s run=%s step=%s %s",
        kind,
        run_id,
        step_id or "-",
        detail,
        extra={"run_id": str(run_id), "step_id": step_id, "event": kind, "actor": actor},
    )
    return event
