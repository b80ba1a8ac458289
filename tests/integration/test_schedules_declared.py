"""Declared schedules: each sweep keeps their rows in step with the code, and never touches one api.schedule made.

Declarations come from `override_settings(DURABLE_AGENTS={"SCHEDULES": ...})` and from workflows registered in the
test (`isolated_registries`); the sweep is called in-process, the clock moved by hand (`clock.advance`), as in
test_schedules.py. A slot's run is found by its idempotency key "schedule:<name>:<slot>".
"""

from __future__ import annotations

import json
import logging
import re
import threading
from datetime import timedelta

import pytest
from django.core.checks import run_checks
from django.db import connections
from django.test import override_settings
from django.urls import reverse

from durable_agents import api, clock
from durable_agents.engine.declared import sync_declared_schedules
from durable_agents.engine.schedules import slot_after, slot_key
from durable_agents.engine.sweep import sweep
from durable_agents.errors import ScheduleDeclaredError
from durable_agents.models import Run, Schedule
from durable_agents.workflows import call, workflow

# Slots half a minute and half an hour away from the real time: a test is not timed against a passing slot.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clock_mid_hour")]

NIGHTLY = {"workflow": "record", "cron": "0 3 * * *", "timezone": "Europe/Paris", "input": {"steps": 1}}
HOURLY = {"workflow": "record", "cron": "0 * * * *", "overlap": "allow"}


def declaring(**schedules: dict) -> override_settings:
    return override_settings(DURABLE_AGENTS={"SCHEDULES": schedules})


def runs_of(name: str) -> list[str]:
    return sorted(Run.objects.filter(schedule=name).values_list("idempotency_key", flat=True))


def _tick(ctx):
    return {}


def test_declared_schedule__the_sweep_creates_it_once_marked_as_declared():
    with declaring(nightly=NIGHTLY):
        sweep()
        sweep()
    [row] = Schedule.objects.all()
    assert (row.name, row.workflow, row.cron, row.timezone, row.input) == (
        "nightly",
        "record",
        "0 3 * * *",
        "Europe/Paris",
        {"steps": 1},
    )
    assert row.declared == "setting" and not row.paused and row.next_slot > clock.now()


def test_declared_schedule__a_workflow_declares_one_named_after_it(isolated_registries):
    workflow("digest", steps=[call("tick", _tick)], schedule=api.cron("30 6 * * 1-5", input={"days": 1}))
    report = sync_declared_schedules()
    assert report.created == ["digest"]
    row = Schedule.objects.get(name="digest")
    assert (row.declared, row.workflow, row.cron, row.input) == ("workflow", "digest", "30 6 * * 1-5", {"days": 1})


def test_declared_schedule__a_changed_declaration_updates_its_row_and_nothing_else():
    with declaring(nightly=NIGHTLY):
        sweep()
    before = Schedule.objects.get(name="nightly")
    with declaring(nightly={**NIGHTLY, "input": {"steps": 2}, "overlap": "allow"}):
        assert sync_declared_schedules().updated == ["nightly"]
        assert sync_declared_schedules().updated == [], "the same declaration again changes nothing"
    after = Schedule.objects.get(name="nightly")
    assert after.input == {"steps": 2} and after.overlap == "allow"
    assert after.next_slot == before.next_slot, "a new input or policy keeps the schedule's place"


def test_declared_schedule__a_new_cron_starts_from_its_next_slot_and_never_repeats_a_started_one():
    with declaring(hourly=HOURLY):
        sweep()
        clock.advance(timedelta(hours=1))
        assert sweep().scheduled == 1
    [started] = runs_of("hourly")
    # The new cron also names the slot just started (hh:00): it is not started again, nor is anything owed.
    with declaring(hourly={**HOURLY, "cron": "0,30 * * * *"}):
        now = clock.now()
        assert sync_declared_schedules(now).updated == ["hourly"]
        assert sweep().scheduled == 0
        following = slot_after("0,30 * * * *", "UTC", now)
        assert Schedule.objects.get(name="hourly").next_slot == following, "retimed from the first slot after now"
        clock.advance(timedelta(minutes=30))  # past `following`, short of the slot after it
        assert sweep().scheduled == 1
    assert runs_of("hourly") == sorted([started, slot_key("hourly", following)])


