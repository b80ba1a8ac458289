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


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ("order_id", r"search is a tuple of input field names, e.g. search=\('order_id',\)"),
        (("order id",), "search field 'order id' must be a top-level input key or a dotted path"),
        (("order__id",), "search field 'order__id' must be a top-level input key or a dotted path"),
        (("order_id:x",), "search field 'order_id:x' must be"),
        ((7,), "search field 7 must be"),
        (("order_id", "order_id"), "search names 'order_id' twice"),
        (tuple(f"f{i}" for i in range(21)), "search names at most 20 fields"),
    ],
)
def test_workflow__bad_search_declarations_say_what_to_write(search, message):
    with pytest.raises(DefinitionError, match=message):
        Workflow(name="w", version=1, steps=(call("a", _fn),), search=search)


def test_workflow__search_attributes_are_strings_read_from_the_input():
    definition = Workflow(
        name="w", version=1, steps=(call("a", _fn),), search=["order_id", "customer", "order.id", "paid", "gone"]
    )
    run_input = {"order_id": "A-1001", "customer": 42, "order": {"id": 7.5}, "paid": True, "note": "x"}

    assert definition.search == ("order_id", "customer", "order.id", "paid", "gone"), "kept as a tuple"
    assert definition.search_attributes(run_input) == {
        "order_id": "A-1001",
        "customer": "42",
        "order.id": "7.5",
        "paid": "true",
    }, "scalars as JSON spells them; a field the input lacks is left out"


@pytest.mark.parametrize(
    "run_input",
    [
        {"order_id": None},
        {"order_id": {"nested": 1}},
        {"order_id": [1, 2]},
        {"order_id": "x" * 201},
        {"order_id": ""},
        {"order": "not an object"},
        ["a", "list"],
        "text",
    ],
)
def test_workflow__search_leaves_out_what_is_not_a_short_scalar(run_input):
    definition = Workflow(name="w", version=1, steps=(call("a", _fn),), search=("order_id", "order.id"))
    assert definition.search_attributes(run_input) == {}


def test_registry__search_fields_are_those_of_every_registered_version():
    registry = Registry()
    registry.register(Workflow(name="w", version=1, steps=(call("a", _fn),), search=("order_id",)))
    registry.register(Workflow(name="w", version=2, steps=(call("a", _fn),), search=("customer",)))
    registry.register(Workflow(name="v", version=1, steps=(call("a", _fn),)))
    assert registry.search_fields() == ["customer", "order_id"]
