"""The system checks refuse a declared schedule that the sweep could not apply, with a hint, before it is deployed."""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from durable_agents.api import cron
from durable_agents.engine.declared import declarations
from durable_agents.errors import DefinitionError
from durable_agents.workflows import call, workflow

GOOD = {"workflow": "noop", "cron": "0 3 * * *", "timezone": "Europe/Paris", "input": {"steps": 1}}


def messages(schedules: dict) -> list:
    with override_settings(DURABLE_AGENTS={"SCHEDULES": schedules}):
        found = run_checks(tags=["durable_agents"])
    return [m for m in found if m.id in {"durable_agents.E017", "durable_agents.E018"}]


def _tick(ctx):
    return {}


def test_check_declared_schedules__a_good_declaration_passes():
    assert messages({"nightly": GOOD}) == []
    [declared] = declarations_in({"nightly": GOOD})
    assert declared.fields["declared"] == "setting" and declared.fields["timezone"] == "Europe/Paris"


def declarations_in(schedules: dict) -> list:
    with override_settings(DURABLE_AGENTS={"SCHEDULES": schedules}):
        return declarations().valid


@pytest.mark.parametrize(
    ("entry", "says", "hint"),
    [
        ({**GOOD, "workflow": "nightly_digest"}, "unknown workflow 'nightly_digest'", "Define workflow"),
        ({**GOOD, "cron": "0 3 * *"}, "invalid cron expression '0 3 * *'", "five fields"),
        ({**GOOD, "cron": "0 0 31 2 *"}, "never fires", "five fields"),
        ({**GOOD, "timezone": "Europe/Pariss"}, "unknown time zone 'Europe/Pariss'", "IANA"),
        ({**GOOD, "tz": "UTC"}, "unknown option(s) tz", "Use only workflow, cron, timezone"),
        ({**GOOD, "overlap": "queue"}, "overlap must be one of skip, allow", "api.schedule accepts"),
        ({**GOOD, "missed": "all"}, "missed must be one of skip, catch_up", "api.schedule accepts"),
        ({**GOOD, "catch_up_limit": 0}, "catch_up_limit is a whole number >= 1", "api.schedule accepts"),
        ({"workflow": "noop"}, "lacks cron", "e.g. {"),
        ({**GOOD, "cron": 3}, "cron must be a string", "e.g. {"),
    ],
)
def test_check_declared_schedules__an_invalid_setting_entry_is_e017_with_a_hint(entry, says, hint):
    [message] = messages({"nightly": entry})
    assert message.id == "durable_agents.E017"
    assert says in message.msg and "DURABLE_AGENTS[\"SCHEDULES\"]['nightly']" in message.msg, message.msg
    assert hint in message.hint, message.hint


def test_check_declared_schedules__a_workflow_declaration_is_checked_too(isolated_registries):
    workflow("digest", steps=[call("tick", _tick)], schedule=cron("0 3 * * *", timezone="Mars/Olympus"))
    [message] = messages({})
    assert message.id == "durable_agents.E017" and "workflow 'digest'" in message.msg
    assert "unknown time zone 'Mars/Olympus'" in message.msg and "IANA" in message.hint


def test_check_declared_schedules__a_name_in_the_setting_and_on_a_workflow_is_e018(isolated_registries):
    workflow("digest", steps=[call("tick", _tick)], schedule=cron("0 3 * * *"))
    found = messages({"digest": GOOD})
    assert [m.id for m in found] == ["durable_agents.E018"] * 2, found
    assert all("declared more than once" in m.msg and "Keep one declaration" in m.hint for m in found)
    with override_settings(DURABLE_AGENTS={"SCHEDULES": {"digest": GOOD}}):
        assert declarations().valid == [], "a name declared twice is applied by neither declaration"


def test_check_declared_schedules__two_workflows_declaring_one_name_is_e018(isolated_registries):
    workflow("a", steps=[call("tick", _tick)], schedule=cron("0 3 * * *", name="shared"))
    workflow("b", steps=[call("tick", _tick)], schedule=cron("0 4 * * *", name="shared"))
    assert [m.id for m in messages({})] == ["durable_agents.E018"] * 2


def test_workflow__schedule_takes_cron_objects_and_names_them_after_the_workflow(isolated_registries):
    workflow("digest", steps=[call("tick", _tick)], schedule=cron("0 3 * * *", input={"days": 1}))
    workflow("report", steps=[call("tick", _tick)], schedule=[cron("0 6 * * 1-5", name="weekdays"), cron("@daily")])
    names = {d.name: d.fields for d in declarations_in({})}
    assert names["digest"]["input"] == {"days": 1} and names["digest"]["declared"] == "workflow"
    assert {"weekdays", "report"} <= set(names)


def test_workflow__schedule_refuses_what_is_not_a_cron(isolated_registries):
    with pytest.raises(DefinitionError, match=r'e.g. schedule=cron\("0 3 \* \* \*"\)'):
        workflow("digest", steps=[call("tick", _tick)], schedule="0 3 * * *")


def test_workflow__the_newest_version_declares_the_schedules(isolated_registries):
    workflow("digest", steps=[call("tick", _tick)], schedule=cron("0 3 * * *"))
    workflow("digest", version=2, steps=[call("tick", _tick)])
    assert declarations_in({}) == [], "version 2 declares no schedule: the sweep removes version 1's"
