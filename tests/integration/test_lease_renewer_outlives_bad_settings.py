"""The lease renewer is one thread per process: if it died, every lease the process holds would lapse and another
worker would take each run over mid-step. Settings it cannot read (replaced by a test's override, a reload half
done) must leave it renewing on the last interval it read."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
from django.db import connections

from durable_agents import api
from durable_agents.engine import lease
from durable_agents.engine.lease import Heartbeat
from durable_agents.models import Run
from durable_agents.testing import wait_for
from durable_agents.testing.runs import take_lease

pytestmark = pytest.mark.django_db(transaction=True)


def test_lease_renewer__lives_through_settings_it_cannot_read_and_renews_after():
    run = api.start("noop", {"steps": 1})
    claim = take_lease(run.id)
    assert claim is not None
    first_expiry = Run.objects.get(pk=run.id).lease_expires_at
    unreadable = threading.Event()
    readable = lease.lease_seconds

    def lease_seconds() -> float:
        # What `conf.settings` raises when DURABLE_AGENTS is a list (tests/unit/test_checks.py sets one).
        if not unreadable.is_set():
            unreadable.set()
            raise AttributeError("'list' object has no attribute 'get'")
        return readable()

    try:
        with mock.patch.object(lease, "lease_seconds", lease_seconds), Heartbeat(claim) as beat:
            assert unreadable.wait(30), "the renewer never read its interval"
            held_since = beat.renewed_at
            wait_for(lambda: beat.renewed_at > held_since, timeout=60, what="a renewal after the unreadable read")
            assert lease._renewer()._thread.is_alive()
            assert not beat.lost
        assert Run.objects.get(pk=run.id).lease_expires_at > first_expiry, "the renewal reached the database"
    finally:
        connections.close_all()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death this test causes
def test_lease_renewer__a_dead_renewer_is_replaced_and_its_leases_renewed_by_the_next():
    runs = [api.start("noop", {"steps": 1}) for _ in range(2)]
    claims = [take_lease(run.id) for run in runs]
    assert None not in claims
    died = threading.Event()
    readable = lease.lease_seconds

    def lease_seconds() -> float:
        if not died.is_set():
            died.set()
            raise SystemExit("a BaseException no handler in the thread catches (a gevent Timeout, a sys.exit)")
        return readable()

    try:
        with mock.patch.object(lease, "lease_seconds", lease_seconds), Heartbeat(claims[0]) as first:
            dead = lease._renewer()
            assert died.wait(30)
            dead._thread.join(30)
            assert not dead._thread.is_alive()
            with Heartbeat(claims[1]) as second:
                assert lease._renewer() is not dead and lease._renewer()._thread.is_alive()
                held_since = first.renewed_at, second.renewed_at
                wait_for(
                    lambda: first.renewed_at > held_since[0] and second.renewed_at > held_since[1],
                    timeout=60,
                    what="both leases renewed by the new renewer",
                )
            assert not first.lost and not second.lost
    finally:
        connections.close_all()
