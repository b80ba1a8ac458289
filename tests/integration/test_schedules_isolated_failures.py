"""A schedule that cannot start a slot (its plan raises, any exception starting it) keeps the failure to itself:
the other schedules still start.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from durable_agents import api, clock
from durable_agents.api import PlannedStep, call, workflow
from durable_agents.engine.sweep import sweep
from durable_agents.models import Run, Schedule

# Slots half a minute and half an hour away from the real time: a test is not timed against a passing slot.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clock_mid_hour")]


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
