"""Tool definitions: the `@tool` decorator, the Tool a model may call, and the registry of tools by name.

A tool is a Python function the model may call. Its name, docstring and type hints become the definition
sent in the Messages API `tools` parameter (hints map to JSON Schema as `durable_agents.schema` describes);
the arguments the model sends back are checked against the same schema before the function runs. Pure: no
database, no network.

Example::

    from datetime import timedelta
    from decimal import Decimal
    from typing import Annotated

    from durable_agents.tools import Field, tool

    @tool(fresh_for=timedelta(minutes=5))
    def lookup_order(order_id: str) -> dict:
        \"\"\"Look up an order by id: status, lines, amount paid.\"\"\"

    @tool(effectful=True, compensate="reverse_refund")
    def issue_refund(
        order_id: str, amount: Annotated[Decimal, Field(description="EUR", pattern=r"^\\d+(\\.\\d{1,2})?$")],
        *, idempotency_key: str,
    ) -> dict:
        \"\"\"Refund part of an order to the original payment method.\"\"\"
        return payments.refund(order_id, amount, headers={"Idempotency-Key": idempotency_key})

    issue_refund.anthropic_schema()  # {"name": "issue_refund", "description": ..., "input_schema": ...}
    issue_refund.invoke({"order_id": "A1", "amount": "12.50"}, idempotency_key="run-7:refund:toolu_01")

`invoke` turns the checked JSON back into the hinted types (Decimal, datetime, Enum members, dataclasses,
tuples) before calling the function; calling the Tool object directly calls the function unchanged.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import inspect
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from decimal import InvalidOperation
from typing import Any, Generic, ParamSpec, TypeVar, overload

from durable_agents.errors import ToolArgumentsError, ToolDefinitionError, UnknownToolError
from durable_agents.schema import (
    CONTEXT,
    IDEMPOTENCY_KEY,
    Field,
    HintError,
    Signature,
    read_signature,
    schema_errors,
    to_python,
)

__all__ = ["TOOL_NAME_RE", "Field", "Tool", "ToolRegistry", "schema_errors", "tool", "tools"]

P = ParamSpec("P")
R = TypeVar("R")

# The Anthropic Messages API rule for tool names.
TOOL_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def canonical_args(args: Any) -> str:
    """Sorted-keys compact JSON of a call's arguments; TypeError or ValueError if they are not JSON."""
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def args_digest(args: Any) -> str:
    """The hash an approval and an effect store for a call's arguments (`Tool.args_hash`); "" if not JSON."""
    try:
        return hashlib.sha256(canonical_args(args).encode()).hexdigest()
    except (TypeError, ValueError):
        return ""


