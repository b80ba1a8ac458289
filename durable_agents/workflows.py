"""Workflow definitions in code: named, versioned plans of named steps, and the registry that holds them.

Example::

    from durable_agents.api import call, workflow

    def fetch(ctx):
        return {"order": ctx.input["order_id"]}

    def notify(ctx):
        return {"sent": ctx.result("fetch")["order"]}

    workflow("notify_customer", version=1, steps=[call("fetch", fetch), call("notify", notify)])
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

from durable_agents.conf import settings
from durable_agents.durations import MAX_DURATION, parse_duration
from durable_agents.errors import DefinitionError, InvalidInputError, UnknownWorkflowError
from durable_agents.search import attributes_of, check_declaration
from durable_agents.states import FINISHED_RUN_STATUSES
from durable_agents.tools import Tool

ON_FAILURE_POLICIES = ("fail", "compensate")
MISSING_VERSION_POLICIES = ("continue", "replan", "park")
MAX_CONCURRENCY_LIMIT = 10_000
# What a validator or plan function raises on an input it cannot read (missing key, wrong type): an input error.
INPUT_SHAPE_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, LookupError, AttributeError)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,199}$")
# RETENTION's key for every workflow the settings do not name (retention.py). A workflow of that name declaring its
# own ages would lend them to every other workflow: the policy could not tell "default" the workflow from the rest.
RETENTION_DEFAULT = "default"


@dataclass(frozen=True)
class RetryPolicy:
    """How a failing step is retried: attempts in all, exponential backoff with jitter, what is transient.

    Unset fields take the DURABLE_AGENTS defaults. `retry_on` adds exception types the step declares
    transient, on top of `RetryableError`, timeouts, connection and database connection errors.
    """

    max_attempts: int | None = None
    backoff: float | None = None
    backoff_max: float | None = None
    retry_on: tuple[type[BaseException], ...] = ()

    @property
    def attempts_allowed(self) -> int:
        return self.max_attempts if self.max_attempts is not None else int(settings.RETRY_MAX_ATTEMPTS)

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt + 1`: exponential, capped, with equal jitter."""
        base = self.backoff if self.backoff is not None else float(settings.RETRY_BACKOFF_SECONDS)
        cap = self.backoff_max if self.backoff_max is not None else float(settings.RETRY_BACKOFF_MAX_SECONDS)
        ceiling = min(cap, base * 2 ** max(attempt - 1, 0))
        return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass(frozen=True)
class StepDef:
    """A step definition: what a plan element named `name` executes."""

    name: str
    kind: str
    fn: Callable[..., Any] | None = None
    retry: RetryPolicy | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    # An observation of the outside world holds this long; steps that depend on it re-plan when it is older.
    fresh_for: timedelta | None = None
    # Step ids of the observations this step relies on.
    depends_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlannedStep:
    """One element of a run's plan: a unique step id executing the definition `name` with `args`."""

    step_id: str
    name: str
    args: Mapping[str, Any] = field(default_factory=dict)


def call(
    name: str,
    fn: Callable[..., Any],
    *,
    retry: RetryPolicy | None = None,
    fresh_for: timedelta | None = None,
    depends_on: Sequence[str] = (),
) -> StepDef:
    """A call step: `fn(ctx)` gets a StepContext and returns a JSON-serialisable result.

    `fresh_for` marks the result as an observation that goes stale; `depends_on` names the observations
    (step ids) this step relies on — if one is older than its budget when this step is due, the run
    re-plans from that observation instead of acting on a stale world.

    Example: ``call("charge", charge_card, retry=RetryPolicy(max_attempts=3), depends_on=["load_order"])``
    """
    if not callable(fn):
        raise DefinitionError(f"call step {name!r}: {fn!r} is not callable")
    return StepDef(name=name, kind="call", fn=fn, retry=retry, fresh_for=fresh_for, depends_on=tuple(depends_on))


