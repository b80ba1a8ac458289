"""The step loop's statements: the claim (with the step's load, on Postgres) and the checkpoint commit.

Only `transitions.py` calls this module: it is the fast implementation of two of its operations, built from
the same rules (`states.RUN_RULES`). Each statement is one round trip and, in autocommit, one transaction:
no BEGIN/COMMIT trips, no ORM query compilation per step. Time is the database's (`STATEMENT_TIMESTAMP()`,
plus the tests' clock shift), never the worker's.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection

from durable_agents import clock
from durable_agents.engine.lease import Claim
from durable_agents.engine.payloads import StoredResult
from durable_agents.models import Run, Step
from durable_agents.states import RUN_RULES, STEP_RULES, RunOp, RunStatus, StepOp, StepStatus


def _in_model_order(model: Any, names: set[str]) -> tuple[str, ...]:
    # Model.from_db matches values to fields in the model's field order, whatever order names are given in.
    return tuple(f.attname for f in model._meta.concrete_fields if f.attname in names)


# The run and step fields a step needs; the rest stay deferred (loaded on first access, if ever).
RUN_FIELDS = _in_model_order(Run, {"id", "workflow", "workflow_version", "input", "participant", "effect_scope"})
STEP_FIELDS = _in_model_order(
    Step, {"id", "run_id", "step_id", "name", "position", "kind", "status", "args", "depends_on", "fresh_for"}
)
CLAIM_RETURNS = (
    "lease_token, cursor, step_count, attempt, previous_lease_owner, finish_as, previous_claimed_at, "
    "previous_lease_expires_at"
)


def is_available() -> bool:
    return connection.vendor == "postgresql"


def _claim_update_sql() -> str:
    # Postgres: the database's time in the statement. SQLite (in this process): the time as parameters.
    # The previous holder's claim and expiry are kept by this same statement: a takeover draws its attempt.
    now, expires = (
        ("(STATEMENT_TIMESTAMP() + %(shift)s)", "(STATEMENT_TIMESTAMP() + %(shift)s + %(lease)s)")
        if is_available()
        else ("%(now)s", "%(expires)s")
    )
    table = connection.ops.quote_name(Run._meta.db_table)
    sources = ", ".join(f"'{s}'" for s in sorted(RUN_RULES[RunOp.CLAIM].sources))
    return f"""
        UPDATE {table}
           SET status = %(running)s, previous_lease_owner = lease_owner, lease_owner = %(owner)s,
               previous_claimed_at = claimed_at, previous_lease_expires_at = lease_expires_at, claimed_at = {now},
               lease_token = lease_token + 1, lease_expires_at = {expires}, attempt = attempt + 1,
               started_at = COALESCE(started_at, {now}), wake_at = NULL
         WHERE id = %(id)s AND status IN ({sources}) AND cancel_requested_at IS NULL
           AND (lease_expires_at IS NULL OR lease_expires_at < {now})
           AND (wake_at IS NULL OR wake_at <= {now})
    """


def claim(run_id: uuid.UUID, owner: str, lease: timedelta) -> Claim | None:
    """Claim the run (a new fencing token) where `claim_and_load` is not available; None if not claimable now."""
    now = clock.now()
    adapt = connection.ops.adapt_datetimefield_value
    params: dict[str, Any] = {
        "owner": owner,
        "running": RunStatus.RUNNING.value,
        "id": Run._meta.pk.get_db_prep_value(run_id, connection),
        "now": adapt(now),
        "expires": adapt(now + lease),
    }
    with connection.cursor() as cursor:
        cursor.execute(f"{_claim_update_sql()} RETURNING {CLAIM_RETURNS}", params)
        row = cursor.fetchone()
    return None if row is None else _claim_of(run_id, owner, (*row, now))


def _claim_of(run_id: uuid.UUID, owner: str, row: Any) -> Claim:
    token, position, step_count, attempt, previous_owner, finish_as = row[:6]
    previous_claimed, previous_expiry, claimed_at = row[6:9]
    return Claim(
        run_id=run_id,
        token=token,
        owner=owner,
        cursor=position,
        step_count=step_count,
        attempt=attempt,
        previous_owner=previous_owner or "",
        finish_as=finish_as or "",
        claimed_at=claimed_at,
        previous_claimed_at=_as_datetime(previous_claimed),
        previous_expires_at=_as_datetime(previous_expiry),
    )


def _as_datetime(value: Any) -> datetime | None:
    # Postgres returns an aware datetime; SQLite's raw cursor the stored text.
    if value is None or isinstance(value, datetime):
        return value
    return connection.ops.convert_datetimefield_value(value, None, connection)


@cache
def _claim_and_load_sql() -> str:
    step = Step._meta.db_table
    run_cols = ", ".join(f"c.{name}" for name in RUN_FIELDS[1:])
    step_cols = ", ".join(f"s.{name}" for name in STEP_FIELDS)
    # `seen` is the run as this statement's snapshot has it; `c` the row the claim updated. A claim that waited
    # for another transaction's row lock updates the row that transaction committed, but the join still reads
    # the plan as it was before: a differing updated_at says the plan may have changed (a saga planned, a
    # migration), and the step is then read again (`stale`).
    return f"""
        WITH c AS ({_claim_update_sql()} RETURNING *)
        SELECT {", ".join(f"c.{col}" for col in CLAIM_RETURNS.split(", "))}, c.claimed_at,
               seen.updated_at IS DISTINCT FROM c.updated_at AS stale, {run_cols}, {step_cols}
          FROM c JOIN {Run._meta.db_table} seen ON seen.id = c.id
          LEFT JOIN {step} s ON s.run_id = c.id AND s.position = c.cursor AND s.status <> %(superseded)s
    """


def claim_and_load(run_id: uuid.UUID, owner: str, lease: timedelta) -> tuple[Claim, Step | None] | None:
    """Claim the run and read its current step with the run's input, in one statement (Postgres)."""
    params = {
        "id": run_id,
        "owner": owner,
        "running": RunStatus.RUNNING.value,
        "shift": clock.offset(),
        "lease": lease,
        "superseded": StepStatus.SUPERSEDED.value,
    }
    with connection.cursor() as cursor:
        cursor.execute(_claim_and_load_sql(), params)
        row = cursor.fetchone()
    if row is None:
        return None
    claimed = _claim_of(run_id, owner, row)
    width = len(CLAIM_RETURNS.split(", ")) + 2
    stale = row[width - 1]
    run_values = (run_id, *row[width : width + len(RUN_FIELDS) - 1])
    step_values = row[width + len(RUN_FIELDS) - 1 :]
    run = Run.from_db(connection.alias, RUN_FIELDS, _decode(Run, RUN_FIELDS, run_values))
    if stale:
        # A fresh statement, a fresh snapshot: the plan as the transaction this claim waited for left it.
        step = Step.objects.live().filter(run_id=run_id, position=claimed.cursor).only(*STEP_FIELDS).first()
        if step is not None:
            step.run = run
        return claimed, step
    if step_values[0] is None:
        return claimed, None
    step = Step.from_db(connection.alias, STEP_FIELDS, _decode(Step, STEP_FIELDS, step_values))
    step.run = run
    return claimed, step


