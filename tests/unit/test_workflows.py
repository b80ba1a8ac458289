"""Workflow definitions are validated when they are defined, and plans when a run starts."""

import pytest

from durable_agents.errors import DefinitionError, InvalidInputError, UnknownWorkflowError
from durable_agents.workflows import PlannedStep, Registry, RetryPolicy, Workflow, call


def _fn(ctx):
    return None


def test_workflow__duplicate_step_names_are_refused():
    with pytest.raises(DefinitionError, match="duplicate step name 'a'"):
        Workflow(name="w", version=1, steps=(call("a", _fn), call("a", _fn)))


@pytest.mark.parametrize("name", ["", "has space", "-lead", "x" * 201])
def test_workflow__bad_step_ids_are_refused(name):
    with pytest.raises(DefinitionError, match="must match"):
        Workflow(name="w", version=1, steps=(call(name, _fn),))


@pytest.mark.parametrize("version", [0, -1, "2", True])
def test_workflow__version_must_be_a_positive_integer(version):
    with pytest.raises(DefinitionError, match="version must be an integer"):
        Workflow(name="w", version=version, steps=(call("a", _fn),))


def test_workflow__call_needs_a_callable():
    with pytest.raises(DefinitionError, match="not callable"):
        call("a", "not a function")


def test_registry__same_version_twice_is_refused_and_latest_wins():
    registry = Registry()
    v1 = registry.register(Workflow(name="w", version=1, steps=(call("a", _fn),)))
    v2 = registry.register(Workflow(name="w", version=2, steps=(call("a", _fn),)))
    with pytest.raises(DefinitionError, match="already registered; bump the version"):
        registry.register(Workflow(name="w", version=1, steps=(call("b", _fn),)))
    assert registry.get("w") is v2 and registry.get("w", 1) is v1
    with pytest.raises(UnknownWorkflowError, match="has no version 3 \\(registered: 1, 2\\)"):
        registry.get("w", 3)
    with pytest.raises(UnknownWorkflowError, match="unknown workflow 'nope'"):
        registry.get("nope")


def test_plan__dynamic_plan_is_checked():
    bad = Workflow(name="w", version=1, steps=(call("a", _fn),), plan=lambda inp: [PlannedStep("x", "zzz")])
    with pytest.raises(InvalidInputError, match="unknown step 'zzz'"):
        bad.build_plan({})
    twice = Workflow(name="w", version=1, steps=(call("a", _fn),), plan=lambda inp: [PlannedStep("x", "a")] * 2)
    with pytest.raises(InvalidInputError, match="appears twice"):
        twice.build_plan({})


def test_plan__input_validator_errors_become_invalid_input():
    def validate(inp):
        raise ValueError("order_id is required")

    w = Workflow(name="w", version=1, steps=(call("a", _fn),), validate_input=validate)
    with pytest.raises(InvalidInputError, match="invalid input for w@1: order_id is required"):
        w.build_plan({})


def test_retry_policy__backoff_grows_and_is_capped():
    policy = RetryPolicy(backoff=1.0, backoff_max=8.0)
    for attempt, ceiling in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, 8.0)]:
        delays = [policy.delay(attempt) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, min(delays), max(delays))