def test_declared_schedule__it_starts_its_slots_through_the_sweep():
    with declaring(hourly=HOURLY):
        sweep()
        first = Schedule.objects.get(name="hourly").next_slot
        clock.advance(timedelta(hours=2))
        assert sweep().scheduled == 1, "missed='skip': the latest missed slot is started, once"
        assert sweep().scheduled == 0
    assert runs_of("hourly") == [slot_key("hourly", first + timedelta(hours=1))]


def test_declared_schedule__a_removed_declaration_deletes_its_row_only():
    api.schedule("adhoc", "record", cron="0 5 * * *")
    with declaring(nightly=NIGHTLY, hourly=HOURLY):
        sweep()
    with declaring(hourly=HOURLY):
        report = sync_declared_schedules()
    assert report.removed == ["nightly"]
    assert sorted(Schedule.objects.values_list("name", "declared")) == [("adhoc", ""), ("hourly", "setting")]
    with declaring():
        sweep()
    assert list(Schedule.objects.values_list("name", flat=True)) == ["adhoc"], "api.schedule's row is never removed"


def test_declared_schedule__a_workflow_version_without_it_removes_it(isolated_registries):
    workflow("digest", steps=[call("tick", _tick)], schedule=api.cron("0 3 * * *"))
    sync_declared_schedules()
    workflow("digest", version=2, steps=[call("tick", _tick)])
    assert sync_declared_schedules().removed == ["digest"] and not Schedule.objects.exists()


def test_declared_schedule__an_operators_pause_survives_the_sync():
    with declaring(nightly=NIGHTLY):
        sweep()
        api.pause_schedule("nightly")
        sweep()
    with declaring(nightly={**NIGHTLY, "cron": "0 4 * * *", "input": {"steps": 3}}):
        sweep()
    row = Schedule.objects.get(name="nightly")
    assert row.paused, "a redeploy must not unpause what an operator paused; resume it by hand"
    assert row.cron == "0 4 * * *" and row.input == {"steps": 3}


def test_declared_schedule__an_invalid_declaration_keeps_its_row_as_it_was(caplog):
    with declaring(nightly=NIGHTLY):
        sweep()
    with declaring(nightly={**NIGHTLY, "cron": "0 3 * *"}), caplog.at_level(logging.WARNING, "durable_agents.engine"):
        report = sync_declared_schedules()
        sync_declared_schedules()
    assert report.updated == [] and report.removed == []
    assert Schedule.objects.get(name="nightly").cron == "0 3 * * *"
    said = [r.getMessage() for r in caplog.records if "declared schedule skipped" in r.getMessage()]
    assert len(said) == 1 and "invalid cron expression '0 3 * *'" in said[0], "said once a process, not each sweep"


