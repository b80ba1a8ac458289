"""Who paused or resumed a schedule is kept on it (a schedule has no run to hold an Event): from `--as` on the command
line, the admin's user, or `api.pause_schedule(actor=...)`."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from durable_agents import api, clock
from durable_agents.management.commands._base import DEFAULT_ACTOR
from durable_agents.models import Schedule

pytestmark = pytest.mark.django_db


def schedules(*args: str) -> str:
    out = StringIO()
    call_command("durable_schedules", *args, stdout=out)
    return out.getvalue()


def test_durable_schedules_pause__records_who_paused_it():
    api.schedule("nightly", "record", cron="0 3 * * *")
    before = clock.now()
    assert "schedule nightly: paused (by alice)" in schedules("pause", "nightly", "--as", "alice")
    schedule = Schedule.objects.get(name="nightly")
    assert schedule.paused and schedule.paused_changed_by == "alice", "`--as alice` must be kept as who paused"
    assert schedule.paused_changed_at is not None and schedule.paused_changed_at >= before
    assert "paused by alice" in schedules("list")
    [row] = json.loads(schedules("list", "--json"))
    assert row["paused_changed_by"] == "alice" and row["paused_changed_at"] is not None


def test_durable_schedules_resume__records_who_resumed_it_and_a_second_pause_changes_nothing():
    api.schedule("nightly", "record", cron="0 3 * * *")
    schedules("pause", "nightly", "--as", "alice")
    schedules("pause", "nightly", "--as", "mallory")
    assert Schedule.objects.get(name="nightly").paused_changed_by == "alice", "pausing a paused schedule is a no-op"
    schedules("resume", "nightly", "--as", "bob")
    schedule = Schedule.objects.get(name="nightly")
    assert not schedule.paused and schedule.paused_changed_by == "bob"


def test_durable_schedules_pause__without_as_records_the_default_actor():
    api.schedule("nightly", "record", cron="0 3 * * *")
    schedules("pause", "nightly")
    assert Schedule.objects.get(name="nightly").paused_changed_by == DEFAULT_ACTOR


def test_durable_schedules_pause__an_actor_too_long_is_refused_and_changes_nothing():
    api.schedule("nightly", "record", cron="0 3 * * *")
    with pytest.raises(CommandError, match="200") as raised:
        schedules("pause", "nightly", "--as", "a" * 201)
    assert raised.value.returncode == 2
    assert not Schedule.objects.get(name="nightly").paused


def test_api_pause_schedule__keeps_the_actor():
    api.schedule("nightly", "record", cron="0 3 * * *")
    assert api.pause_schedule("nightly", actor="deploy-bot").paused_changed_by == "deploy-bot"


@pytest.mark.parametrize("actor", ["", "   ", "\t"])
def test_durable_schedules_pause__a_blank_actor_is_refused_and_changes_nothing(actor):
    api.schedule("nightly", "record", cron="0 3 * * *")
    with pytest.raises(CommandError, match="--as") as raised:
        schedules("pause", "nightly", "--as", actor)
    assert raised.value.returncode == 2 and "\n" not in str(raised.value)
    schedule = Schedule.objects.get(name="nightly")
    assert not schedule.paused and schedule.paused_changed_by == "", "who paused it must never be recorded as no one"
