"""Reading and building the engine's rows: runs and waits by id, plan rows, the step under the cursor."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import Model, QuerySet

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
    return new_plan_row(definition, element, position).step(run_id)


@dataclass(frozen=True)
class PlanRow:
    """One plan element of a run not written yet, checked, its JSON encoded once (starts.py writes it as is)."""

    step_id: str
    name: str
    kind: str
    position: int
    args: dict[str, Any]
    args_json: str
    fresh_for: timedelta | None
    depends_on: list[str]

    def step(self, run_id: Any) -> Step:
        """The unsaved, pending Step row of this element in run `run_id`."""
        return Step(
            run_id=run_id,
            step_id=self.step_id,
            name=self.name,
            kind=self.kind,
            position=self.position,
            args=self.args,
            fresh_for=self.fresh_for,
            depends_on=list(self.depends_on),
        )


def new_plan_row(definition: Workflow, element: PlannedStep, position: int) -> PlanRow:
    """The plan element at `position`, with its definition's kind, freshness budget and dependencies; arguments
    Postgres could not store are an InvalidInputError."""
    step_def = definition.definition(element.name)
    args = dict(element.args)
    return PlanRow(
        step_id=element.step_id,
        name=element.name,
        kind=step_def.kind,
        position=position,
        args=args,
        args_json=_checked_args(definition, element.step_id, args),
        fresh_for=step_def.fresh_for,
        depends_on=list(step_def.depends_on),
    )


def _checked_args(definition: Workflow, step_id: str, args: dict[str, Any]) -> str:
    """A plan's arguments as the JSON text stored (jsonb): what Postgres would refuse (a NaN, a \\u0000, an object)
    is an InvalidInputError naming the step and the spot, not a DataError from the insert."""
    what = f"workflow {definition.name!r} planned step {step_id!r} with arguments that cannot be stored:"
    try:
        raw = json.dumps(args)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInputError(f"{what} {exc}; fix the plan (or the input it was given)") from exc
    try:
        check_json(args, "args", InvalidInputError, raw=raw.encode())
    except InvalidInputError as exc:
        raise InvalidInputError(f"{what} {exc}; fix the plan (or the input it was given)") from exc
    return raw


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
