"""The start's statement on Postgres: new runs and their plan rows inserted together, their idempotency keys settled
by the same statement.

Only `starts.py` calls this module: it is the fast implementation of its write, the way procrastinate's
`defer_jobs` and Graphile Worker's `add_jobs` take a batch of jobs. One statement, whatever the number of runs: their
values go as one array per column (unnest), so its text is built once per process (two shapes: with idempotency keys
or without), no ORM query is compiled per start, and in autocommit it is sent as the step loop's statements are
(`statements.cursor`): prepared on the server from its second use on a connection, so a web process that keeps its
connections (CONN_MAX_AGE) neither parses nor plans it again. Inside the caller's transaction it goes plain.
Outside a transaction the statement is its own transaction (no BEGIN/COMMIT round trips); inside the caller's it is
one more statement of it, with no savepoint.

Idempotency keys, as procrastinate's queueing locks and Graphile Worker's job keys, are settled in the statement:

* a key a committed run holds (as the statement's snapshot sees it) inserts nothing for that input: the run holding
  it comes back in the statement's result;
* a key held by a run of another workflow or another input inserts nothing at all — no run of the batch — and comes
  back the same way: the caller raises IdempotencyKeyReusedError;
* a key taken by a start that commits while this statement runs (a race its snapshot cannot see): outside a
  transaction the INSERT fails whole on the key's constraint (`KeyTaken`) and the caller sends it again, when it sees
  the winner; inside the caller's transaction ON CONFLICT DO NOTHING skips that input (failing would abort the
  caller's transaction), and `Inserted.count` tells the caller to read the winner.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connection, connections
from django.db.models import Field, Model

from durable_agents.engine import statements
from durable_agents.engine.records import PlanRow
from durable_agents.models import Run, Step

# The columns a start gives per run and per plan row. Every other column takes its field's default: written as a
# constant in the statement, or left to the database's default (NULL for a nullable column without one).
RUN_VALUES = (
    "id",
    "workflow",
    "workflow_version",
    "input",
    "input_hash",
    "idempotency_key",
    "step_count",
    "concurrency_key",
    "concurrency_limit",
    "schedule",
    "search",
    "participant",
    "replay_lane",
    "trace_context",
)
STEP_VALUES = ("run_id", "step_id", "name", "kind", "position", "args", "fresh_for", "depends_on")
# The run's db_default (Now(), STATEMENT_TIMESTAMP() on Postgres), written by the statement and returned once for all;
# the n-th run of a batch a microsecond after the one before it, so the batch's order is its runs' creation order (a
# concurrency key admits its queue by created_at: in the order given, not by id).
STAMPED = ("created_at", "updated_at")
CREATED_AT = "STATEMENT_TIMESTAMP() + (v.n - 1) * INTERVAL '1 microsecond'"
IDEMPOTENCY_CONSTRAINT = "durable_run_idempotency_key_uniq"
# A run row as Run.from_db takes it: every column, in the model's order.
RUN_FIELDS = tuple(f.attname for f in Run._meta.concrete_fields)


@cache
def is_available() -> bool:
    # The default database's backend, which a process does not change.
    return connection.vendor == "postgresql"


@dataclass(frozen=True)
class Inserted:
    """What the statement did: how many runs it inserted, at what time (the first run's created_at: the n-th's is n - 1
    microseconds later), and the runs that already held a key of the batch, by key (their whole rows; none inserted if
    one of them has another input)."""

    count: int
    created_at: datetime
    existing: dict[str, Run]


class KeyTaken(Exception):
    """A racing start committed an idempotency key of the batch while the statement ran; nothing was written."""


def insert_runs(runs: Sequence[Run], inputs: Sequence[str], plans: Sequence[Sequence[PlanRow]]) -> Inserted:
    """Insert `runs` (unsaved, their keys distinct; `inputs`: their inputs' JSON text) with their plan rows, unless a
    key is taken (the module's docstring)."""
    encoded = {"input": inputs, "search": [json.dumps(run.search) for run in runs]}
    params = {
        f"r_{name}": _array(encoded[name] if name in encoded else [getattr(run, name) for run in runs])
        for name in RUN_VALUES
    }
    rows = [(run.id, row) for run, plan in zip(runs, plans, strict=True) for row in plan]
    params.update(
        s_run_id=_array([run_id for run_id, _ in rows]),
        s_step_id=_array([row.step_id for _, row in rows]),
        s_name=_array([row.name for _, row in rows]),
        s_kind=_array([row.kind for _, row in rows]),
        s_position=_array([row.position for _, row in rows]),
        s_args=_array([row.args_json for _, row in rows]),
        s_fresh_for=_array([row.fresh_for for _, row in rows]),
        s_depends_on=_array([json.dumps(row.depends_on) for _, row in rows]),
    )
    keyed = any(run.idempotency_key is not None for run in runs)
    db = connections[DEFAULT_DB_ALIAS]
    skip_conflicts = keyed and db.in_atomic_block
    try:
        # Prepared in autocommit only. Postgres may refuse a prepared statement before running it (a migration changed
        # the type of a column it returns; an undeclared pooler lost it): statements.cursor then sends it again, but
        # not inside a transaction, which the refusal has aborted — and the caller's (a request's) would be lost.
        chosen = db.cursor() if db.in_atomic_block else statements.cursor(db)
        with chosen as cursor:
            cursor.execute(_start_sql(keyed, skip_conflicts), params)
            found = cursor.fetchall()
    except IntegrityError as exc:
        if _constraint(exc) == IDEMPOTENCY_CONSTRAINT and not skip_conflicts:
            raise KeyTaken from exc
        raise
    count, created_at = found[0][0], found[0][1]
    existing = {}
    for row in found:
        if len(row) > 2 and row[2] is not None:
            run = Run.from_db(DEFAULT_DB_ALIAS, RUN_FIELDS, _decode(row[2 : 2 + len(RUN_FIELDS)]))
            existing[run.idempotency_key] = run
    return Inserted(count=count, created_at=created_at, existing=existing)


def _array(values: Sequence[Any]) -> str:
    """`values` as the text of a Postgres array (each value's text quoted, None as NULL), sent as one parameter and
    cast by the statement: psycopg adapts a list element by element in Python, which cost a start more than all the
    rest of its Python."""
    if len(values) == 1:  # a lone start's every column
        return "{" + _element(values[0]) + "}"
    return "{" + ",".join([_element(value) for value in values]) + "}"


def _element(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, timedelta):
        value = f"{value.days} days {value.seconds} seconds {value.microseconds} microseconds"
    text = value if value.__class__ is str else str(value)
    if "\\" in text or '"' in text:
        text = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _constraint(exc: IntegrityError) -> str:
    diag = getattr(exc.__cause__, "diag", None)
    return getattr(diag, "constraint_name", None) or ""


def _decode(values: Sequence[Any]) -> list[Any]:
    # Django loads jsonb as text and decodes it in JSONField.from_db_value; do the same for a raw row.
    return [
        field.from_db_value(value, None, connection) if hasattr(field, "from_db_value") else value
        for field, value in zip(Run._meta.concrete_fields, values, strict=True)
    ]


def _fields(model: type[Model]) -> dict[str, Field[Any, Any]]:
    return {f.attname: f for f in model._meta.concrete_fields}


def _constants(model: type[Model], given: Sequence[str]) -> dict[str, str]:
    """The columns of `model` a start does not give, each with the SQL of its default; a column the database fills
    (its own default, or NULL) is left out."""
    constants = {}
    for name, field in _fields(model).items():
        if name in given or field.generated:
            continue
        default = field.get_default() if field.has_default() else None
        if field.has_default() and callable(field.default) and field.default not in (dict, list):
            raise AssertionError(f"{model.__name__}.{name}'s default differs per row: add it to the start's values")
        if field.has_db_default() and (not field.has_default() or default == field.db_default):
            continue
        if default is None and field.null:
            continue
        if isinstance(default, str):
            default = str(default)  # a TextChoices member, as the plain string psycopg adapts
        constants[field.column] = connection.ops.compose_sql("%s", [field.get_db_prep_save(default, connection)])
    return constants


def _unnest(model: type[Model], names: Sequence[str], prefix: str, alias: str, *, numbered: bool = False) -> str:
    """unnest() of one array parameter per column (its text: _array), each cast to its column's type (`numbered`: and
    `n`, from 1)."""
    fields = _fields(model)
    arrays = ", ".join(f"%({prefix}{name})s::{_array_of(fields[name])}" for name in names)
    columns = [fields[name].column for name in names] + (["n"] if numbered else [])
    return f"unnest({arrays}){' WITH ORDINALITY' if numbered else ''} {alias}({', '.join(columns)})"


def _array_of(field: Field[Any, Any]) -> str:
    # Text for every character column: a cast to varchar(n) would cut a longer value to fit, where the INSERT (an
    # assignment to the column) refuses it.
    cast = field.cast_db_type(connection) or "text"
    return f"{'text' if cast.startswith(('varchar', 'char')) else cast}[]"


@cache
def _start_sql(keyed: bool, skip_conflicts: bool) -> str:
    """The statement: for a batch with keys (`keyed`), with the runs holding them, and (`skip_conflicts`) ON CONFLICT
    DO NOTHING; without, the two INSERTs alone."""
    q = connection.ops.quote_name
    run_table, step_table = q(Run._meta.db_table), q(Step._meta.db_table)
    run_fields, step_fields = _fields(Run), _fields(Step)
    run_given = [run_fields[name].column for name in RUN_VALUES]
    run_constants = _constants(Run, (*RUN_VALUES, *STAMPED))
    step_constants = _constants(Step, ("id", *STEP_VALUES))
    key = q(run_fields["idempotency_key"].column)
    run_columns = ", ".join(q(c) for c in (*run_given, *STAMPED, *run_constants))
    run_values = ", ".join(
        [f"v.{q(c)}" for c in run_given] + [CREATED_AT] * len(STAMPED) + list(run_constants.values())
    )
    step_given = [step_fields[name].column for name in STEP_VALUES]
    step_columns = ", ".join(q(c) for c in (*step_given, *step_constants))
    step_values = ", ".join([f"p.{q(c)}" for c in step_given] + list(step_constants.values()))
    runs = _unnest(Run, RUN_VALUES, "r_", "v", numbered=True)
    plan_rows = _unnest(Step, STEP_VALUES, "s_", "p")
    steps = f"INSERT INTO {step_table} ({step_columns}) SELECT {step_values} FROM {plan_rows}"
    if not keyed:
        return (
            f"WITH r AS (INSERT INTO {run_table} ({run_columns}) SELECT {run_values} FROM {runs} RETURNING id),"
            f" s AS ({steps}) SELECT (SELECT COUNT(*) FROM r), STATEMENT_TIMESTAMP()"
        )
    # A run of the batch whose key a committed run holds: that run, probed by the key's unique index (LIMIT 1 keeps
    # the lateral probe a probe: a plan that scanned every keyed run to match a batch would grow with the table).
    held = ", ".join(f"t.{q(f.column)}" for f in Run._meta.concrete_fields)
    reused = "t.workflow <> v.workflow OR t.input_hash <> v.input_hash"
    conflicts = f" ON CONFLICT ({key}) WHERE {key} IS NOT NULL DO NOTHING" if skip_conflicts else ""
    return (
        f"WITH v AS (SELECT * FROM {runs}),"
        f" e AS (SELECT {held}, ({reused}) AS reused FROM v, LATERAL (SELECT * FROM {run_table} t"
        f" WHERE t.{key} = v.{key} AND t.{key} IS NOT NULL LIMIT 1) t),"
        f" r AS (INSERT INTO {run_table} ({run_columns}) SELECT {run_values} FROM v"
        f" WHERE NOT EXISTS (SELECT FROM e WHERE e.{key} = v.{key}) AND NOT EXISTS (SELECT FROM e WHERE e.reused)"
        f"{conflicts} RETURNING id),"
        f" s AS ({steps} WHERE p.run_id IN (SELECT id FROM r))"
        " SELECT (SELECT COUNT(*) FROM r), STATEMENT_TIMESTAMP(), e.* FROM (SELECT) one LEFT JOIN e ON TRUE"
    )
