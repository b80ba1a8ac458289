"""A worker whose lease expired while it still ran (a zombie: a long GC pause, a partition) shows its attempt twice,
as docs/howto/tracing.md says: drawn `worker_lost` by the worker that took over (from the claim to the lease's expiry:
the takeover cannot tell a dead holder from a late one by the lease alone), and its own span, ended `lease_lost`
when it finds its work refused. Both failed; the takeover's attempt, the next one, completes."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from opentelemetry.trace import StatusCode

from durable_agents import api, clock
from durable_agents.engine.advance import advance
from durable_agents.models import Run
from durable_agents.testing import drive
from durable_agents.workflows import call, registry, workflow

pytestmark = pytest.mark.django_db(transaction=True)

entered = threading.Event()
release = threading.Event()


def _stalls_first(ctx):
    if ctx.attempt == 1:
        entered.set()
        release.wait(60)
    return {"attempt": ctx.attempt}


@pytest.fixture
def stalling():
    entered.clear()
    release.clear()
    workflow("stalls_first", steps=[call("stall", _stalls_first)], replace=True)
    yield
    release.set()
    registry.unregister("stalls_first")


def test_tracing_late_holder__its_attempt_is_drawn_lost_by_the_takeover_and_ended_lease_lost_by_itself(spans, stalling):
    run = api.start("stalls_first", {})

    def zombie():
        try:
            advance(run.id)
        finally:
            connection.close()

    holder = threading.Thread(target=zombie)
    holder.start()
    assert entered.wait(60), "the first attempt never started"
    now = clock.now()
    Run.objects.filter(pk=run.id).update(lease_expires_at=now - timedelta(seconds=1))
    assert drive(run.id).status == "completed"
    release.set()
    holder.join(60)

    first = sorted(
        (s for s in spans.named("step stall") if s.attributes["durable_agents.step.attempt"] == 1),
        key=lambda s: s.end_time,
    )
    assert [s.attributes["durable_agents.step.outcome"] for s in first] == ["worker_lost", "lease_lost"]
    assert all(s.status.status_code == StatusCode.ERROR for s in first)
    (took_over,) = [s for s in spans.named("step stall") if s.attributes["durable_agents.step.attempt"] == 2]
    assert took_over.attributes["durable_agents.step.outcome"] == "completed"
    assert spans.orphans() == []
