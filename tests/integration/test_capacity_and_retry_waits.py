"""A step waiting for the shared rate limit's capacity or for its retry backoff: the attempt is given back
(never below zero), a zombie writes nothing, and a cancel requested while the step ran is settled at once.
"""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine import transitions
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import ModelUnavailableError
from durable_agents.models import Event, Run, RunStatus
from durable_agents.workflows import call, workflow

ON = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 50}
woken: list[str] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_wake", **changes})


# --- the capacity wait ------------------------------------------------------------------------------------------


def _capacity(ctx) -> dict[str, Any]:
    raise ModelUnavailableError("no room", retry_after=30.0, capacity_wait=True)


def _capacity_after_cancel(ctx) -> dict[str, Any]:
    api.cancel(ctx.run.id, "stop waiting")
    raise ModelUnavailableError("no room", retry_after=30.0, capacity_wait=True)


@pytest.mark.django_db(transaction=True)
def test_capacity_wait__gives_the_attempt_back_and_never_below_zero():
    workflow("cap17", steps=[call("a", _capacity)], replace=True)
    run = api.start("cap17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.RETRY
    run.refresh_from_db()
    assert run.attempt == 0 and run.wake_at is not None and not run.lease_owner
    assert Event.objects.filter(run_id=run.id, kind="capacity_wait").count() == 1


@pytest.mark.django_db(transaction=True)
def test_capacity_wait__a_zombie_writes_nothing():
    def taken_over(ctx) -> dict[str, Any]:
        Run.objects.filter(pk=ctx.run.id).update(lease_expires_at=None)
        assert transitions.claim_run(ctx.run.id) is not None  # another worker took the run over
        raise ModelUnavailableError("no room", retry_after=30.0, capacity_wait=True)

    workflow("capzombie17", steps=[call("a", taken_over)], replace=True)
    run = api.start("capzombie17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.LEASE_LOST
    run.refresh_from_db()
    assert run.lease_owner and run.attempt == 2 and run.wake_at is None, "the holder's claim is untouched"
    assert not Event.objects.filter(run_id=run.id, kind="capacity_wait").exists()


@pytest.mark.django_db(transaction=True)
def test_capacity_wait__a_cancel_requested_while_the_step_ran_is_settled_at_once():
    workflow("capcancel17", steps=[call("a", _capacity_after_cancel)], replace=True)
    run = api.start("capcancel17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.CANCELLED
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED, "a step that ended waiting must not hold a cancel for its wait"
    assert run.cancel_requested_at is None and not run.lease_owner


def _flaky_after_cancel(ctx) -> dict[str, Any]:
    api.cancel(ctx.run.id, "stop retrying")
    raise ConnectionError("the service hiccuped")


@pytest.mark.django_db(transaction=True)
def test_retry__a_cancel_requested_while_the_step_ran_is_settled_at_once_not_after_the_backoff():
    workflow("retrycancel17", steps=[call("a", _flaky_after_cancel)], replace=True)
    run = api.start("retrycancel17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.CANCELLED
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.cancel_requested_at is None and not run.lease_owner
