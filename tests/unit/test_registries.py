"""Registries a test can isolate: what a block registers or removes is undone at its end, in all three."""

from __future__ import annotations

import pytest

from durable_agents.agents.participants import ParticipantRegistry, ScriptedParticipant, participants
from durable_agents.testing.registries import isolated_registries
from durable_agents.tools import ToolRegistry, tool, tools
from durable_agents.workflows import Registry, Workflow, call, registry, workflow


def _fn(ctx):
    return {}


def test_registry__isolated_undoes_registrations_and_removals():
    workflows = Registry()
    kept = workflows.register(Workflow(name="kept", version=1, steps=(call("a", _fn),)))
    with workflows.isolated():
        workflows.register(Workflow(name="kept", version=2, steps=(call("a", _fn),)))
        workflows.register(Workflow(name="scratch", version=1, steps=(call("a", _fn),)))
        workflows.unregister("kept", 1)
    assert workflows.names() == ["kept"] and workflows.versions("kept") == [1], workflows.names()
    assert workflows.get("kept") is kept


def test_tool_registry__isolated_frees_a_name_taken_in_the_block():
    registry_ = ToolRegistry()

    def ping() -> str:
        """Check the service is up."""
        return "pong"

    with registry_.isolated():
        tool(registry=registry_)(ping)
        assert "ping" in registry_
    assert "ping" not in registry_, "a tool registered in an isolated block outlived it"


def test_participant_registry__isolated_restores_a_replaced_participant():
    named = ParticipantRegistry()
    first = named.register("script", ScriptedParticipant(lambda request: "one"))
    with named.isolated():
        named.register("script", ScriptedParticipant(lambda request: "two"))
        named.unregister("script")
    assert named.get("script") is first


def test_isolated_registries__a_test_registers_its_own_workflow_tool_and_participant():
    before = (registry.names(), tools.names(), participants.names())

    def scratch_tool() -> str:
        """A tool only this test knows."""
        return "ok"

    with isolated_registries():
        workflow("scratch_for_isolation", steps=[call("only", _fn)])
        tool(scratch_tool)
        participants.register("scratch-script", ScriptedParticipant(lambda request: "hi"))
        assert "scratch_for_isolation" in registry.names() and "scratch_tool" in tools

    assert (registry.names(), tools.names(), participants.names()) == before, (
        "isolated_registries left a registration behind: the next test would see it"
    )


def test_isolated_registries__restores_even_when_the_block_raises():
    with pytest.raises(RuntimeError), isolated_registries():
        workflow("scratch_then_boom", steps=[call("only", _fn)])
        raise RuntimeError("boom")
    assert "scratch_then_boom" not in registry.names()