def tool_step(
    name: str,
    tool: Tool[..., Any],
    args: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]] | None = None,
    *,
    retry: RetryPolicy | None = None,
    depends_on: Sequence[str] = (),
) -> StepDef:
    """A step that invokes one tool: effectful tools get an idempotency key stable across re-executions.

    `args` is a dict (merged with the plan element's args) or `fn(ctx) -> dict` built from the run input
    and earlier results. Example::

        tool_step("refund", issue_refund, lambda ctx: {"order_id": ctx.input["order_id"], "amount": "10.00"})
    """
    if not isinstance(tool, Tool):
        raise DefinitionError(f"tool step {name!r}: {tool!r} is not a @tool")

    def invoke(ctx: Any) -> Any:
        values = args(ctx) if callable(args) else {**(args or {}), **ctx.args}
        return ctx.call_tool(tool, values)

    return StepDef(
        name=name,
        kind="tool",
        fn=invoke,
        retry=retry,
        options={"tool": tool.name},
        fresh_for=tool.fresh_for,
        depends_on=tuple(depends_on),
    )


DEADLINE_POLICIES = ("live", "fail")
EXPIRY_POLICIES = ("retry", "live", "fail")


@dataclass(frozen=True)
class Batch:
    """How a step's model calls go through the Message Batches API.

    `deadline`: how long a call may wait for its batch's answer (None: until the API's own 24 h expiry);
    `on_deadline`: "live" asks the model directly once it passed, "fail" fails the step; `on_expired`: what an
    expired or canceled result does — "retry" sends the call in a new batch, "live" asks directly, "fail" fails.
    """

    deadline: timedelta | None = None
    on_deadline: str = "live"
    on_expired: str = "retry"

    def __init__(
        self, *, deadline: timedelta | str | None = None, on_deadline: str = "live", on_expired: str = "retry"
    ) -> None:
        if isinstance(deadline, str):
            try:
                deadline = parse_duration(deadline)
            except (ValueError, InvalidInputError) as exc:
                raise DefinitionError(f"Batch(deadline={deadline!r}): {exc}") from None
        elif deadline is not None and not isinstance(deadline, timedelta):
            raise DefinitionError(f'Batch(deadline={deadline!r}): give a duration, e.g. "2h", or a timedelta')
        if deadline is not None and deadline <= timedelta(0):
            raise DefinitionError(f"Batch(deadline={deadline}): a deadline must be positive")
        if on_deadline not in DEADLINE_POLICIES:
            raise DefinitionError(f"Batch(on_deadline={on_deadline!r}): choose one of {', '.join(DEADLINE_POLICIES)}")
        if on_expired not in EXPIRY_POLICIES:
            raise DefinitionError(f"Batch(on_expired={on_expired!r}): choose one of {', '.join(EXPIRY_POLICIES)}")
        object.__setattr__(self, "deadline", deadline)
        object.__setattr__(self, "on_deadline", on_deadline)
        object.__setattr__(self, "on_expired", on_expired)


DELIVERY_CHOICES = ("live", "batch")


@dataclass(frozen=True)
class Cron:
    """A schedule a workflow declares: start it with `input` at every slot of `expression`, in `timezone`.

    Build it with `cron(...)`. Its options are `api.schedule`'s; the sweep syncs it into a Schedule row named
    `name` (default: the workflow's name) from the newest registered version of the workflow (engine/declared.py).
    The system checks validate it at start-up (durable_agents.E017, E018).
    """

    expression: str
    timezone: str = "UTC"
    input: Any = None
    missed: str = "skip"
    catch_up_limit: int = 10
    overlap: str = "skip"
    name: str | None = None


def cron(
    expression: str,
    *,
    timezone: str = "UTC",
    input: Any = None,  # noqa: A002 - the run's input, as api.schedule names it
    missed: str = "skip",
    catch_up_limit: int = 10,
    overlap: str = "skip",
    name: str | None = None,
) -> Cron:
    """A declared schedule for `workflow(..., schedule=...)`: the same options as `api.schedule`.

    Example::

        workflow("digest", steps=[call("send", send_digest)],
                 schedule=cron("0 3 * * *", timezone="Europe/Paris", input={"days": 1}))
        workflow("report", steps=[call("render", render_report)],
                 schedule=[cron("0 6 * * 1-5", name="report-weekdays"),
                           cron("0 9 * * 6", name="report-saturday", input={"short": True})])
    """
    return Cron(expression, timezone, input, missed, catch_up_limit, overlap, name)


def delivery_param(value: Batch | str | None, where: str) -> Batch | str | None:
    """A step's or workflow's `delivery=` checked: None (inherit), "live", or a Batch ("batch": the defaults)."""
    if value is None or isinstance(value, Batch):
        return value
    if value == "batch":
        return Batch()
    if value == "live":
        return "live"
    raise DefinitionError(f'{where}: delivery={value!r} is not one; use "live", "batch" or Batch(...)')


