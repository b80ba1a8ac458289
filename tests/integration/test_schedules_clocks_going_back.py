"""A schedule at a fixed wall-clock time fires once on a day the clocks go back, in any time zone."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from durable_agents import clock
from durable_agents.engine.schedules import each_slot

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


@pytest.mark.parametrize(
    ("tz", "cron", "day"),
    [
        ("Australia/Lord_Howe", "45 1 * * *", "2026-04-05"),  # clocks back 30 minutes: 01:45 happens twice
        ("Australia/Lord_Howe", "15,45 1 * * *", "2026-04-05"),  # fixed times: the repeated half hour fires once
        ("America/New_York", "30 1 * * *", "2026-11-01"),  # clocks back an hour: 01:30 happens twice
    ],
)
def test_schedule__a_fixed_hour_fires_once_on_a_day_the_clocks_go_back_in_any_zone(tz, cron, day):
    start = datetime.fromisoformat(f"{day}T00:00").replace(tzinfo=ZoneInfo(tz))
    slots = []
    for slot in each_slot(cron, tz, start - timedelta(minutes=1)):
        if slot >= start + timedelta(days=1):
            break
        slots.append(slot)
    walls = [slot.astimezone(ZoneInfo(tz)).strftime("%H:%M") for slot in slots]
    assert len(walls) == len(set(walls)), f"a wall-clock time fired twice: {walls}"
    assert walls, "the day has its slots"
