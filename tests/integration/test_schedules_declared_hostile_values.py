"""Declared schedules whose values the checks must refuse before the database does: one such declaration is
skipped (E017) and logged, and the sweep pass goes on to the other declarations and its other work.

A value Postgres refuses (a cron longer than its column, a name with a lone surrogate) would otherwise fail
the sweep's INSERT, and with it every sweep pass, for as long as the declaration is deployed.
"""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from durable_agents.engine.declared import sync_declared_schedules
from durable_agents.engine.schedules import check_cron
from durable_agents.engine.sweep import sweep
from durable_agents.models import Schedule

# Slots half a minute and half an hour away from the real time: a test is not timed against a passing slot.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clock_mid_hour")]

HOURLY = {"workflow": "record", "cron": "0 * * * *"}
# A valid five-field cron (every minute of every hour, listed out) longer than Schedule.cron's 200 characters.
LONG_CRON = ",".join(str(m) for m in range(60)) + " " + ",".join(str(h) for h in range(24)) + " * * *"


def declaring(**schedules: dict) -> override_settings:
    return override_settings(DURABLE_AGENTS={"SCHEDULES": schedules})


def test_declared_schedule__a_valid_cron_longer_than_its_column_is_skipped_and_the_sweep_goes_on():
    assert len(LONG_CRON) > 200 and check_cron(LONG_CRON)
    with declaring(long={"workflow": "record", "cron": LONG_CRON}, hourly=HOURLY):
        sweep()
        report = sync_declared_schedules()
        errors = [m for m in run_checks() if m.id == "durable_agents.E017"]
    assert sorted(Schedule.objects.values_list("name", flat=True)) == ["hourly"]
    assert report.created == [] and report.updated == []
    assert errors and "200" in errors[0].msg


def test_declared_schedule__a_name_postgres_cannot_store_is_skipped_and_the_sweep_goes_on():
    with declaring(**{"bad\ud800name": HOURLY, "hourly": HOURLY}):
        sweep()
        errors = [m for m in run_checks() if m.id == "durable_agents.E017"]
    assert sorted(Schedule.objects.values_list("name", flat=True)) == ["hourly"]
    assert errors, "the checks report the name too"


def test_declared_schedule__an_input_json_stores_differently_is_written_once_not_at_every_pass():
    # A tuple is stored as a JSON array, an int key as a string: compared as declared, the row would never match.
    declared = {**HOURLY, "input": {"ids": (1, 2), "by": {7: "seven"}}}
    with declaring(hourly=declared):
        assert sync_declared_schedules().created == ["hourly"]
        before = Schedule.objects.get(name="hourly").updated_at
        report = sync_declared_schedules()
    assert report.updated == [], "the same declaration again changes nothing"
    row = Schedule.objects.get(name="hourly")
    assert row.input == {"ids": [1, 2], "by": {"7": "seven"}} and row.updated_at == before


@pytest.mark.parametrize("unreadable", [["hourly"], "hourly", 3])
def test_declared_schedule__a_schedules_setting_that_is_no_dict_removes_none_of_its_rows(unreadable, caplog):
    with declaring(hourly=HOURLY):
        sync_declared_schedules()
    with override_settings(DURABLE_AGENTS={"SCHEDULES": unreadable}):
        report = sync_declared_schedules()
        sweep()
        errors = [m for m in run_checks() if m.id == "durable_agents.E003"]
    assert report.removed == [] and list(Schedule.objects.values_list("name", flat=True)) == ["hourly"]
    assert errors, "the checks say the setting is wrong"


def test_declared_schedule__a_durable_agents_setting_that_is_no_dict_removes_none_of_its_rows():
    with declaring(hourly=HOURLY):
        sync_declared_schedules()
    with override_settings(DURABLE_AGENTS=[("SCHEDULES", {})]):
        assert sync_declared_schedules().removed == []
    assert list(Schedule.objects.values_list("name", flat=True)) == ["hourly"]