@dataclass(frozen=True, eq=False)
class Tool(Generic[P, R]):
    """A function the model may call, with its schema and effect policy. Build it with `@tool`.

    * `effectful` tools change the world and must take `idempotency_key: str`; read-only tools need not.
    * `transactional` tools write only to this database, so the engine commits their effect together with
      the outbox row (exactly once); it implies `effectful`.
    * `compensate` names the effectful tool that undoes this one (checked by `ToolRegistry.compensator_of`).
    * `needs_approval` is True, or a predicate over the checked arguments, to park the run for a human first.
    * `fresh_for` is how long a read-only observation stays true; resuming past it re-plans.
    * `parallel_safe=False` keeps the tool from running at the same time as any other call of the same model
      response (the agent runs a response's calls concurrently otherwise, up to TOOL_CONCURRENCY).

    Example::

        refund = registry.get("issue_refund")
        refund.validate({"order_id": "A1", "amount": "12.50"})    # or ToolArgumentsError
        refund.invoke({"order_id": "A1", "amount": "12.50"}, idempotency_key=key, ctx=step_ctx)
        refund("A1", Decimal("12.50"), idempotency_key=key)          # plain call, no checks
    """

    fn: Callable[P, R] = field(repr=False)
    name: str = ""
    description: str = field(default="", repr=False)
    effectful: bool = False
    transactional: bool = False
    compensate: str | None = None
    needs_approval: bool | Callable[[dict[str, Any]], bool] | None = None
    fresh_for: dt.timedelta | None = None
    parallel_safe: bool = True
    input_schema: dict[str, Any] = field(init=False, repr=False)
    _signature: Signature = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fn = self.fn
        if not callable(fn):
            raise ToolDefinitionError(f"@tool needs a function, got {fn!r}")
        name = self.name or getattr(fn, "__name__", "")
        if not isinstance(name, str) or not TOOL_NAME_RE.match(name):
            raise ToolDefinitionError(
                f"tool name {name!r} must match {TOOL_NAME_RE.pattern} (letters, digits, _ and -); pass name=..."
            )
        description = inspect.cleandoc(self.description or getattr(fn, "__doc__", None) or "")
        if not description:
            raise ToolDefinitionError(
                f"tool {name!r} has no description: write a docstring saying what it does and when to use it "
                "(the model reads it to choose tools), or pass description=..."
            )
        effectful = self.effectful or self.transactional
        if self.compensate is not None and not effectful:
            raise ToolDefinitionError(f"tool {name!r}: only effectful tools can have compensate=")
        if self.compensate is not None and not (
            isinstance(self.compensate, str) and TOOL_NAME_RE.match(self.compensate)
        ):
            raise ToolDefinitionError(f"tool {name!r}: compensate={self.compensate!r} is not a valid tool name")
        if self.fresh_for is not None and effectful:
            raise ToolDefinitionError(f"tool {name!r}: fresh_for= applies to read-only observation tools only")
        if self.fresh_for is not None and not (
            isinstance(self.fresh_for, dt.timedelta) and self.fresh_for > dt.timedelta(0)
        ):
            raise ToolDefinitionError(f"tool {name!r}: fresh_for= must be a positive timedelta")
        if not (self.needs_approval is None or isinstance(self.needs_approval, bool) or callable(self.needs_approval)):
            raise ToolDefinitionError(f"tool {name!r}: needs_approval= must be a bool or a callable(args) -> bool")
        try:
            signature = read_signature(fn)
        except HintError as exc:
            raise ToolDefinitionError(f"tool {name!r}: {exc}") from exc
        if effectful and not signature.accepts_key:
            raise ToolDefinitionError(
                f"tool {name!r} is effectful, so it must receive an idempotency key: add `idempotency_key: str` "
                "to its signature and pass the key on to the system it changes (e.g. an Idempotency-Key header)"
            )
        for attribute, value in (
            ("name", name),
            ("description", description),
            ("effectful", effectful),
            ("input_schema", signature.schema),
            ("_signature", signature),
        ):
            object.__setattr__(self, attribute, value)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.fn(*args, **kwargs)

    def anthropic_schema(self) -> dict[str, Any]:
        """One entry of the Messages API `tools` list; a copy, so adding `cache_control` to it is safe."""
        return {"name": self.name, "description": self.description, "input_schema": copy.deepcopy(self.input_schema)}

    def validate(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments as given (defaults not filled in), or ToolArgumentsError listing every problem."""
        errors = schema_errors(self.input_schema, args)
        if errors:
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: {'; '.join(errors)}", errors=errors)
        return dict(args)

    def canonical_args(self, args: Mapping[str, Any]) -> str:
        """Sorted-keys compact JSON: equal arguments give equal text, whatever their key order."""
        try:
            return canonical_args(args)
        except (TypeError, ValueError) as exc:
            message = f"arguments: not JSON-serialisable ({exc})"
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: {message}", errors=[message]) from exc

    def args_hash(self, args: Mapping[str, Any]) -> str:
        """SHA-256 hex digest of `canonical_args(args)`, to tell a replay from a reused key."""
        return hashlib.sha256(self.canonical_args(args).encode()).hexdigest()

    def is_approval_required(self, args: Mapping[str, Any]) -> bool:
        """Whether this call must wait for a human: `needs_approval`, or its verdict on the arguments."""
        if callable(self.needs_approval):
            return bool(self.needs_approval(dict(args)))
        return bool(self.needs_approval)

    def invoke(self, args: Mapping[str, Any], *, idempotency_key: str | None = None, ctx: Any = None) -> R:
        """Check `args`, convert them to the hinted types and call the function.

        `idempotency_key` and `ctx` are passed only if the function declares them; an effectful tool
        without a key is a ValueError (a bug in the caller, not in the model's arguments).
        """
        if self.effectful and not idempotency_key:
            raise ValueError(f"tool {self.name!r} is effectful: invoke it with a stable idempotency_key")
        checked = self.validate(args)
        signature = self._signature
        kwargs: dict[str, Any] = {name: None for name in signature.fill_none}
        try:
            kwargs.update({name: to_python(signature.hints[name], value) for name, value in checked.items()})
        except (ValueError, InvalidOperation) as exc:
            message = f"arguments: {exc}"
            raise ToolArgumentsError(f"invalid arguments for tool {self.name!r}: {message}", errors=[message]) from exc
        if signature.accepts_key:
            kwargs[IDEMPOTENCY_KEY] = idempotency_key
        if signature.accepts_ctx:
            kwargs[CONTEXT] = ctx
        return self.fn(**kwargs)  # type: ignore[arg-type]


class ToolRegistry:
    """Tools by name, each name bound to one function for the life of the process.

    Tool names are persisted contracts (effects and turns record them), hence no silent replacement.

    Example::

        registry = ToolRegistry()

        @tool(registry=registry)
        def ping() -> str:
            \"\"\"Check the service is up.\"\"\"
            return "pong"

        registry.get("ping").invoke({})   # "pong"
    """

    def __init__(self) -> None:
        self._tools: dict[str, Tool[..., Any]] = {}

    def register(self, tool: Tool[P, R]) -> Tool[P, R]:
        existing = self._tools.get(tool.name)
        if existing is not None and existing.fn is not tool.fn:
            where = f"{getattr(existing.fn, '__module__', '?')}.{getattr(existing.fn, '__qualname__', existing.fn)}"
            raise ToolDefinitionError(f"tool name {tool.name!r} is already taken by {where}; pass a different name=")
        self._tools[tool.name] = tool
        return tool

    def unregister(self, name: str) -> None:
        self._tools.pop(name, None)

    @contextmanager
    def isolated(self) -> Iterator[ToolRegistry]:
        """Undo, at the end of the block, every registration and removal made in it: for tests.

        Example::

            with tools.isolated():
                tool(ping)          # the name "ping" is taken inside the block only
        """
        saved = dict(self._tools)
        try:
            yield self
        finally:
            self._tools = saved

    def get(self, name: str) -> Tool[..., Any]:
        try:
            return self._tools[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownToolError(f"no tool named {name!r} (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def anthropic_schemas(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """The Messages API `tools` parameter for `names` in that order (default: every tool, by name)."""
        return [self.get(name).anthropic_schema() for name in (self.names() if names is None else names)]

    def compensator_of(self, tool: Tool[..., Any]) -> Tool[..., Any]:
        """The tool named by `tool.compensate`. Checked here, not at decoration: it may be defined later."""
        if tool.compensate is None:
            raise ToolDefinitionError(f"tool {tool.name!r} declares no compensate= tool")
        try:
            compensator = self.get(tool.compensate)
        except UnknownToolError as exc:
            raise UnknownToolError(f"tool {tool.name!r} names compensate={tool.compensate!r}, but {exc}") from None
        if not compensator.effectful:
            raise ToolDefinitionError(
                f"tool {tool.name!r}: its compensator {compensator.name!r} must be effectful (it changes the world "
                "back) and take idempotency_key"
            )
        return compensator


tools = ToolRegistry()


@overload
def tool(fn: Callable[P, R], /) -> Tool[P, R]: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    effectful: bool = False,
    transactional: bool = False,
    compensate: str | None = None,
    needs_approval: bool | Callable[[dict[str, Any]], bool] | None = None,
    fresh_for: dt.timedelta | None = None,
    parallel_safe: bool = True,
    registry: ToolRegistry | None = None,
) -> Callable[[Callable[P, R]], Tool[P, R]]: ...


def tool(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    effectful: bool = False,
    transactional: bool = False,
    compensate: str | None = None,
    needs_approval: bool | Callable[[dict[str, Any]], bool] | None = None,
    fresh_for: dt.timedelta | None = None,
    parallel_safe: bool = True,
    registry: ToolRegistry | None = None,
) -> Tool[P, R] | Callable[[Callable[P, R]], Tool[P, R]]:
    """Define a tool from a documented, type-hinted function and register it (default: the `tools` registry).

    Definition errors (no docstring, a bad name, an unsupported hint, an effectful tool without
    `idempotency_key`) raise ToolDefinitionError at import time.

    Example::

        @tool
        def get_weather(city: Annotated[str, "City name, e.g. Paris"]) -> dict:
            \"\"\"Current weather for a city.\"\"\"

        @tool(name="send_email", effectful=True, needs_approval=lambda args: len(args["to"]) > 10)
        def send_email(to: list[str], subject: str, body: str, *, idempotency_key: str) -> str:
            \"\"\"Send an email; returns the message id.\"\"\"
    """

    def decorate(fn: Callable[P, R]) -> Tool[P, R]:
        definition = Tool(
            fn,
            name=name or "",
            description=description or "",
            effectful=effectful,
            transactional=transactional,
            compensate=compensate,
            needs_approval=needs_approval,
            fresh_for=fresh_for,
            parallel_safe=parallel_safe,
        )
        return (tools if registry is None else registry).register(definition)

    return decorate if fn is None else decorate(fn)