def test_declared_schedule__concurrent_syncs_create_one_row():
    barrier = threading.Barrier(4)
    reports, errors = [], []

    def syncer() -> None:
        try:
            barrier.wait(timeout=60)
            reports.append(sync_declared_schedules())
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    with declaring(nightly=NIGHTLY, hourly=HOURLY):
        threads = [threading.Thread(target=syncer) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, f"a sync failed: {errors[0]!r}"
    assert sorted(Schedule.objects.values_list("name", flat=True)) == ["hourly", "nightly"]
    created = sorted(name for report in reports for name in report.created)
    assert created == ["hourly", "nightly"], f"each row is created by one sync, the others find it: {reports}"
    assert not any(report.updated for report in reports), "a sync that lost the race has nothing to change"


def test_declared_schedule__a_name_api_schedule_holds_is_refused_and_reported(caplog):
    api.schedule("nightly", "record", cron="0 5 * * *")
    with declaring(nightly=NIGHTLY), caplog.at_level(logging.WARNING, "durable_agents.engine"):
        report = sync_declared_schedules()
        sweep()
        e019 = [m for m in run_checks(tags=["durable_agents"], databases=["default"]) if m.id.endswith("E019")]
    assert report.refused == ["nightly"]
    row = Schedule.objects.get(name="nightly")
    assert (row.cron, row.declared, row.timezone) == ("0 5 * * *", "", "UTC"), "the api.schedule row is untouched"
    said = [r.getMessage() for r in caplog.records if "is not applied" in r.getMessage()]
    assert len(said) == 1 and "durable_schedules delete nightly" in said[0]
    [message] = e019
    assert "schedule 'nightly' is declared" in message.msg and "durable_schedules delete nightly" in message.hint


def test_declared_schedule__api_schedule_and_unschedule_refuse_a_declared_name():
    with declaring(nightly=NIGHTLY):
        sweep()
        with pytest.raises(ScheduleDeclaredError, match=r"declared in code \(DURABLE_AGENTS\[\"SCHEDULES\"\]"):
            api.schedule("nightly", "record", cron="0 5 * * *")
        with pytest.raises(ScheduleDeclaredError, match="the next sweep would create it again"):
            api.unschedule("nightly")
    assert Schedule.objects.get(name="nightly").cron == "0 3 * * *"


def test_durable_schedules__shows_where_each_is_declared_and_refuses_to_delete_a_declared_one(
    manage, isolated_registries
):
    api.schedule("adhoc", "record", cron="0 5 * * *")
    workflow("digest", steps=[call("tick", _tick)], schedule=api.cron("0 6 * * *"))
    with declaring(nightly=NIGHTLY):
        sync_declared_schedules()
    listed = manage("durable_schedules").stdout.splitlines()
    origins = {line.split("  ")[0]: line for line in listed}
    assert origins["nightly"].endswith('declared in DURABLE_AGENTS["SCHEDULES"]'), listed
    assert origins["digest"].endswith("declared on its workflow (cron)"), listed
    assert origins["adhoc"].endswith("made with api.schedule"), listed
    rows = {row["name"]: row["declared"] for row in json.loads(manage("durable_schedules", "--json").stdout)}
    assert rows == {"adhoc": None, "digest": "workflow", "nightly": "setting"}
    refused = manage("durable_schedules", "delete", "nightly")
    assert refused.returncode == 2 and refused.stdout == ""
    [line] = refused.stderr.strip().splitlines()
    assert "the next sweep would create it again: remove its declaration" in line, line
    assert Schedule.objects.filter(name="nightly").exists()
    deleted = manage("durable_schedules", "delete", "adhoc")
    assert deleted.returncode == 0 and "schedule adhoc deleted" in deleted.stdout
    assert not Schedule.objects.filter(name="adhoc").exists()


def test_schedule_admin__says_where_each_schedule_is_defined(admin_client, isolated_registries):
    api.schedule("adhoc", "record", cron="0 5 * * *")
    workflow("digest", steps=[call("tick", _tick)], schedule=api.cron("0 6 * * *"))
    with declaring(nightly=NIGHTLY):
        sync_declared_schedules()
    page = admin_client.get(reverse("admin:durable_agents_schedule_changelist")).content.decode()
    rows = {
        name: row
        for name in ("adhoc", "digest", "nightly")
        for row in re.findall(r"<tr>.*?</tr>", page, re.S)
        if f">{name}<" in row
    }
    assert "<code>DURABLE_AGENTS[&quot;SCHEDULES&quot;]</code>" in rows["nightly"], rows["nightly"]
    assert "workflow <code>digest</code> (cron)" in rows["digest"], rows["digest"]
    assert "api.schedule" in rows["adhoc"], rows["adhoc"]
    declared_only = admin_client.get(reverse("admin:durable_agents_schedule_changelist") + "?declared=setting")
    assert ">nightly<" in declared_only.content.decode() and ">adhoc<" not in declared_only.content.decode()
