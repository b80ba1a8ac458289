"""Declared schedules racing the sweep's slot start and an operator, interleaved deterministically: one side holds
the schedule's row lock in its transaction, the other is let go once Postgres shows it waiting for that lock
(tests/integration/interleavings.py), then both are joined."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import override_settings

from durable_agents import api, clock
from durable_agents.engine import schedules
from durable_agents.engine.declared import sync_declared_schedules
from durable_agents.engine.schedules import slot_after, slot_key, start_due_schedules
from durable_agents.models import Run, Schedule
from tests.integration.interleavings import in_another_connection, joined, until_blocked_on_a_lock

# Slots half a minute and half an hour away from the real time: a test is not timed against a passing slot.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clock_mid_hour")]

HOURLY = {"workflow": "record", "cron": "0 * * * *", "overlap": "allow"}
HALF_HOURLY = {**HOURLY, "cron": "15,45 * * * *"}


def declaring(**schedules_: dict) -> override_settings:
    return override_settings(DURABLE_AGENTS={"SCHEDULES": schedules_})


def test_declared_schedule__a_retiming_sync_waits_for_a_slot_start_and_its_next_slot_wins(monkeypatch):
    with declaring(hourly=HOURLY):
        sync_declared_schedules()
    due = Schedule.objects.get(name="hourly").next_slot
    clock.advance(timedelta(hours=1))
    now = clock.now()
    started, go = threading.Event(), threading.Event()
    original = schedules._start_slot_txn

    def start_then_hold(schedule, slot, skipped):
        run = original(schedule, slot, skipped)
        started.set()
        go.wait(timeout=60)  # the slot's run is in, the advance of next_slot not yet: the row is locked
        return run

    monkeypatch.setattr(schedules, "_start_slot_txn", start_then_hold)
    slot_start = in_another_connection(lambda: start_due_schedules(now))
    assert started.wait(timeout=60)
    with declaring(hourly=HALF_HOURLY):
        sync = in_another_connection(lambda: sync_declared_schedules(now))
        until_blocked_on_a_lock(sync[0], "FOR UPDATE")
        go.set()
        assert joined(*slot_start) == 1
        assert joined(*sync).updated == ["hourly"]
    row = Schedule.objects.get(name="hourly")
    assert row.cron == "15,45 * * * *"
    assert row.next_slot == slot_after("15,45 * * * *", "UTC", now), "the sync's retime, not the slot start's advance"
    assert row.last_slot == due, "the slot start's own bookkeeping is kept"
    assert list(Run.objects.filter(schedule="hourly").values_list("idempotency_key", flat=True)) == [
        slot_key("hourly", row.last_slot)
    ]


def test_declared_schedule__a_pause_taken_while_a_sync_holds_the_row_survives_it():
    with declaring(hourly=HOURLY):
        sync_declared_schedules()
    with declaring(hourly=HALF_HOURLY):
        holder_ready, release = threading.Event(), threading.Event()

        def hold_row():
            # The lock held first, then the sync in the same transaction (its _apply's lock is then re-entrant).
            with transaction.atomic():
                list(Schedule.objects.select_for_update().filter(name="hourly"))
                holder_ready.set()
                release.wait(timeout=60)
                return sync_declared_schedules()

        sync = in_another_connection(hold_row)
        assert holder_ready.wait(timeout=60)
        pause = in_another_connection(lambda: api.pause_schedule("hourly", actor="alice"))
        until_blocked_on_a_lock(pause[0], "FOR UPDATE")
        release.set()
        assert joined(*sync).updated == ["hourly"]
        joined(*pause)
        assert sync_declared_schedules().updated == []
    row = Schedule.objects.get(name="hourly")
    assert row.paused and row.paused_changed_by == "alice" and row.cron == "15,45 * * * *"
