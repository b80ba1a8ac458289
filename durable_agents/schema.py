"""JSON Schema from Python type hints, a checker for the schemas it makes, and conversion of checked JSON back.

Used by `durable_agents.tools` for tool input schemas; pure, no Django. Hints map as follows (anything else
is a HintError naming the parameter)::

    str, int, float, bool, None      string, integer, number, boolean, null (a bool is never an integer)
    X | None                         X's type plus "null"; the argument may be omitted and then arrives as None
    list[X], Sequence[X]             array of X; tuple[X, ...] likewise, tuple[X, Y] a fixed-length array
    dict[str, X], Mapping[str, X]    object whose values are X
    Literal[...], Enum subclasses    enum of the (JSON scalar) values
    Decimal                          string matching DECIMAL_PATTERN, not number: the SDK parses JSON numbers
                                     into floats, and money must not round-trip through binary floating point
    datetime, date                   string with format date-time / date (ISO 8601)
    TypedDict, dataclass             object with its own properties and required keys, no extra keys
    Annotated[X, "text"]             X with a description; Annotated[X, Field(...)] adds constraints

Example::

    schema_for(Annotated[int, Field(minimum=1)], "quantity")   # {"type": "integer", "minimum": 1}
    schema_errors({"type": "integer"}, True)                    # ["arguments: expected integer, got boolean"]
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import inspect
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Literal, NotRequired, Required, Union

DECIMAL_PATTERN = r"^-?\d+(\.\d+)?$"
# Supplied by the runtime, never by the model: kept out of the schema.
IDEMPOTENCY_KEY = "idempotency_key"
CONTEXT = "ctx"

_NONE = type(None)
_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    Decimal: {"type": "string", "pattern": DECIMAL_PATTERN},
    dt.datetime: {"type": "string", "format": "date-time"},
    dt.date: {"type": "string", "format": "date"},
}
_JSON_KINDS: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number", _NONE: "null"}
_SUPPORTED = "str, int, float, bool, None, X | None, list, tuple, dict[str, X], Literal, Enum, Decimal, datetime, "
_SUPPORTED += "date, TypedDict, dataclass, Annotated"


@dataclass(frozen=True)
class Field:
    """A parameter's description and constraints, attached with `Annotated`.

    `min_length` / `max_length` bound a string's characters or an array's items.

    Example: ``amount: Annotated[float, Field(description="in EUR", minimum=0, maximum=500)]``
    """

    description: str | None = None
    minimum: int | float | None = None
    maximum: int | float | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None


class HintError(Exception):
    """A type hint that cannot become JSON Schema; tools.Tool turns it into a ToolDefinitionError."""


# --- Schema derivation ------------------------------------------------------------------------------------


def _strip(hint: Any) -> Any:
    """The hint under Annotated, Required/NotRequired and NewType layers."""
    while True:
        if typing.get_origin(hint) in (Annotated, Required, NotRequired):
            hint = typing.get_args(hint)[0]
        elif getattr(hint, "__supertype__", None) is not None:
            hint = hint.__supertype__
        else:
            return hint


def _is_optional(hint: Any) -> bool:
    hint = _strip(hint)
    return typing.get_origin(hint) in (Union, types.UnionType) and _NONE in typing.get_args(hint)


def _kinds(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type", [])
    return [kind] if isinstance(kind, str) else list(kind)


def _enum_schema(values: Sequence[Any], path: str) -> dict[str, Any]:
    kinds: list[str] = []
    for value in values:
        kind = _JSON_KINDS.get(type(value))
        if kind is None:
            raise HintError(f"parameter {path!r}: enum value {value!r} is not a JSON scalar (str, int, float, bool)")
        if kind not in kinds:
            kinds.append(kind)
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(values)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    kinds = _kinds(schema)
    schema["type"] = kinds if "null" in kinds else [*kinds, "null"]
    if "enum" in schema and None not in schema["enum"]:
        schema["enum"] = [*schema["enum"], None]
    return schema


def _hints_of(owner: Any, path: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(owner, include_extras=True)
    except (NameError, TypeError, AttributeError, SyntaxError) as exc:
        # Local classes are invisible to get_type_hints: it resolves names in the module's globals.
        raise HintError(f"{path}cannot resolve type hints ({exc}); define the types at module level") from exc


def _object_schema(cls: type, path: str, stack: tuple[type, ...]) -> dict[str, Any]:
    if cls in stack:
        raise HintError(f"parameter {path!r}: recursive type {cls.__name__} is not supported")
    hints = _hints_of(cls, f"parameter {path!r}: ")
    if dataclasses.is_dataclass(cls):
        members = [
            (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f in dataclasses.fields(cls)
            if f.init
        ]
    else:
        # Under `from __future__ import annotations` Python 3.11 cannot see NotRequired/Required when it builds
        # __required_keys__ (the annotations are still strings), so the resolved hints decide where marked.
        unmarked_required: frozenset[str] = getattr(cls, "__required_keys__", frozenset())
        marks = {key: typing.get_origin(hint) for key, hint in hints.items()}
        members = [
            (key, marks[key] is Required or (marks[key] is not NotRequired and key in unmarked_required))
            for key in hints
        ]
    properties: dict[str, Any] = {}
    required: list[str] = []
    for key, has_no_default in members:
        properties[key] = schema_for(hints[key], f"{path}.{key}", (*stack, cls))
        if has_no_default and not _is_optional(hints[key]):
            required.append(key)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def _annotate(schema: dict[str, Any], extra: Any, path: str) -> None:
    if isinstance(extra, str):
        schema["description"] = extra
    if not isinstance(extra, Field):
        return  # metadata meant for other libraries
    kinds = _kinds(schema)
    if extra.description is not None:
        schema["description"] = extra.description
    for key, bound in (("minimum", extra.minimum), ("maximum", extra.maximum)):
        if bound is not None:
            if not {"integer", "number"} & set(kinds):
                raise HintError(f"parameter {path!r}: Field({key}=...) applies to int and float only")
            schema[key] = bound
    for suffix, length in (("min", extra.min_length), ("max", extra.max_length)):
        if length is not None:
            if "string" in kinds:
                schema[f"{suffix}Length"] = length
            elif "array" in kinds:
                schema[f"{suffix}Items"] = length
            else:
                raise HintError(f"parameter {path!r}: Field({suffix}_length=...) applies to strings and arrays only")
    if extra.pattern is not None:
        if "string" not in kinds:
            raise HintError(f"parameter {path!r}: Field(pattern=...) applies to strings only")
        try:
            re.compile(extra.pattern)
        except re.error as exc:
            raise HintError(f"parameter {path!r}: invalid pattern {extra.pattern!r}: {exc}") from exc
        schema["pattern"] = extra.pattern


def schema_for(hint: Any, path: str, stack: tuple[type, ...] = ()) -> dict[str, Any]:
    """The JSON Schema of one type hint; `path` names the parameter (and field) in error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        schema = schema_for(args[0], path, stack)
        for extra in hint.__metadata__:
            _annotate(schema, extra, path)
        return schema
    if origin in (Required, NotRequired) or getattr(hint, "__supertype__", None) is not None:
        return schema_for(_strip(hint), path, stack)
    if origin in (Union, types.UnionType):
        members = [arg for arg in args if arg is not _NONE]
        if len(members) != 1:
            raise HintError(f"parameter {path!r}: only X | None unions are supported, got {hint}")
        return _nullable(schema_for(members[0], path, stack))
    if origin is Literal:
        return _enum_schema(args, path)
    if hint is None or hint is _NONE:
        return {"type": "null"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_schema([member.value for member in hint], path)
    if isinstance(hint, type) and hint in _SCALARS:
        return dict(_SCALARS[hint])
    if hint is dict or (origin in (dict, Mapping) and not args):
        return {"type": "object"}
    if hint in (list, tuple) or origin in (list, Sequence) or (origin is tuple and args[-1:] in ((), (...,))):
        return {"type": "array", "items": schema_for(args[0], f"{path}[]", stack)} if args else {"type": "array"}
    if origin is tuple:
        items = [schema_for(arg, f"{path}[{i}]", stack) for i, arg in enumerate(args)]
        return {"type": "array", "prefixItems": items, "minItems": len(items), "maxItems": len(items)}
    if origin in (dict, Mapping):
        if args[0] is not str:
            raise HintError(f"parameter {path!r}: dict keys must be str (JSON object keys are strings)")
        return {"type": "object", "additionalProperties": schema_for(args[1], f"{path}.*", stack)}
    if isinstance(hint, type) and (dataclasses.is_dataclass(hint) or typing.is_typeddict(hint)):
        return _object_schema(hint, path, stack)
    raise HintError(f"parameter {path!r}: unsupported type hint {hint!r}; supported: {_SUPPORTED}")


@dataclass(frozen=True)
class Signature:
    """What a tool function takes: the model-facing schema and hints, and the runtime-supplied parameters."""

    schema: dict[str, Any]
    hints: Mapping[str, Any]
    fill_none: frozenset[str]  # nullable parameters without a default: omitted means None
    accepts_key: bool
    accepts_ctx: bool


def read_signature(fn: Callable[..., Any]) -> Signature:
    """The input schema of `fn`'s parameters, minus the runtime-supplied `idempotency_key` and `ctx`."""
    if inspect.iscoroutinefunction(fn):
        raise HintError("async functions are not supported; tools run inside a synchronous Celery task")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as exc:
        raise HintError(f"cannot read the signature of {fn!r}: {exc}") from exc
    hints = _hints_of(fn, "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    fill_none: set[str] = set()
    for parameter in parameters:
        name = parameter.name
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD, parameter.POSITIONAL_ONLY):
            raise HintError(f"parameter {name!r}: *args, **kwargs and positional-only parameters are not supported")
        if name in (IDEMPOTENCY_KEY, CONTEXT):
            if name == IDEMPOTENCY_KEY and name in hints and _strip(hints[name]) is not str:
                raise HintError(f"parameter {name!r} must be annotated as str")
            continue
        if name not in hints:
            raise HintError(f"parameter {name!r} has no type hint; the schema the model sees is built from it")
        properties[name] = schema_for(hints[name], name)
        if parameter.default is parameter.empty:
            if _is_optional(hints[name]):
                fill_none.add(name)
            else:
                required.append(name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    names = {parameter.name for parameter in parameters}
    return Signature(
        schema=schema,
        hints={name: hints[name] for name in properties},
        fill_none=frozenset(fill_none),
        accepts_key=IDEMPOTENCY_KEY in names,
        accepts_ctx=CONTEXT in names,
    )


# --- Argument checks ----------------------------------------------------------------------------------------


def _kind_of(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "non-finite number"
    for python_type, kind in _JSON_KINDS.items():
        if isinstance(value, python_type):
            return kind
    if isinstance(value, list | tuple):
        return "array"
    return "object" if isinstance(value, Mapping) else type(value).__name__


_KIND_CHECKS: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    # bool subclasses int in Python; in JSON true is not 1.
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list | tuple),
    "object": lambda v: isinstance(v, Mapping),
}


def _same(value: Any, option: Any) -> bool:
    # 1 == True and 0 == False in Python; in JSON they are different values.
    return value == option and isinstance(value, bool) == isinstance(option, bool)


def _preview(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(schema: Mapping[str, Any], value: Any, path: str, errors: list[str]) -> None:
    where = path or "arguments"
    kinds = _kinds(schema)
    if kinds and not any(_KIND_CHECKS[kind](value) for kind in kinds):
        errors.append(f"{where}: expected {' or '.join(kinds)}, got {_kind_of(value)}")
        return
    if "enum" in schema and not any(_same(value, option) for option in schema["enum"]):
        options = ", ".join(json.dumps(option) for option in schema["enum"])
        errors.append(f"{where}: expected one of {options}, got {_preview(value)}")
        return
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int | float):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{where}: must be >= {schema['minimum']}, got {value}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{where}: must be <= {schema['maximum']}, got {value}")
    elif isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{where}: must be at least {schema['minLength']} characters, got {len(value)}")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{where}: must be at most {schema['maxLength']} characters, got {len(value)}")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            errors.append(f"{where}: must match the pattern {schema['pattern']}, got {_preview(value)}")
        parse = {"date-time": dt.datetime.fromisoformat, "date": dt.date.fromisoformat}.get(schema.get("format", ""))
        if parse is not None:
            try:
                parse(value)
            except ValueError:
                errors.append(f"{where}: expected an ISO 8601 {schema['format']}, got {_preview(value)}")
    elif isinstance(value, list | tuple):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{where}: must have at least {schema['minItems']} items, got {len(value)}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{where}: must have at most {schema['maxItems']} items, got {len(value)}")
        prefix = schema.get("prefixItems", [])
        for index, item in enumerate(value):
            item_schema = prefix[index] if index < len(prefix) else schema.get("items")
            if isinstance(item_schema, Mapping):
                _check(item_schema, item, f"{path}[{index}]", errors)
    elif isinstance(value, Mapping):
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{_join(path, key)}: required property is missing")
        for key, item in value.items():
            if key in properties:
                _check(properties[key], item, _join(path, key), errors)
            elif extra is False:
                errors.append(f"{_join(path, key)}: unexpected property (expected: {', '.join(properties) or 'none'})")
            elif isinstance(extra, Mapping):
                _check(extra, item, _join(path, key), errors)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def schema_errors(schema: Mapping[str, Any], value: Any) -> list[str]:
    """Every way `value` breaks `schema`, one message per problem, each starting with its path.

    Covers the JSON Schema subset this module generates (type incl. lists, enum, required, properties,
    additionalProperties, items, prefixItems, min/max, min/maxLength, min/maxItems, pattern, date formats).

    Example: ``schema_errors({"type": "integer"}, True) == ["arguments: expected integer, got boolean"]``
    """
    errors: list[str] = []
    _check(schema, value, "", errors)
    return errors


