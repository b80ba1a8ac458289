"""Where a schedule's slots fall, across daylight-saving changes (pure functions: no database, no clock).

Vixie cron's rule: a job at a fixed time runs once, also on the day the clocks go back and its hour happens
twice; a job whose minute or hour field starts with `*` (`*`, `*/15`) follows real time, in both passes of the
repeated hour. On the day the clocks go forward, a fixed time in the missing hour runs at the
first minute after it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from durable_agents.engine.schedules import owed_slots, slot_after
from durable_agents.models import MissedSlots, Schedule

PARIS = "Europe/Paris"  # clocks back 2026-10-25 03:00 CEST -> 02:00 CET; forward 2026-03-29 02:00 -> 03:00


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def walk(cron: str, tz: str, after: datetime, count: int) -> list[datetime]:
    found = [slot_after(cron, tz, after)]
    while len(found) < count:
        found.append(slot_after(cron, tz, found[-1]))
    return found


def test_a_fixed_time_in_the_repeated_hour_runs_once_when_the_clocks_go_back():
    slots = walk("30 2 * * *", PARIS, utc(2026, 10, 24, 12), 3)
    assert slots == [utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30), utc(2026, 10, 27, 1, 30)]


@pytest.mark.parametrize("cron", ["@daily", "0 2 * * *", "15 1-3 * * *", "0 2,14 * * *"])
def test_no_fixed_hour_doubles_on_the_day_the_clocks_go_back(cron):
    slots = [slot for slot in walk(cron, PARIS, utc(2026, 10, 24, 12), 30) if slot < utc(2026, 10, 25, 22)]
    walls = [slot.astimezone(ZoneInfo(PARIS)).replace(tzinfo=None) for slot in slots]
    assert walls and len(walls) == len(set(walls)), f"a wall-clock slot started twice: {walls}"


def test_an_hourly_schedule_runs_in_both_passes_of_the_repeated_hour():
    slots = walk("*/30 * * * *", PARIS, utc(2026, 10, 24, 23, 59), 6)
    assert slots == [utc(2026, 10, 25, 0, 0) + timedelta(minutes=30 * i) for i in range(6)]


def test_a_wildcard_minute_in_a_fixed_hour_follows_real_time_through_both_passes():
    slots = walk("*/20 2 * * *", PARIS, utc(2026, 10, 24, 23, 59), 6)
    assert slots == [utc(2026, 10, 25, 0, 0) + timedelta(minutes=20 * i) for i in range(6)]


def test_a_fixed_time_in_the_missing_hour_runs_once_just_after_it_when_the_clocks_go_forward():
    slots = walk("30 2 * * *", PARIS, utc(2026, 3, 28, 12), 2)
    assert slots == [utc(2026, 3, 29, 1, 0), utc(2026, 3, 30, 0, 30)]


@pytest.mark.parametrize("missed", [MissedSlots.SKIP, MissedSlots.CATCH_UP])
def test_catching_up_across_the_repeated_hour_owes_the_fixed_time_once(missed):
    schedule = Schedule(cron="30 2 * * *", timezone=PARIS, missed=missed, catch_up_limit=10)
    schedule.next_slot = utc(2026, 10, 24, 0, 30)
    slots = owed_slots(schedule, utc(2026, 10, 26, 12))
    expected = [utc(2026, 10, 24, 0, 30), utc(2026, 10, 25, 0, 30), utc(2026, 10, 26, 1, 30)]
    assert slots.due == (expected if missed == MissedSlots.CATCH_UP else expected[-1:])
    assert slots.skipped == (0 if missed == MissedSlots.CATCH_UP else 2)
    assert slots.next_slot == utc(2026, 10, 27, 1, 30)
