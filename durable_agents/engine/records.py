"""Reading and building the engine's rows: runs and waits by id, plan rows, the step under the cursor."""

from __future__ import annotations

import json
import uuid
from contextlib import nullcontext
from typing import Any, TypeVar

from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Model, QuerySet
from django.db.models.expressions import DatabaseDefault
from django.db.models.sql import InsertQuery

from durable_agents.errors import InvalidInputError, RunNotFoundError, WaitNotFoundError
from durable_agents.models import Run, Step, StepKind, StepStatus, Wait
from durable_agents.storable import check_json
from durable_agents.workflows import PlannedStep, Workflow

M = TypeVar("M", bound=Model)


def get_run(run_id: uuid.UUID | str) -> Run:
    """The run with that id, or RunNotFoundError (also for strings that are not UUIDs)."""
    try:
        return Run.objects.get(pk=run_id)
    except (Run.DoesNotExist, ValidationError, ValueError):
        raise RunNotFoundError(f"no run has id {run_id!r}; list runs with `manage.py durable_runs`") from None


def get_wait(wait_id: int | str) -> Wait:
    """The wait with that id (its run loaded), or WaitNotFoundError."""
    try:
        return Wait.objects.select_related("run").get(pk=int(wait_id))
    except (Wait.DoesNotExist, ValueError, TypeError, OverflowError):
        raise WaitNotFoundError(
            f"no wait has id {wait_id!r}; list open waits with `durable_runs --status waiting`"
        ) from None


def plan_row(run_id: Any, definition: Workflow, element: PlannedStep, position: int) -> Step:
    """An unsaved, pending Step row for one plan element, with its definition's freshness budget and dependencies."""
    step_def = definition.definition(element.name)
    args = dict(element.args)
    _check_args(definition, element.step_id, args)
    return Step(
        run_id=run_id,
        step_id=element.step_id,
        name=element.name,
        kind=step_def.kind,
        position=position,
        args=args,
        fresh_for=step_def.fresh_for,
        depends_on=list(step_def.depends_on),
    )


def _check_args(definition: Workflow, step_id: str, args: dict[str, Any]) -> None:
    """A plan's arguments are stored as jsonb: what Postgres would refuse (a NaN, a \\u0000, an object) is an
    InvalidInputError naming the step and the spot, not a DataError from the insert."""
    what = f"workflow {definition.name!r} planned step {step_id!r} with arguments that cannot be stored:"
    try:
        raw = json.dumps(args).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} {exc}; fix the plan (or the input it was given)") from exc
    try:
        check_json(args, "args", InvalidInputError, raw=raw)
    except InvalidInputError as exc:
        raise InvalidInputError(f"{what} {exc}; fix the plan (or the input it was given)") from exc


def current_step_id(run_id: Any, cursor: int) -> str:
    """The id of the live step at `cursor` ("" past the end of the plan)."""
    return Step.objects.live().filter(run_id=run_id, position=cursor).values_list("step_id", flat=True).first() or ""


def let_go(run: Run) -> bool:
    """True for a run whose saga finished (its effects undone, or kept for other runs standing on them): it
    neither resumes nor reruns into that world. A saga stopped half-way has compensation left: False."""
    if not run.finish_as:
        return False
    left = Step.objects.live().filter(run_id=run.id, kind=StepKind.COMPENSATE, position__gte=run.cursor)
    return not left.exclude(status=StepStatus.DONE).exists()


def locked(queryset: QuerySet[M]) -> QuerySet[M]:
    """SELECT ... FOR UPDATE SKIP LOCKED where the database has it (SQLite serialises writers anyway)."""
    if connection.features.has_select_for_update_skip_locked:
        return queryset.select_for_update(skip_locked=True)
    return queryset


def insert_run(run: Run, steps: list[Step]) -> None:
    """Insert a new run and its plan rows in one statement on Postgres (one round trip, its own transaction: no
    BEGIN or COMMIT trips); elsewhere in one transaction. IntegrityError (an idempotency key taken) writes nothing.
    """
    if connection.vendor != "postgresql":
        with transaction.atomic():
            run.save(force_insert=True)
            Step.objects.bulk_create(steps)
        return
    # The run's database defaults (its created_at) come back, as `save` reads them back.
    defaults = [f.attname for f in Run._meta.concrete_fields if isinstance(getattr(run, f.attname), DatabaseDefault)]
    run_sql, params = _insert_sql(Run, [run])
    columns = ", ".join(connection.ops.quote_name(name) for name in defaults) or "id"
    sql = f"WITH r AS ({run_sql} RETURNING {columns})"
    if steps:
        # The steps' foreign keys are checked at the statement's end, when the run's row exists.
        step_sql, step_params = _insert_sql(Step, steps)
        sql, params = f"{sql}, s AS ({step_sql})", (*params, *step_params)
    # Inside a caller's transaction, a savepoint: a key taken by a racing start must not abort that transaction
    # (the start then reads the winner's run in it). In autocommit the statement is its own transaction.
    with transaction.atomic() if connection.in_atomic_block else nullcontext(), connection.cursor() as cursor:
        cursor.execute(f"{sql} SELECT {columns} FROM r", params)
        row = cursor.fetchone()
    for name, value in zip(defaults, row, strict=False):
        setattr(run, name, value)
    run._state.adding, run._state.db = False, connection.alias


def _insert_sql(model: type[Model], objs: list[Any]) -> tuple[str, tuple[Any, ...]]:
    """The ORM's own INSERT of `objs` (their defaults and pre-save values as `save` would write them)."""
    fields = [f for f in model._meta.concrete_fields if not f.generated and not (f.primary_key and f.db_returning)]
    query = InsertQuery(model)
    query.insert_values(fields, objs)
    [(sql, params)] = query.get_compiler(connection=connection).as_sql()
    return sql, tuple(params)
