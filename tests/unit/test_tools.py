"""Unit tests for tool definitions: schemas from type hints, argument checks, invocation and the registry."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
import pickle
from decimal import Decimal
from typing import Annotated, Any, Literal, NewType, NotRequired, TypedDict

import pytest

from durable_agents.errors import (
    DefinitionError,
    InvalidInputError,
    ToolArgumentsError,
    ToolDefinitionError,
    UnknownToolError,
)
from durable_agents.schema import DECIMAL_PATTERN, schema_errors
from durable_agents.tools import Field, Tool, ToolRegistry, tool, tools

# Hint types live at module level: get_type_hints resolves names in the module's globals, not in a test's locals.


class Color(enum.StrEnum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Address(TypedDict):
    street: str
    zip: Annotated[str, Field(pattern=r"^\d{5}$")]
    note: NotRequired[str]
    floor: int | None


@dataclasses.dataclass(frozen=True)
class Line:
    sku: str
    quantity: Annotated[int, Field(minimum=1)]
    gift: bool = False
    comment: str | None = None


@dataclasses.dataclass
class Node:
    children: list[Node]


OrderId = NewType("OrderId", str)


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry()


def schema_of(registry: ToolRegistry, fn: Any) -> dict[str, Any]:
    return tool(registry=registry)(fn).input_schema


def props(registry: ToolRegistry, fn: Any) -> dict[str, Any]:
    return schema_of(registry, fn)["properties"]


# --- Schemas ---------------------------------------------------------------------------------------------------


def test_schema__scalars(registry: ToolRegistry) -> None:
    def f(s: str, i: int, x: float, b: bool, n: None) -> None:
        """Scalars."""

    assert schema_of(registry, f) == {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "x": {"type": "number"},
            "b": {"type": "boolean"},
            "n": {"type": "null"},
        },
        "required": ["s", "i", "x", "b", "n"],
        "additionalProperties": False,
    }


def test_schema__optional_is_nullable_and_not_required(registry: ToolRegistry) -> None:
    def f(a: str, b: int | None, c: str = "x", d: float | None = 1.5) -> None:
        """Optional."""

    assert schema_of(registry, f) == {
        "type": "object",
        "properties": {
            "a": {"type": "string"},
            "b": {"type": ["integer", "null"]},
            "c": {"type": "string"},
            "d": {"type": ["number", "null"]},
        },
        "required": ["a"],
        "additionalProperties": False,
    }


def test_schema__no_parameters_has_no_required_key(registry: ToolRegistry) -> None:
    def f() -> None:
        """Nothing."""

    assert schema_of(registry, f) == {"type": "object", "properties": {}, "additionalProperties": False}


def test_schema__containers(registry: ToolRegistry) -> None:
    def f(
        a: list[int],
        b: dict[str, float],
        c: tuple[str, ...],
        d: tuple[str, int],
        e: list,
        g: dict,
        h: list[list[str]],
        i: tuple,
    ) -> None:
        """Containers."""

    assert props(registry, f) == {
        "a": {"type": "array", "items": {"type": "integer"}},
        "b": {"type": "object", "additionalProperties": {"type": "number"}},
        "c": {"type": "array", "items": {"type": "string"}},
        "d": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "minItems": 2, "maxItems": 2},
        "e": {"type": "array"},
        "g": {"type": "object"},
        "h": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}},
        "i": {"type": "array"},
    }


def test_schema__literal_and_enum(registry: ToolRegistry) -> None:
    def f(
        mode: Literal["fast", "safe"],
        mixed: Literal[1, "one"],
        color: Color,
        priority: Priority,
        maybe: Literal["a", "b"] | None,
    ) -> None:
        """Enums."""

    assert props(registry, f) == {
        "mode": {"type": "string", "enum": ["fast", "safe"]},
        "mixed": {"type": ["integer", "string"], "enum": [1, "one"]},
        "color": {"type": "string", "enum": ["red", "green"]},
        "priority": {"type": "integer", "enum": [1, 2]},
        "maybe": {"type": ["string", "null"], "enum": ["a", "b", None]},
    }


def test_schema__decimal_dates_and_newtype(registry: ToolRegistry) -> None:
    def f(amount: Decimal, at: dt.datetime, on: dt.date, order: OrderId) -> None:
        """Decimal and dates."""

    assert props(registry, f) == {
        "amount": {"type": "string", "pattern": DECIMAL_PATTERN},
        "at": {"type": "string", "format": "date-time"},
        "on": {"type": "string", "format": "date"},
        "order": {"type": "string"},
    }
    assert DECIMAL_PATTERN == r"^-?\d+(\.\d+)?$"


def test_schema__typeddict_is_a_closed_object_with_its_required_keys(registry: ToolRegistry) -> None:
    def f(address: Address) -> None:
        """TypedDict."""

    assert props(registry, f)["address"] == {
        "type": "object",
        "properties": {
            "street": {"type": "string"},
            "zip": {"type": "string", "pattern": r"^\d{5}$"},
            "note": {"type": "string"},
            "floor": {"type": ["integer", "null"]},
        },
        "required": ["street", "zip"],
        "additionalProperties": False,
    }


def test_schema__dataclass_is_a_closed_object_fields_with_defaults_optional(registry: ToolRegistry) -> None:
    def f(lines: list[Line]) -> None:
        """Dataclass."""

    assert props(registry, f)["lines"] == {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string"},
                "quantity": {"type": "integer", "minimum": 1},
                "gift": {"type": "boolean"},
                "comment": {"type": ["string", "null"]},
            },
            "required": ["sku", "quantity"],
            "additionalProperties": False,
        },
    }


def test_schema__annotated_description_and_constraints(registry: ToolRegistry) -> None:
    def f(
        city: Annotated[str, "City name, e.g. Paris"],
        amount: Annotated[float, Field(description="EUR", minimum=0, maximum=500)],
        code: Annotated[str, Field(min_length=2, max_length=8, pattern=r"^[A-Z]+$")],
        tags: Annotated[list[str], Field(min_length=1, max_length=3)],
        limit: Annotated[int | None, Field(minimum=1)] = None,
        note: Annotated[str, "ignored library metadata", object()] = "",
    ) -> None:
        """Annotated."""

    assert props(registry, f) == {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "amount": {"type": "number", "description": "EUR", "minimum": 0, "maximum": 500},
        "code": {"type": "string", "minLength": 2, "maxLength": 8, "pattern": "^[A-Z]+$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "limit": {"type": ["integer", "null"], "minimum": 1},
        "note": {"type": "string", "description": "ignored library metadata"},
    }


def test_schema__idempotency_key_and_ctx_are_not_shown_to_the_model(registry: ToolRegistry) -> None:
    @tool(effectful=True, registry=registry)
    def charge(amount: int, *, idempotency_key: str, ctx: Any = None) -> None:
        """Charge."""

    assert charge.input_schema == {
        "type": "object",
        "properties": {"amount": {"type": "integer"}},
        "required": ["amount"],
        "additionalProperties": False,
    }


def test_anthropic_schema__matches_the_messages_api_shape_and_is_a_copy(registry: ToolRegistry) -> None:
    @tool(registry=registry)
    def get_weather(city: str) -> str:
        """
        Current weather for a city.

            Use it before planning outdoor steps.
        """
        return "sunny"

    schema = get_weather.anthropic_schema()
    assert schema == {
        "name": "get_weather",
        "description": "Current weather for a city.\n\n    Use it before planning outdoor steps.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    schema["input_schema"]["properties"]["city"]["type"] = "integer"
    assert get_weather.input_schema["properties"]["city"] == {"type": "string"}, "anthropic_schema must return a copy"


# --- Definition errors ---------------------------------------------------------------------------------------------


def test_tool__effectful_without_idempotency_key_fails_at_decoration(registry: ToolRegistry) -> None:
    with pytest.raises(ToolDefinitionError, match=r"add `idempotency_key: str` to its signature"):

        @tool(effectful=True, registry=registry)
        def refund(amount: int) -> None:
            """Refund."""

    assert "refund" not in registry


def test_tool__transactional_implies_effectful(registry: ToolRegistry) -> None:
    with pytest.raises(ToolDefinitionError, match="idempotency_key"):

        @tool(transactional=True, registry=registry)
        def bad(n: int) -> None:
            """Bad."""

    @tool(transactional=True, registry=registry)
    def mark_paid(order_id: str, *, idempotency_key: str) -> None:
        """Mark paid."""

    assert mark_paid.effectful and mark_paid.transactional


def test_tool__idempotency_key_must_be_a_str(registry: ToolRegistry) -> None:
    with pytest.raises(ToolDefinitionError, match="must be annotated as str"):

        @tool(effectful=True, registry=registry)
        def bad(*, idempotency_key: int) -> None:
            """Bad."""


def test_tool__undocumented_is_an_error(registry: ToolRegistry) -> None:
    def undocumented(x: int) -> None:
        pass

    with pytest.raises(ToolDefinitionError, match="has no description"):
        tool(registry=registry)(undocumented)
    assert tool(description="Explicit.", registry=registry)(undocumented).description == "Explicit."


def test_tool__error_is_a_definition_error() -> None:
    assert issubclass(ToolDefinitionError, DefinitionError)
    assert str(ToolDefinitionError()) == "The tool definition is invalid."


@pytest.mark.parametrize("name", ["has space", "x" * 65, "dotted.name", "ünï", ""])
def test_tool__bad_name_is_an_error(registry: ToolRegistry, name: str) -> None:
    def f() -> None:
        """F."""

    with pytest.raises(ToolDefinitionError, match="must match"):
        Tool(f, name=name or "<lambda>")


def test_tool__names_default_to_the_function_name_and_allow_64_chars(registry: ToolRegistry) -> None:
    def lookup_order() -> None:
        """Lookup."""

    assert tool(registry=registry)(lookup_order).name == "lookup_order"
    assert tool(name="a-" + "b" * 62, registry=registry)(lookup_order).name == "a-" + "b" * 62
    with pytest.raises(ToolDefinitionError, match="must match"):
        tool(registry=registry)(lambda: None)


@pytest.mark.parametrize(
    ("hint", "message"),
    [
        (complex, "parameter 'value': unsupported type hint"),
        (set[int], "parameter 'value': unsupported type hint"),
        (int | str, "parameter 'value': only X | None unions are supported"),
        (dict[int, str], "parameter 'value': dict keys must be str"),
        (list[complex], r"parameter 'value\[\]': unsupported type hint"),
        (Node, "parameter 'value.children.*|parameter 'value.children\\[\\]': recursive type Node"),
        (Literal[b"x"], "parameter 'value': enum value b'x' is not a JSON scalar"),
        (Annotated[str, Field(minimum=1)], r"Field\(minimum=...\) applies to int and float only"),
        (Annotated[int, Field(pattern="x")], r"Field\(pattern=...\) applies to strings only"),
        (Annotated[str, Field(pattern="(")], "invalid pattern"),
        (Annotated[bool, Field(max_length=3)], r"Field\(max_length=...\) applies to strings and arrays only"),
    ],
)
def test_tool__unsupported_hint_names_the_parameter(registry: ToolRegistry, hint: Any, message: str) -> None:
    def f(value):  # type: ignore[no-untyped-def]
        """F."""

    f.__annotations__ = {"value": hint}
    with pytest.raises(ToolDefinitionError, match=message):
        tool(registry=registry)(f)


def test_tool__parameter_without_hint_is_an_error(registry: ToolRegistry) -> None:
    def f(order_id, amount: int):  # type: ignore[no-untyped-def]
        """F."""

    with pytest.raises(ToolDefinitionError, match="parameter 'order_id' has no type hint"):
        tool(registry=registry)(f)


def test_tool__variadic_parameters_are_errors(registry: ToolRegistry) -> None:
    def f(**kwargs: int) -> None:
        """F."""

    with pytest.raises(ToolDefinitionError, match=r"\*\*kwargs"):
        tool(registry=registry)(f)


def test_tool__async_functions_are_errors(registry: ToolRegistry) -> None:
    async def f() -> None:
        """F."""

    with pytest.raises(ToolDefinitionError, match="async"):
        tool(registry=registry)(f)


def test_tool__policy_options_are_checked(registry: ToolRegistry) -> None:
    def read(order_id: str) -> None:
        """Read."""

    def write(order_id: str, *, idempotency_key: str) -> None:
        """Write."""

    with pytest.raises(ToolDefinitionError, match="only effectful tools can have compensate="):
        Tool(read, compensate="undo")
    with pytest.raises(ToolDefinitionError, match="read-only observation tools only"):
        Tool(write, effectful=True, fresh_for=dt.timedelta(minutes=5))
    with pytest.raises(ToolDefinitionError, match="positive timedelta"):
        Tool(read, fresh_for=dt.timedelta(0))
    with pytest.raises(ToolDefinitionError, match="needs_approval"):
        Tool(read, needs_approval="yes")  # type: ignore[arg-type]
    assert Tool(read, fresh_for=dt.timedelta(minutes=5)).fresh_for == dt.timedelta(minutes=5)


# --- Validation ------------------------------------------------------------------------------------------------


@pytest.fixture
def refund(registry: ToolRegistry) -> Tool[..., Any]:
    @tool(effectful=True, registry=registry)
    def issue_refund(
        order_id: str,
        amount: Decimal,
        reason: Literal["damaged", "late"],
        quantity: Annotated[int, Field(minimum=1, maximum=10)] = 1,
        lines: list[Line] | None = None,
        address: Address | None = None,
        note: Annotated[str, Field(max_length=5)] = "",
        *,
        idempotency_key: str,
    ) -> None:
        """Refund part of an order."""

    return issue_refund


def errors_of(tool_: Tool[..., Any], args: Any) -> list[str]:
    with pytest.raises(ToolArgumentsError) as info:
        tool_.validate(args)
    return info.value.errors


def test_validate__returns_the_arguments_without_filling_defaults(refund: Tool[..., Any]) -> None:
    args = {"order_id": "A1", "amount": "12.50", "reason": "late"}
    assert refund.validate(args) == args


def test_validate__lists_every_wrong_type_with_its_path(refund: Tool[..., Any]) -> None:
    assert errors_of(refund, {"order_id": 7, "amount": 12.5, "reason": "late", "quantity": "2"}) == [
        "order_id: expected string, got integer",
        "amount: expected string, got number",
        "quantity: expected integer, got string",
    ]


def test_validate__missing_required_and_extra_keys(refund: Tool[..., Any]) -> None:
    assert errors_of(refund, {"order_id": "A1", "refund_all": True}) == [
        "amount: required property is missing",
        "reason: required property is missing",
        "refund_all: unexpected property (expected: order_id, amount, reason, quantity, lines, address, note)",
    ]


def test_validate__enum_and_bounds(refund: Tool[..., Any]) -> None:
    base = {"order_id": "A1", "amount": "1"}
    assert errors_of(refund, {**base, "reason": "bored", "quantity": 0, "note": "toolong"}) == [
        'reason: expected one of "damaged", "late", got "bored"',
        "quantity: must be >= 1, got 0",
        "note: must be at most 5 characters, got 7",
    ]
    assert errors_of(refund, {**base, "reason": "late", "quantity": 11}) == ["quantity: must be <= 10, got 11"]


def test_validate__bool_is_not_an_integer_nor_a_number(registry: ToolRegistry) -> None:
    @tool(registry=registry)
    def f(n: int, x: float, flag: bool) -> None:
        """F."""

    assert errors_of(f, {"n": True, "x": False, "flag": 1}) == [
        "n: expected integer, got boolean",
        "x: expected number, got boolean",
        "flag: expected boolean, got integer",
    ]
    assert f.validate({"n": 3, "x": 3, "flag": True}) == {"n": 3, "x": 3, "flag": True}
    assert errors_of(f, {"n": 3.0, "x": float("nan"), "flag": True}) == [
        "n: expected integer, got number",
        "x: expected number, got non-finite number",
    ]


def test_validate__nested_paths(refund: Tool[..., Any]) -> None:
    args = {
        "order_id": "A1",
        "amount": "1.2.3",
        "reason": "late",
        "lines": [{"sku": "S1", "quantity": 1}, {"sku": 5, "quantity": 0, "colour": "red"}],
        "address": {"street": "Main", "zip": "ABC", "floor": "2"},
    }
    assert errors_of(refund, args) == [
        r"amount: must match the pattern ^-?\d+(\.\d+)?$, got " + '"1.2.3"',
        "lines[1].sku: expected string, got integer",
        "lines[1].quantity: must be >= 1, got 0",
        "lines[1].colour: unexpected property (expected: sku, quantity, gift, comment)",
        r"address.zip: must match the pattern ^\d{5}$, got " + '"ABC"',
        "address.floor: expected integer or null, got string",
    ]


def test_validate__null_only_where_the_hint_allows_it(refund: Tool[..., Any]) -> None:
    assert refund.validate({"order_id": "A1", "amount": "1", "reason": "late", "lines": None})
    assert errors_of(refund, {"order_id": None, "amount": "1", "reason": "late"}) == [
        "order_id: expected string, got null"
    ]


def test_validate__dates_and_fixed_tuples(registry: ToolRegistry) -> None:
    @tool(registry=registry)
    def f(on: dt.date, at: dt.datetime, point: tuple[int, int], extra: dict[str, int]) -> None:
        """F."""

    good = {"on": "2024-02-29", "at": "2024-02-29T10:00:00Z", "point": [1, 2], "extra": {"a": 1}}
    assert f.validate(good) == good
    assert errors_of(f, {"on": "2024-02-30", "at": "yesterday", "point": [1, "2", 3], "extra": {"a": "1"}}) == [
        'on: expected an ISO 8601 date, got "2024-02-30"',
        'at: expected an ISO 8601 date-time, got "yesterday"',
        "point: must have at most 2 items, got 3",
        "point[1]: expected integer, got string",
        "extra.a: expected integer, got string",
    ]


def test_validate__arguments_must_be_an_object(refund: Tool[..., Any]) -> None:
    assert errors_of(refund, ["A1"]) == ["arguments: expected object, got array"]


def test_tool_arguments_error__message_lists_errors_and_survives_pickling(refund: Tool[..., Any]) -> None:
    with pytest.raises(ToolArgumentsError) as info:
        refund.validate({"order_id": 1, "amount": "1", "reason": "late"})
    error = info.value
    assert isinstance(error, InvalidInputError)
    assert str(error) == "invalid arguments for tool 'issue_refund': order_id: expected string, got integer"
    assert pickle.loads(pickle.dumps(error)).errors == error.errors
    assert str(ToolArgumentsError(errors=["a: x", "b: y"])) == (
        "The tool arguments do not match the tool's schema: a: x; b: y"
    )


def test_schema_errors__is_usable_on_its_own() -> None:
    assert schema_errors({"type": "integer"}, True) == ["arguments: expected integer, got boolean"]
    assert schema_errors({"type": "object", "additionalProperties": {"type": "string"}}, {"k": "v"}) == []


# --- Canonical arguments ---------------------------------------------------------------------------------------


def test_canonical_args__independent_of_key_order(refund: Tool[..., Any]) -> None:
    one = {"order_id": "A1", "amount": "1", "address": {"street": "Main", "zip": "12345"}}
    two = {"address": {"zip": "12345", "street": "Main"}, "amount": "1", "order_id": "A1"}
    assert refund.canonical_args(one) == refund.canonical_args(two)
    assert refund.canonical_args(one) == '{"address":{"street":"Main","zip":"12345"},"amount":"1","order_id":"A1"}'
    assert refund.args_hash(one) == refund.args_hash(two)
    assert refund.args_hash(one) == hashlib.sha256(refund.canonical_args(one).encode()).hexdigest()
    assert refund.args_hash(one) != refund.args_hash({**one, "amount": "2"})


def test_canonical_args__keeps_unicode_and_rejects_non_json(refund: Tool[..., Any]) -> None:
    assert refund.canonical_args({"note": "café"}) == '{"note":"café"}'
    with pytest.raises(ToolArgumentsError, match="not JSON-serialisable"):
        refund.canonical_args({"amount": Decimal("1")})
    with pytest.raises(ToolArgumentsError, match="not JSON-serialisable"):
        refund.canonical_args({"amount": float("inf")})


# --- Invocation ------------------------------------------------------------------------------------------------


def test_invoke__passes_idempotency_key_and_ctx_only_when_accepted(registry: ToolRegistry) -> None:
    seen: list[dict[str, Any]] = []

    @tool(effectful=True, registry=registry)
    def both(n: int, *, idempotency_key: str, ctx: Any) -> None:
        """Both."""
        seen.append({"n": n, "key": idempotency_key, "ctx": ctx})

    @tool(registry=registry)
    def neither(n: int) -> int:
        """Neither."""
        return n * 2

    @tool(registry=registry)
    def only_ctx(ctx: Any, n: int = 1) -> Any:
        """Only ctx."""
        return (ctx, n)

    both.invoke({"n": 1}, idempotency_key="run:step:toolu_1", ctx="the-ctx")
    assert seen == [{"n": 1, "key": "run:step:toolu_1", "ctx": "the-ctx"}]
    assert neither.invoke({"n": 4}, idempotency_key="ignored", ctx="ignored") == 8
    assert only_ctx.invoke({}, ctx="c") == ("c", 1)


def test_invoke__effectful_tool_without_a_key_is_refused_before_running(registry: ToolRegistry) -> None:
    calls: list[int] = []

    @tool(effectful=True, registry=registry)
    def charge(n: int, *, idempotency_key: str) -> None:
        """Charge."""
        calls.append(n)

    with pytest.raises(ValueError, match="idempotency_key"):
        charge.invoke({"n": 1})
    assert calls == [], "an effectful tool ran without an idempotency key"


def test_invoke__invalid_arguments_never_reach_the_function(registry: ToolRegistry) -> None:
    calls: list[int] = []

    @tool(registry=registry)
    def count(n: int) -> None:
        """Count."""
        calls.append(n)

    with pytest.raises(ToolArgumentsError):
        count.invoke({"n": "1"})
    assert calls == []


def test_invoke__converts_json_to_the_hinted_types(registry: ToolRegistry) -> None:
    @tool(registry=registry)
    def f(
        amount: Decimal,
        at: dt.datetime,
        on: dt.date,
        color: Color,
        priority: Priority,
        lines: list[Line],
        point: tuple[int, int],
        address: Address,
        maybe: Decimal | None,
        by_key: dict[str, Decimal] | None = None,
    ) -> None:
        """F."""
        return dict(locals())

    received = f.invoke(
        {
            "amount": "12.50",
            "at": "2024-02-29T10:00:00+00:00",
            "on": "2024-02-29",
            "color": "red",
            "priority": 2,
            "lines": [{"sku": "S1", "quantity": 2}],
            "point": [1, 2],
            "address": {"street": "Main", "zip": "12345", "floor": None},
            "by_key": {"a": "0.1"},
        }
    )
    assert received == {
        "amount": Decimal("12.50"),
        "at": dt.datetime(2024, 2, 29, 10, tzinfo=dt.UTC),
        "on": dt.date(2024, 2, 29),
        "color": Color.RED,
        "priority": Priority.HIGH,
        "lines": [Line(sku="S1", quantity=2)],
        "point": (1, 2),
        "address": {"street": "Main", "zip": "12345", "floor": None},
        "maybe": None,
        "by_key": {"a": Decimal("0.1")},
    }


def test_call__calls_the_function_directly(registry: ToolRegistry) -> None:
    @tool(registry=registry)
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    assert add(2, 3) == 5
    assert add.fn(2, b=3) == 5


def test_is_approval_required__bool_or_predicate(registry: ToolRegistry) -> None:
    def send(to: list[str], *, idempotency_key: str) -> None:
        """Send."""

    assert Tool(send, effectful=True).is_approval_required({"to": ["a"]}) is False
    assert Tool(send, effectful=True, needs_approval=True).is_approval_required({"to": ["a"]}) is True
    bulk = Tool(send, effectful=True, needs_approval=lambda args: len(args["to"]) > 1)
    assert bulk.is_approval_required({"to": ["a"]}) is False
    assert bulk.is_approval_required({"to": ["a", "b"]}) is True


# --- Registry --------------------------------------------------------------------------------------------------


def test_registry__decorator_registers_into_the_given_registry_only(registry: ToolRegistry) -> None:
    before = tools.names()

    @tool(registry=registry)
    def local_only() -> None:
        """Local."""

    assert registry.get("local_only") is local_only
    assert tools.names() == before, "tests must not leak tools into the global registry"


def test_registry__duplicate_name_with_another_function_is_an_error(registry: ToolRegistry) -> None:
    @tool(name="lookup", registry=registry)
    def first() -> None:
        """First."""

    def second() -> None:
        """Second."""

    with pytest.raises(ToolDefinitionError, match="'lookup' is already taken by .*first"):
        tool(name="lookup", registry=registry)(second)
    assert registry.register(first) is first, "re-registering the same Tool must be allowed"
    assert registry.get("lookup") is first


def test_registry__unknown_name_lists_the_known_ones(registry: ToolRegistry) -> None:
    with pytest.raises(UnknownToolError, match=r"no tool named 'nope' \(registered: none\)"):
        registry.get("nope")

    @tool(registry=registry)
    def b_tool() -> None:
        """B."""

    @tool(registry=registry)
    def a_tool() -> None:
        """A."""

    with pytest.raises(UnknownToolError, match=r"registered: a_tool, b_tool"):
        registry.get("nope")
    assert registry.names() == ["a_tool", "b_tool"]
    assert [entry["name"] for entry in registry.anthropic_schemas()] == ["a_tool", "b_tool"]
    assert [entry["name"] for entry in registry.anthropic_schemas(["b_tool"])] == ["b_tool"]


def test_registry__compensator_lookup(registry: ToolRegistry) -> None:
    @tool(effectful=True, compensate="reverse_refund", registry=registry)
    def issue_refund(amount: int, *, idempotency_key: str) -> None:
        """Refund."""

    # Declared before its compensator exists: names are checked lazily.
    with pytest.raises(UnknownToolError, match="compensate='reverse_refund'"):
        registry.compensator_of(issue_refund)

    @tool(effectful=True, registry=registry)
    def reverse_refund(amount: int, *, idempotency_key: str) -> None:
        """Reverse a refund."""

    assert registry.compensator_of(issue_refund) is reverse_refund
    with pytest.raises(ToolDefinitionError, match="declares no compensate"):
        registry.compensator_of(reverse_refund)


def test_registry__compensator_must_be_effectful(registry: ToolRegistry) -> None:
    @tool(effectful=True, compensate="peek", registry=registry)
    def act(*, idempotency_key: str) -> None:
        """Act."""

    @tool(registry=registry)
    def peek() -> None:
        """Peek."""

    with pytest.raises(ToolDefinitionError, match="must be effectful"):
        registry.compensator_of(act)
