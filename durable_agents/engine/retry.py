"""Failure classification: transient errors retry with backoff up to a bound; everything else is permanent.

One retry owner: the engine. Celery never retries `advance` itself; each attempt is persisted on the run
(`attempt`) and step (`attempts`), with every error recorded as an event.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError

from durable_agents.errors import PermanentError, RetryableError
from durable_agents.storable import storable_text
from durable_agents.workflows import RetryPolicy

TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    RetryableError,
    TimeoutError,
    ConnectionError,
    socket.timeout,
    OperationalError,
    InterfaceError,
)

MAX_MESSAGE_CHARS = 2000


@dataclass(frozen=True)
class Failure:
    """A classified step failure, as persisted in `error` fields and events."""

    transient: bool
    type: str
    message: str
    step: str
    # Seconds the failing service asked us to wait (e.g. a 429's retry-after), if it said.
    retry_after: float | None = None

    def as_error(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "step": self.step}


def error_of(exc: BaseException, limit: int = 2000) -> dict[str, Any]:
    """`exc` as persisted in an `error` field (jsonb): its type, and a message Postgres can always store."""
    return {"type": type(exc).__name__, "message": storable_text(str(exc) or type(exc).__name__)[:limit]}


def classify(exc: BaseException, policy: RetryPolicy, step_id: str) -> Failure:
    """Decide whether `exc` is worth retrying: PermanentError never is; declared and I/O errors are."""
    transient = not isinstance(exc, PermanentError) and isinstance(exc, TRANSIENT_TYPES + policy.retry_on)
    # The message is persisted (error fields, events): whatever the exception says must store.
    message = storable_text(str(exc) or type(exc).__name__)
    return Failure(
        transient=transient,
        type=type(exc).__name__,
        message=message[:MAX_MESSAGE_CHARS],
        step=step_id,
        retry_after=_seconds(getattr(exc, "retry_after", None)),
    )


def _seconds(value: Any) -> float | None:
    """A service's `retry-after` as seconds; None if it is not a number (NaN included)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return None if seconds != seconds else seconds
