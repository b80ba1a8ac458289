"""The lease renewer is one thread per process: if it died, every lease the process holds would lapse and another
worker would take each run over mid-step. Settings it cannot read (replaced by a test's override, a reload half
done) must leave it renewing on the last interval it read."""

from __future__ import annotations

import os
import threading
from unittest import mock

import pytest
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine import lease
from durable_agents.engine.lease import Heartbeat
from durable_agents.models import Run
from durable_agents.testing import wait_for
from durable_agents.testing.runs import take_lease

pytestmark = pytest.mark.django_db(transaction=True)


def test_lease_renewer__a_dead_renewer_is_replaced_and_its_leases_renewed_by_the_next():
    """The renewer outlives what a round raises; should its thread die anyway (its handler raising too), the next
    heartbeat to enter or leave replaces it, and the new one renews the dead one's heartbeats."""
    runs = [api.start("noop", {"steps": 1}) for _ in range(2)]
    claims = [take_lease(run.id) for run in runs]
    assert None not in claims
    dead = lease._Renewer.__new__(lease._Renewer)  # a renewer whose thread has ended
    dead.pid, dead._beats, dead._lock = os.getpid(), set(), threading.Lock()
    dead._thread = threading.Thread(target=lambda: None)
    dead._thread.start()
    dead._thread.join()
    first = Heartbeat(claims[0])
    dead.add(first)
    serving, lease._the_renewer = lease._the_renewer, dead
    try:
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
        lease._renewer().discard(first)
        if serving is not None:  # the thread it replaced runs on, with no heartbeat: give the process its own back
            lease._the_renewer = serving
        connections.close_all()


def test_lease_renewer__renews_on_the_last_lease_it_read_while_the_settings_stay_unreadable():
    run = api.start("noop", {"steps": 1})
    claim = take_lease(run.id)
    assert claim is not None

    def unreadable() -> float:
        raise AttributeError("'list' object has no attribute 'get'")

    try:
        with mock.patch.object(lease, "lease_seconds", unreadable), Heartbeat(claim) as beat:
            held_since = beat.renewed_at
            # Its interval is LEASE_SECONDS / 3 as last read (2 s in the tests), or 1 s if never read: 60 s is many.
            wait_for(lambda: beat.renewed_at > held_since, timeout=60, what="a renewal while the settings are bad")
            assert not beat.lost
    finally:
        connections.close_all()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(
    "raised",
    [
        # What `conf.settings` raises when DURABLE_AGENTS is a list (tests/unit/test_checks.py sets one).
        AttributeError("'list' object has no attribute 'get'"),
        # What no handler catches: a gevent Timeout, a sys.exit in a signal handler.
        SystemExit("a BaseException"),
    ],
    ids=["unreadable-settings", "base-exception"],
)
def test_lease_renewer__a_lone_heartbeat_is_renewed_after_a_round_that_raised(raised):
    """A prefork process runs one step at a time: nothing enters another heartbeat to replace a dead renewer, so the
    renewer itself must outlive a round that raised, whatever it raised, and renew the heartbeat after it."""
    run = api.start("noop", {"steps": 1})
    claim = take_lease(run.id)
    assert claim is not None
    first_expiry = Run.objects.get(pk=run.id).lease_expires_at
    once = threading.Event()
    readable = lease.lease_seconds

    def lease_seconds() -> float:
        if not once.is_set():
            once.set()
            raise raised
        return readable()

    try:
        with mock.patch.object(lease, "lease_seconds", lease_seconds), Heartbeat(claim) as beat:
            assert once.wait(30), "the renewer never read its interval"
            held_since = beat.renewed_at
            wait_for(lambda: beat.renewed_at > held_since, timeout=60, what="a renewal after the round that raised")
            assert lease._renewer()._thread.is_alive()
            assert not beat.lost
        assert Run.objects.get(pk=run.id).lease_expires_at > first_expiry, "the renewal reached the database"
    finally:
        connections.close_all()


@pytest.mark.parametrize("bad", [-3.0, 0.0, float("nan")], ids=["negative", "zero", "nan"])
def test_lease_renewer__a_lease_it_cannot_sleep_on_leaves_it_renewing_on_the_last_good_one(bad):
    """Settings replaced at run time (override_settings; the system check runs at start only) with no positive
    LEASE_SECONDS: time.sleep(-1) raises and 0 would spin; the renewer keeps the last good lease."""
    run = api.start("noop", {"steps": 1})
    claim = take_lease(run.id)
    assert claim is not None
    try:
        with Heartbeat(claim) as beat:
            renewer = lease._renewer()
            with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "LEASE_SECONDS": bad}):
                held_since = beat.renewed_at
                wait_for(lambda: beat.renewed_at > held_since, timeout=60, what="a renewal on the last good lease")
            assert renewer._thread.is_alive() and lease._renewer() is renewer
            assert not beat.lost
    finally:
        connections.close_all()
