"""The pytest plugin as a user's project has it: its fixtures in a project with nothing of this repository's."""

from __future__ import annotations

import pytest

from tests.integration.user_project import run_user_tests, write_user_project

pytest_plugins = ["pytester"]

WORKFLOWS = """
from durable_agents.api import agent, call, workflow


def greet(ctx):
    return {"greeting": f"Hello, {ctx.input['name']}."}


GREETER = agent("greet", instructions="Greet the user by name.", prompt=lambda ctx: ctx.input["name"])

workflow("greet", steps=[call("greet", greet)])
workflow("greeter", steps=[GREETER])
workflow("greet_one_at_a_time", steps=[call("greet", greet)], concurrency_key=lambda inp: inp["name"])
"""

TESTS = """
from datetime import timedelta

import pytest

from durable_agents import api, clock
from durable_agents.testing import wait_for_run
from durable_agents.testing.fake_anthropic import Reply


def test_start_worker__runs_a_workflow_to_completion(start_worker):
    start_worker()
    run = wait_for_run(api.start("greet", {"name": "Ada"}).id, "completed")
    assert run.steps.get(step_id="greet").result == {"greeting": "Hello, Ada."}


def test_fake_anthropic__answers_the_workers_agent(start_worker, fake_anthropic):
    fake_anthropic.enqueue(Reply.text("Hello, Grace."))
    start_worker()
    run = wait_for_run(api.start("greeter", {"name": "Grace"}).id, "completed")
    assert run.steps.get(step_id="greet").result["text"] == "Hello, Grace."
    assert [request.last_user_text for request in fake_anthropic.requests] == ["Grace"]


def test_fake_anthropic__answers_this_process_agent_driven_in_process(drive, fake_anthropic):
    fake_anthropic.enqueue(Reply.text("Hello, Alan."))
    assert drive(api.start("greeter", {"name": "Alan"}).id).status == "completed"
    assert len(fake_anthropic.requests) == 1


def test_drive__keyed_runs_under_the_db_fixture_go_in_their_keys_order(drive):
    first = api.start("greet_one_at_a_time", {"name": "Ada"})
    second = api.start("greet_one_at_a_time", {"name": "Ada"})
    with pytest.raises(AssertionError, match=f"held by run\\(s\\) {first.id}; drive the holder first"):
        drive(second.id)
    assert drive(first.id).status == "completed"
    assert drive(second.id).status == "completed"


def test_isolated_registries__a_test_registers_its_own_workflow(drive, isolated_registries):
    api.workflow("scratch", steps=[api.call("only", lambda ctx: {"ok": True})])
    assert drive(api.start("scratch").id).status == "completed"


def test_isolated_registries__the_next_test_does_not_see_it():
    assert "scratch" not in api.registry.names()


def test_clock__a_test_moves_engine_time_to_lapse_a_lease():
    clock.advance(timedelta(minutes=10))
    assert clock.offset() == timedelta(minutes=10)


def test_clock__the_next_test_starts_on_the_database_clock():
    assert clock.offset() == timedelta(0), "a lease taken now would look lapsed to this test"
"""


def test_plugin__its_fixtures_work_in_a_users_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    write_user_project(pytester, workflows=WORKFLOWS, tests={"test_shop.py": TESTS})

    result = run_user_tests(pytester, monkeypatch)

    result.assert_outcomes(passed=8)
