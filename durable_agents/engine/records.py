"""Reading and building the engine's rows: runs and waits by id, plan rows, the step under the cursor."""

from __future__ import annotations

import uuid
from typing import Any, TypeVar

from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import Model, QuerySet

from durable_agents.errors import RunNotFoundError, WaitNotFoundError
from durable_agents.models import Run, Step, StepKind, StepStatus, Wait
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
    return Step(
        run_id=run_id,
        step_id=element.step_id,
        name=element.name,
        kind=step_def.kind,
        position=position,
        args=dict(element.args),
        fresh_for=step_def.fresh_for,
        depends_on=list(step_def.depends_on),
    )


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


def release_connection(*, pooled_only: bool = False) -> None:
    """Give this thread's (greenlet's) database connection back before a wait on the network: to the pool
    (Django's psycopg pool, on the model worker), or closed; the next query takes one again. Inside a
    transaction it is kept, as the transaction needs it. `pooled_only`: keep an unpooled connection (a
    reconnect would cost more than the wait, e.g. a short call to an outside system from a prefork worker)."""
    if connection.in_atomic_block:
        return
    if pooled_only and not (connection.settings_dict.get("OPTIONS") or {}).get("pool"):
        return
    connection.close()


def locked(queryset: QuerySet[M]) -> QuerySet[M]:
    """SELECT ... FOR UPDATE SKIP LOCKED where the database has it (SQLite serialises writers anyway)."""
    if connection.features.has_select_for_update_skip_locked:
        return queryset.select_for_update(skip_locked=True)
    return queryset