def _decode(model: Any, names: tuple[str, ...], values: tuple[Any, ...]) -> list[Any]:
    # Django loads jsonb as text and decodes it in JSONField.from_db_value; do the same for raw rows.
    out = []
    for name, value in zip(names, values, strict=True):
        field = model._meta.get_field(name)
        out.append(field.from_db_value(value, None, connection) if hasattr(field, "from_db_value") else value)
    return out


@cache
def _commit_sql(ending: bool) -> str:
    run, step = Run._meta.db_table, Step._meta.db_table
    now = "(STATEMENT_TIMESTAMP() + %(shift)s)"
    run_sources = RUN_RULES[RunOp.COMPLETE if ending else RunOp.CHECKPOINT].sources
    step_sources = ", ".join(f"'{s}'" for s in sorted(STEP_RULES[StepOp.COMMIT].sources))
    # The last step ends the run, unless a cancel is pending: then it is checkpointed and the cancellation
    # (with its compensation, if asked) is settled next. A requested stop is never lost to a completion.
    ends = "cancel_requested_at IS NULL" if ending else "FALSE"
    finish = (
        f", status = CASE WHEN {ends} THEN %(ending)s ELSE status END"
        f", output = CASE WHEN {ends} THEN %(output)s::jsonb ELSE output END"
        f", finished_at = CASE WHEN {ends} THEN {now} ELSE finished_at END"
        if ending
        else ""
    )
    # The run row is locked first, then the step is written, then the run only if the step was: a step that
    # is no longer live (superseded, failed by a deadline) moves no cursor and releases no lease.
    return f"""
        WITH held AS (
            SELECT id FROM {run}
             WHERE id = %(run_id)s AND lease_token = %(token)s
               AND cursor = %(position)s AND step_count = %(step_count)s
               AND status IN ({", ".join(f"'{s}'" for s in sorted(run_sources))})
               FOR UPDATE
        ), s AS (
            UPDATE {step}
               SET status = %(done)s, result = %(result)s::jsonb, result_ref = %(ref)s, result_hash = %(sha)s,
                   error = NULL, attempts = %(attempts)s, started_at = %(started)s, finished_at = {now},
                   updated_at = {now}, observed_at = CASE WHEN fresh_for IS NULL THEN NULL ELSE %(started)s END
             WHERE id = %(step_pk)s AND status IN ({step_sources}) AND EXISTS (SELECT 1 FROM held)
         RETURNING id
        )
        UPDATE {run}
           SET cursor = %(cursor)s, attempt = 0, lease_owner = '', lease_expires_at = NULL,
               updated_at = {now}{finish}
         WHERE id IN (SELECT id FROM held) AND EXISTS (SELECT 1 FROM s)
     RETURNING {ends}
    """