def to_python(hint: Any, value: Any) -> Any:
    """Checked JSON back into the hinted Python type (Decimal, datetime, Enum, dataclass, tuple...)."""
    hint = _strip(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (Union, types.UnionType):
        return to_python(next(arg for arg in args if arg is not _NONE), value)
    if origin in (list, Sequence):
        return [to_python(args[0], item) for item in value] if args else list(value)
    if origin is tuple:
        item_hints = [args[0] if args else Any] * len(value) if args[-1:] in ((), (...,)) else list(args)
        return tuple(to_python(item_hint, item) for item_hint, item in zip(item_hints, value, strict=True))
    if origin in (dict, Mapping):
        return {key: to_python(args[1], item) for key, item in value.items()} if args else dict(value)
    if not isinstance(hint, type):
        return value
    if issubclass(hint, enum.Enum):
        return hint(value)
    if hint is Decimal:
        return Decimal(value)
    if hint in (dt.datetime, dt.date):
        return hint.fromisoformat(value)
    if hint in (list, tuple):
        return hint(value)
    if dataclasses.is_dataclass(hint) or typing.is_typeddict(hint):
        hints = typing.get_type_hints(hint, include_extras=True)
        converted = {key: to_python(hints[key], item) for key, item in value.items()}
        if typing.is_typeddict(hint):
            return converted
        for member in dataclasses.fields(hint):
            missing = member.default is dataclasses.MISSING and member.default_factory is dataclasses.MISSING
            if member.init and missing and member.name not in converted:
                converted[member.name] = None  # nullable and omitted: the schema let it be left out
        return hint(**converted)
    return value