@dataclass(frozen=True)
class Workflow:
    """A named, versioned workflow definition. Build it with `workflow(...)`, which also registers it."""

    name: str
    version: int
    steps: tuple[StepDef, ...]
    plan: Callable[[Any], Sequence[PlannedStep]] | None = None
    retry: RetryPolicy = RetryPolicy()
    validate_input: Callable[[Any], None] | None = None
    description: str = ""
    # "fail": a failed step fails the run; "compensate": first undo applied effects, newest first (saga).
    on_failure: str = "fail"
    # What a run pinned to a version that is no longer registered does, decided by the newest version:
    # "continue" on this version, "replan" (this version's plan for what is left), or "park" for an operator.
    on_missing_version: str = "park"
    # Spend limits for every run of this workflow (a run may override them); None means unlimited.
    token_budget: int | None = None
    cost_budget_usd: Decimal | None = None
    # Concurrency key (engine/admission.py): `concurrency_key(input)` names the key a run holds from its admission to
    # its end (None: no key); at most `concurrency_limit` runs hold one key at a time, the rest wait in order.
    concurrency_key: Callable[[Any], str | None] | None = None
    concurrency_limit: int = 1
    # How long finished runs are kept, by status ("30d", a timedelta, None: for ever), unless RETENTION in the
    # settings names this workflow (retention.py); a status left out falls back to RETENTION["default"].
    retention: Mapping[str, str | timedelta | None] | None = None
    # Input fields a run is found by (search.py): stored on the run at start as `{field: value}` strings.
    search: Sequence[str] = ()
    # How its model steps (agent, judge, planner) are answered unless a step says otherwise: None or "live" (each
    # call at once), or a Batch (each call in a Message Batch, at half price: agents/batching.py).
    delivery: Batch | str | None = None
    # Schedules declared in code (`cron(...)`): the sweep keeps a Schedule row for each (engine/declared.py).
    schedules: tuple[Cron, ...] = ()

    def __post_init__(self) -> None:
        for declared in self.schedules:
            if not isinstance(declared, Cron):
                raise DefinitionError(
                    f'workflow {self.name!r}: schedule={declared!r} is not a cron(...); e.g. schedule=cron("0 3 * * *")'
                )
        object.__setattr__(self, "search", check_declaration(self.name, self.search))
        if self.retention is not None:
            object.__setattr__(self, "retention", self._retention_ages(self.retention))
        limit = self.concurrency_limit
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT:
            raise DefinitionError(
                f"workflow {self.name!r}: concurrency_limit must be an integer from 1 to {MAX_CONCURRENCY_LIMIT}, "
                f"got {limit!r}"
            )
        if self.concurrency_key is not None and not callable(self.concurrency_key):
            raise DefinitionError(
                f"workflow {self.name!r}: concurrency_key must be a function of the run's input, "
                'e.g. concurrency_key=lambda input: input["customer_id"]'
            )
        if self.on_missing_version not in MISSING_VERSION_POLICIES:
            raise DefinitionError(
                f"workflow {self.name!r}: on_missing_version must be one of {', '.join(MISSING_VERSION_POLICIES)}"
            )
        if self.on_failure not in ON_FAILURE_POLICIES:
            raise DefinitionError(
                f"workflow {self.name!r}: on_failure must be one of {', '.join(ON_FAILURE_POLICIES)}, "
                f"got {self.on_failure!r}"
            )
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise DefinitionError(f"workflow name {self.name!r} must match {NAME_RE.pattern}")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise DefinitionError(f"workflow {self.name!r}: version must be an integer >= 1, got {self.version!r}")
        seen: set[str] = set()
        for definition in self.steps:
            if not isinstance(definition, StepDef):
                raise DefinitionError(f"workflow {self.name!r}: {definition!r} is not a step definition")
            if not NAME_RE.match(definition.name):
                raise DefinitionError(
                    f"workflow {self.name!r}: step name {definition.name!r} must match {NAME_RE.pattern}"
                )
            if definition.name in seen:
                raise DefinitionError(f"workflow {self.name!r}: duplicate step name {definition.name!r}")
            unknown = [d for d in definition.depends_on if d not in seen]
            if unknown and self.plan is None:
                raise DefinitionError(
                    f"workflow {self.name!r}: step {definition.name!r} depends on {unknown}, which are not "
                    "earlier steps"
                )
            seen.add(definition.name)
        if not self.steps:
            raise DefinitionError(f"workflow {self.name!r}: define at least one step")

    def _retention_ages(self, given: Any) -> dict[str, timedelta | None]:
        example = "e.g. retention={'completed': '30d', 'failed': None}"
        if self.name == RETENTION_DEFAULT:
            raise DefinitionError(
                f"workflow {self.name!r} cannot declare retention: RETENTION[{RETENTION_DEFAULT!r}] means every "
                f"workflow the settings do not name; rename the workflow, or give its ages in the settings"
            )
        if not isinstance(given, Mapping):
            raise DefinitionError(f"workflow {self.name!r}: retention maps finished statuses to ages, {example}")
        ages: dict[str, timedelta | None] = {}
        for status, age in given.items():
            if status not in FINISHED_RUN_STATUSES:
                finished = ", ".join(str(s) for s in FINISHED_RUN_STATUSES)
                raise DefinitionError(
                    f"workflow {self.name!r}: retention names status {status!r}; only finished runs are pruned: "
                    f"use {finished}"
                )
            try:
                ages[str(status)] = age if age is None or isinstance(age, timedelta) else parse_duration(age)
            except InvalidInputError as exc:
                raise DefinitionError(f"workflow {self.name!r}: retention[{status!r}]: {exc}") from None
            if isinstance(age, timedelta) and age < timedelta(0):
                raise DefinitionError(f"workflow {self.name!r}: retention[{status!r}] is negative: {age}")
            if isinstance(age, timedelta) and age > MAX_DURATION:
                # Past it, `now - age` overflows in every prune pass.
                raise DefinitionError(
                    f"workflow {self.name!r}: retention[{status!r}] is longer than 100 years; use None to keep for ever"
                )
        return ages

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def definition(self, name: str) -> StepDef:
        for definition in self.steps:
            if definition.name == name:
                return definition
        raise DefinitionError(f"workflow {self.label} has no step named {name!r}")

    def search_attributes(self, run_input: Any) -> dict[str, str]:
        """The values of this workflow's search fields in `run_input`, as stored on its run (search.py)."""
        return attributes_of(self.search, run_input)

    def retry_policy(self, definition: StepDef) -> RetryPolicy:
        return definition.retry or self.retry

    def build_plan(self, run_input: Any) -> list[PlannedStep]:
        """Validate the input and return the run's plan; bad input raises InvalidInputError."""
        if self.validate_input is not None:
            try:
                self.validate_input(run_input)
            except InvalidInputError:
                raise
            except INPUT_SHAPE_ERRORS as exc:
                raise InvalidInputError(f"invalid input for {self.label}: {exc}") from exc
        if self.plan is None:
            planned = [PlannedStep(step_id=d.name, name=d.name) for d in self.steps]
        else:
            try:
                planned = list(self.plan(run_input))
            except InvalidInputError:
                raise
            except INPUT_SHAPE_ERRORS as exc:
                # An input the plan cannot read (a schedule's input after a deploy): a clear input error that the
                # caller (start, a schedule's sweep, a child's spawn) reports, not a crash of the caller.
                raise InvalidInputError(f"invalid input for {self.label}: its plan raised {exc!r}") from exc
        names = {d.name for d in self.steps}
        ids: set[str] = set()
        for element in planned:
            if not NAME_RE.match(element.step_id):
                raise InvalidInputError(f"{self.label}: planned step id {element.step_id!r} is invalid")
            if element.step_id in ids:
                raise InvalidInputError(f"{self.label}: planned step id {element.step_id!r} appears twice")
            if element.name not in names:
                raise InvalidInputError(
                    f"{self.label}: planned step {element.step_id!r} names unknown step {element.name!r}"
                )
            ids.add(element.step_id)
        return planned


