"""Recording wakers: a WAKER and a BATCH_WAKER that only record what the engine asked for, and one that refuses.

`RECORDING` names them for `DURABLE_AGENTS`; a test clears `woken` and `batches` before it starts runs.
"""

from __future__ import annotations

woken: list[tuple[str, dict]] = []
batches: list[tuple[list[str], dict]] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append((str(run_id), routed))


def record_batch(run_ids: list[str], **routed: str) -> None:
    """A BATCH_WAKER that only records what the engine asked for."""
    batches.append((list(run_ids), routed))


def refuse_batch(run_ids: list[str], **routed: str) -> None:
    """A BATCH_WAKER whose broker is down."""
    raise ConnectionError("the broker is down")


RECORDING = {"WAKER": f"{__name__}.record_wake", "BATCH_WAKER": f"{__name__}.record_batch"}
REFUSING = f"{__name__}.refuse_batch"
