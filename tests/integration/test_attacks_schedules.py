"""Attacks on scheduled runs (issue 19): a schedule that cannot start must not stop the others."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from durable_agents import api, clock
from durable_agents.api import PlannedStep, call, workflow
from durable_agents.engine.schedules import each_slot
from durable_agents.engine.sweep import sweep
from durable_agents.models import Run, Schedule

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


def _plan_needs_n(run_input):
    return [PlannedStep(f"work{run_input['n']}", "work")]  # KeyError on an input that no longer fits


def test_schedule__a_plan_that_raises_on_its_input_does_not_stop_the_other_schedules(isolated_registries):
    workflow("needs_n", steps=[call("work", lambda ctx: {})], plan=_plan_needs_n)
    api.schedule("broken", "needs_n", cron="* * * * *", input={"m": 1})
    api.schedule("healthy", "record", cron="* * * * *")
    # The broken one is owed first (oldest next_slot): it sorts ahead of the healthy one at every sweep.
    Schedule.objects.filter(name="broken").update(next_slot=clock.now() - timedelta(hours=1))
    clock.advance(timedelta(minutes=2))
    report = sweep()
    assert report.scheduled == 1, report
    assert Run.objects.filter(workflow="record").count() == 1, "the healthy schedule's slot was started"
    broken = Schedule.objects.get(name="broken")
    assert "'n'" in broken.last_error and broken.next_slot <= clock.now(), broken.last_error


class ReportDown(RuntimeError):
    pass


def _plan_calls_a_service(run_input):
    raise ReportDown("the report service is down")  # any exception of the product's code, not only bad input


def test_schedule__any_exception_starting_a_slot_stays_with_its_schedule(isolated_registries, caplog):
    workflow("flaky_plan", steps=[call("work", lambda ctx: {})], plan=_plan_calls_a_service)
    api.schedule("broken", "flaky_plan", cron="* * * * *")
    api.schedule("healthy", "record", cron="* * * * *", overlap="allow")  # its runs stay pending (no worker)
    Schedule.objects.filter(name="broken").update(next_slot=clock.now() - timedelta(hours=1))
    clock.advance(timedelta(minutes=2))
    with caplog.at_level("WARNING", logger="durable_agents.engine"):
        assert sweep().scheduled == 1
        clock.advance(timedelta(minutes=1))
        assert sweep().scheduled == 1
    assert Run.objects.filter(workflow="record").count() == 2, "the healthy schedule went on at every sweep"
    assert not Run.objects.filter(workflow="flaky_plan").exists()
    broken = Schedule.objects.get(name="broken")
    assert broken.last_error == "ReportDown: the report service is down" and broken.next_slot <= clock.now()
    logged = [r for r in caplog.records if "schedule broken could not start" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info, "logged once, with its traceback"


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