class Registry:
    """All workflow definitions of this process, by name and version."""

    def __init__(self) -> None:
        self._workflows: dict[str, dict[int, Workflow]] = {}

    def register(self, definition: Workflow, *, replace: bool = False) -> Workflow:
        versions = self._workflows.setdefault(definition.name, {})
        existing = versions.get(definition.version)
        if existing is not None and existing is not definition and not replace:
            raise DefinitionError(f"workflow {definition.label} is already registered; bump the version to change it")
        versions[definition.version] = definition
        return definition

    def unregister(self, name: str, version: int | None = None) -> None:
        if version is None:
            self._workflows.pop(name, None)
        else:
            self._workflows.get(name, {}).pop(version, None)

    @contextmanager
    def isolated(self) -> Iterator[Registry]:
        """Undo, at the end of the block, every registration and removal made in it: for tests.

        Example::

            with registry.isolated():
                workflow("scratch", steps=[call("only", fn)])
            registry.names()   # "scratch" is gone
        """
        saved = {name: dict(versions) for name, versions in self._workflows.items()}
        try:
            yield self
        finally:
            self._workflows = saved

    def get(self, name: str, version: int | None = None) -> Workflow:
        versions = self._workflows.get(name)
        if not versions:
            known = ", ".join(sorted(self._workflows)) or "none"
            raise UnknownWorkflowError(f"unknown workflow {name!r} (registered: {known})")
        if version is None:
            return versions[max(versions)]
        try:
            return versions[version]
        except KeyError:
            known = ", ".join(str(v) for v in sorted(versions))
            raise UnknownWorkflowError(f"workflow {name!r} has no version {version} (registered: {known})") from None

    def names(self) -> list[str]:
        return sorted(name for name, versions in self._workflows.items() if versions)

    def versions(self, name: str) -> list[int]:
        return sorted(self._workflows.get(name, {}))

    def search_fields(self) -> list[str]:
        """Every field some registered workflow version declares searchable: where the admin looks for a bare value."""
        return sorted({name for versions in self._workflows.values() for d in versions.values() for name in d.search})


