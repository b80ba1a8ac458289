"""Wake-ups of model-bound runs reach MODEL_QUEUE even through a WAKER that takes no queue argument."""

from __future__ import annotations

import uuid

from django.test import override_settings

from durable_agents.engine import wake as wake_module
from durable_agents.models import StepKind

CALLS: list[tuple] = []


def legacy_waker(run_id: str, countdown: float | None = None) -> None:
    """A WAKER written against the documented pre-bacfaa3 signature `waker(run_id, countdown=None)`."""
    CALLS.append((run_id, countdown))


# -- routing ----------------------------------------------------------------------------------------------


@override_settings(DURABLE_AGENTS={"MODEL_QUEUE": "durable-model", "WAKER": f"{__name__}.legacy_waker"})
def test_wake__a_waker_without_queue_still_wakes_model_bound_runs():
    """A custom WAKER written for the old signature (no `queue` keyword) is handed `queue=` for every model-bound
    wake-up; the TypeError is swallowed by wake()'s `except Exception` ("the sweep will") — but the sweep wakes
    through the same wake(), so an agent run is never woken again, and nothing but a log line says so."""
    wake_module._waker.cache_clear()
    CALLS.clear()
    run_id = uuid.uuid4()
    try:
        wake_module.wake(run_id, kind=StepKind.CALL)
        wake_module.wake(run_id, kind=StepKind.AGENT)
    finally:
        wake_module._waker.cache_clear()
    assert len(CALLS) == 2, (
        f"the waker was called {len(CALLS)} time(s) for 2 wake-ups: the agent step's wake-up (queue=...) was "
        "dropped with a logged TypeError, and the sweep's re-wake goes through the same call"
    )
