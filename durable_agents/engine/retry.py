"""Failure classification: transient errors retry with backoff up to a bound; everything else is permanent.

One retry owner: the engine. Celery never retries `advance` itself; each attempt is persisted on the run
(`attempt`) and step (`attempts`), with every error recorded as an event.

What is persisted of a failure is redacted (durable_agents.redaction) and storable: its type, its message,
and — for a failure nobody anticipated — its traceback, bounded (`traceback_of`).
"""

from __future__ import annotations

import socket
import traceback
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError

from durable_agents.errors import DurableAgentsError, PermanentError, RetryableError
from durable_agents.redaction import redact, redactor
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
# A stored traceback: the innermost frames of each exception in the chain, each line clipped, the whole
# at most this long (the newest part kept). A recursion error's thousand frames fit the same bound.
TRACEBACK_FRAMES = 30
TRACEBACK_LINE_CHARS = 1000
TRACEBACK_MAX_CHARS = 8000


@dataclass(frozen=True)
class Failure:
    """A classified step failure, as persisted in `error` fields and events."""

    transient: bool
    type: str
    message: str
    step: str
    # Seconds the failing service asked us to wait (e.g. a 429's retry-after), if it said.
    retry_after: float | None = None
    # Where an unanticipated failure happened (`has_traceback`), redacted and bounded; None otherwise.
    traceback: str | None = None

    def as_error(self) -> dict[str, Any]:
        error = {"type": self.type, "message": self.message, "step": self.step}
        if self.traceback:
            error["traceback"] = self.traceback
        return error


def error_of(exc: BaseException, limit: int = 2000) -> dict[str, Any]:
    """`exc` as persisted in an `error` field (jsonb): its type, and a message Postgres can always store."""
    return {"type": type(exc).__name__, "message": _message(exc)[:limit]}


def classify(exc: BaseException, policy: RetryPolicy, step_id: str) -> Failure:
    """Decide whether `exc` is worth retrying: PermanentError never is; declared and I/O errors are."""
    transient = not isinstance(exc, PermanentError) and isinstance(exc, TRANSIENT_TYPES + policy.retry_on)
    return Failure(
        transient=transient,
        type=type(exc).__name__,
        message=_message(exc)[:MAX_MESSAGE_CHARS],
        step=step_id,
        retry_after=_seconds(getattr(exc, "retry_after", None)),
        traceback=traceback_of(exc) if has_traceback(exc) else None,
    )


def has_traceback(exc: BaseException) -> bool:
    """Whether `exc` is stored with its traceback: unless it is one of this library's errors, raised on purpose.

    A DurableAgentsError (RetryableError, PermanentError, ToolFailedError…) raised on its own is deliberate,
    with a message written to be the diagnosis; its frames would only say again where the message came from.
    Anything else — a bug, a library the step calls — is a surprise whose message rarely says where: it keeps
    its traceback. So does a library error raised `from` a surprise (`raise RetryableError("…") from exc`, the
    agent loop's wrap of a crashed tool, the model errors mapped from the SDK's): chaining asks to keep the
    cause, and the stored text shows both. The bound holds per attempt, so a retried step stores at most
    attempts × TRACEBACK_MAX_CHARS.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if not isinstance(cause, DurableAgentsError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def traceback_of(exc: BaseException) -> str:
    """`exc`'s traceback as stored: secrets redacted, what Postgres refuses escaped, and bounded.

    The last TRACEBACK_FRAMES frames of each exception in its chain; lines clipped at TRACEBACK_LINE_CHARS (a
    megabyte of exception message stays a line); at most TRACEBACK_MAX_CHARS in all. A longer one keeps its
    start (the root cause, printed first) and most of its end (the exception the step raised), with a marker
    between saying how much was cut.
    """
    chunks = traceback.TracebackException.from_exception(exc, limit=-TRACEBACK_FRAMES).format()
    # Redacted before anything is cut: a cut through a secret would leave a piece no rule recognises.
    text = storable_text("".join(map(redactor(), chunks)))
    lines = [_clipped(line) for line in text.splitlines()]
    if sum(len(line) + 1 for line in lines) <= TRACEBACK_MAX_CHARS:
        return "\n".join(lines)
    head = _fitting(lines, TRACEBACK_MAX_CHARS // 4)
    tail = _fitting(lines[::-1], TRACEBACK_MAX_CHARS - TRACEBACK_MAX_CHARS // 4 - 100)[::-1]
    marker = f"[… {len(lines) - len(head) - len(tail)} lines of the traceback cut …]"
    return "\n".join([*head, marker, *tail])


def _fitting(lines: list[str], budget: int) -> list[str]:
    """The first of `lines` that fit in `budget` characters (newlines included)."""
    kept: list[str] = []
    for line in lines:
        budget -= len(line) + 1
        if budget < 0:
            break
        kept.append(line)
    return kept


def _clipped(line: str) -> str:
    if len(line) <= TRACEBACK_LINE_CHARS:
        return line
    return f"{line[:TRACEBACK_LINE_CHARS]}[… {len(line) - TRACEBACK_LINE_CHARS} characters cut]"


def _message(exc: BaseException) -> str:
    # Persisted and logged: whatever the exception says must store, and must not carry a secret.
    return storable_text(redact(str(exc) or type(exc).__name__))


def _seconds(value: Any) -> float | None:
    """A service's `retry-after` as seconds; None if it is not a number (NaN included)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return None if seconds != seconds else seconds