registry = Registry()


def workflow(
    name: str,
    *,
    steps: Sequence[StepDef],
    version: int = 1,
    plan: Callable[[Any], Sequence[PlannedStep]] | None = None,
    retry: RetryPolicy | None = None,
    validate_input: Callable[[Any], None] | None = None,
    description: str = "",
    on_failure: str = "fail",
    on_missing_version: str = "park",
    token_budget: int | None = None,
    cost_budget_usd: Decimal | str | None = None,
    concurrency_key: Callable[[Any], str | None] | None = None,
    concurrency_limit: int = 1,
    retention: Mapping[str, str | timedelta | None] | None = None,
    search: Sequence[str] = (),
    replace: bool = False,
    delivery: Batch | str | None = None,
    schedule: Cron | Sequence[Cron] | None = None,
) -> Workflow:
    """Define and register a workflow. `plan(input)` builds a dynamic plan; by default each step runs once.
    `concurrency_key(input)` (with `concurrency_limit`) lets at most that many runs per key be in flight.
    `retention` keeps its finished runs this long by status (`{"completed": "30d"}`), unless the settings'
    RETENTION names the workflow. `search` names input fields (top-level keys, or dotted paths such as
    `"order.id"`) whose values each run stores, so the admin, `durable_runs --search` and `api.runs(search=)` find
    the run by them. `delivery="batch"` (or a `Batch(...)`) sends every model step's calls through the Message
    Batches API at half price, unless the step says `delivery="live"` (agents/batching.py). `schedule=cron(...)`
    (or a list of them) declares its schedules: the sweep creates, updates and removes their rows to match the
    newest registered version (engine/declared.py).

    Example::

        workflow("ticks", steps=[call("tick", tick)],
                 plan=lambda inp: [PlannedStep(f"tick-{i}", "tick") for i in range(inp["steps"])])
        workflow("refund_request", steps=[call("lookup", lookup)], search=("order_id", "customer"))
    """
    definition = Workflow(
        name=name,
        version=version,
        steps=tuple(steps),
        plan=plan,
        retry=retry or RetryPolicy(),
        validate_input=validate_input,
        description=description,
        on_failure=on_failure,
        on_missing_version=on_missing_version,
        token_budget=token_budget,
        cost_budget_usd=Decimal(str(cost_budget_usd)) if cost_budget_usd is not None else None,
        concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
        retention=retention,
        search=search,
        delivery=delivery_param(delivery, f"workflow {name!r}"),
        schedules=_schedules_param(schedule),
    )
    return registry.register(definition, replace=replace)


def _schedules_param(schedule: Cron | Sequence[Cron] | None) -> tuple[Cron, ...]:
    if schedule is None:
        return ()
    if isinstance(schedule, Cron | str | bytes | Mapping):
        return (schedule,)  # type: ignore[return-value] - a string or dict is refused by Workflow, with the fix
    return tuple(schedule)