def commit_checkpoint(claim: Claim, step: Step, stored: StoredResult, *, ending: str | None) -> str:
    """Commit a step: checkpoint + cursor + lease release (+ the run's end, `ending`), fenced by the token.

    "lost": the token no longer holds the run (or the step is no longer live) and nothing was written;
    "finished": the run ended; "checkpointed": it goes on (or a pending cancel is settled next).
    """
    if ending is not None:
        op = RunOp.COMPLETE if ending == RunStatus.COMPLETED else RunOp.FINISH
        assert RUN_RULES[op].allows(ending), f"a run cannot end {ending!r}"
    params = {
        "run_id": claim.run_id,
        "token": claim.token,
        "cursor": claim.cursor + 1,
        "position": claim.cursor,
        "step_count": claim.step_count,
        "shift": clock.offset(),
        "done": StepStatus.DONE.value,
        "ending": ending,
        "step_pk": step.pk,
        "result": _jsonb(stored.inline),
        # A run that compensated ends cancelled or failed: it has no output.
        "output": None if claim.finish_as else _jsonb(stored.public_value),
        "ref": stored.ref,
        "sha": stored.sha256,
        "attempts": claim.attempt,
        "started": claim.claimed_at,
    }
    with connection.cursor() as cursor:
        cursor.execute(_commit_sql(ending is not None), params)
        row = cursor.fetchone()
    if row is None:
        return "lost"
    return "finished" if row[0] else "checkpointed"


def _jsonb(value: Any) -> str | None:
    # None stays SQL NULL, as the ORM stores it for a nullable JSONField.
    return None if value is None else json.dumps(value, cls=DjangoJSONEncoder)
