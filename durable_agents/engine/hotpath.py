"""The step loop's hot path as single Postgres statements: claim+load in one, checkpoint commit in one.

Each is one round trip and, in autocommit, one transaction: no BEGIN/COMMIT trips and no ORM query
compilation per step. Other databases take the ORM path in `advance.py`; both write the same rows.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection

from durable_agents.engine.lease import Claim
from durable_agents.engine.payloads import StoredResult
from durable_agents.models import Run, RunStatus, Step, StepStatus


def _in_model_order(model: Any, names: set[str]) -> tuple[str, ...]:
    # Model.from_db matches values to fields in the model's field order, whatever order names are given in.
    return tuple(f.attname for f in model._meta.concrete_fields if f.attname in names)


# The run and step fields a step needs; the rest stay deferred (loaded on first access, if ever).
RUN_FIELDS = _in_model_order(Run, {"id", "workflow", "workflow_version", "input", "participant", "effect_scope"})
STEP_FIELDS = _in_model_order(
    Step, {"id", "run_id", "step_id", "name", "position", "kind", "status", "args", "depends_on", "fresh_for"}
)


def is_available() -> bool:
    return connection.vendor == "postgresql"


@cache
def _claim_and_load_sql() -> str:
    run, step = Run._meta.db_table, Step._meta.db_table
    run_cols = ", ".join(f"c.{name}" for name in RUN_FIELDS[1:])
    step_cols = ", ".join(f"s.{name}" for name in STEP_FIELDS)
    return f"""
        WITH c AS (
            UPDATE {run}
               SET status = %(running)s, previous_lease_owner = lease_owner, lease_owner = %(owner)s,
                   lease_token = lease_token + 1, lease_expires_at = %(expires)s, attempt = attempt + 1,
                   started_at = COALESCE(started_at, %(now)s), wake_at = NULL
             WHERE id = %(id)s AND status IN (%(pending)s, %(running)s) AND cancel_requested_at IS NULL
               AND (lease_expires_at IS NULL OR lease_expires_at < %(now)s)
               AND (wake_at IS NULL OR wake_at <= %(now)s)
         RETURNING *
        )
        SELECT c.lease_token, c.cursor, c.step_count, c.attempt, c.previous_lease_owner, c.finish_as,
               {run_cols}, {step_cols}
          FROM c LEFT JOIN {step} s ON s.run_id = c.id AND s.position = c.cursor AND s.status <> %(superseded)s
    """


def claim_and_load(run_id: uuid.UUID, owner: str, now: datetime, lease: timedelta) -> tuple[Claim, Step | None] | None:
    """Claim the run (new fencing token) and read its current step with the run's input, in one statement."""
    params = {
        "id": run_id,
        "owner": owner,
        "now": now,
        "expires": now + lease,
        "running": RunStatus.RUNNING.value,
        "pending": RunStatus.PENDING.value,
        "superseded": StepStatus.SUPERSEDED.value,
    }
    with connection.cursor() as cursor:
        cursor.execute(_claim_and_load_sql(), params)
        row = cursor.fetchone()
    if row is None:
        return None
    token, position, step_count, attempt, previous_owner, finish_as = row[:6]
    claim = Claim(run_id, token, owner, position, step_count, attempt, previous_owner or "", finish_as or "")
    run_values = (run_id, *row[6 : 6 + len(RUN_FIELDS) - 1])
    step_values = row[6 + len(RUN_FIELDS) - 1 :]
    if step_values[0] is None:
        return claim, None
    run = Run.from_db(connection.alias, RUN_FIELDS, _decode(Run, RUN_FIELDS, run_values))
    step = Step.from_db(connection.alias, STEP_FIELDS, _decode(Step, STEP_FIELDS, step_values))
    step.run = run
    return claim, step


def _decode(model: Any, names: tuple[str, ...], values: tuple[Any, ...]) -> list[Any]:
    # Django loads jsonb as text and decodes it in JSONField.from_db_value; do the same for raw rows.
    out = []
    for name, value in zip(names, values, strict=True):
        field = model._meta.get_field(name)
        out.append(field.from_db_value(value, None, connection) if hasattr(field, "from_db_value") else value)
    return out


@cache
def _commit_sql(final: bool) -> str:
    run, step = Run._meta.db_table, Step._meta.db_table
    finish = ", status = %(final_status)s, output = %(output)s::jsonb, finished_at = %(now)s" if final else ""
    return f"""
        WITH r AS (
            UPDATE {run}
               SET cursor = %(cursor)s, attempt = 0, lease_owner = '', lease_expires_at = NULL,
                   updated_at = %(now)s{finish}
             WHERE id = %(run_id)s AND lease_token = %(token)s AND status = %(running)s
         RETURNING id
        )
        UPDATE {step}
           SET status = %(done)s, result = %(result)s::jsonb, result_ref = %(ref)s, result_hash = %(sha)s,
               error = NULL, attempts = %(attempts)s, started_at = %(started)s, finished_at = %(now)s,
               updated_at = %(now)s, observed_at = CASE WHEN fresh_for IS NULL THEN NULL ELSE %(started)s END
         WHERE id = %(step_pk)s AND EXISTS (SELECT 1 FROM r)
     RETURNING id
    """


def commit_checkpoint(
    claim: Claim, step: Step, stored: StoredResult, started: datetime, now: datetime, *, final: bool
) -> bool:
    """Commit a step: checkpoint + cursor + lease release (+ completion if `final`), fenced by the token.

    False means the token no longer holds the run: this worker is a zombie and nothing was written.
    """
    params = {
        "run_id": claim.run_id,
        "token": claim.token,
        "cursor": claim.cursor + 1,
        "now": now,
        "running": RunStatus.RUNNING.value,
        "done": StepStatus.DONE.value,
        "final_status": claim.finish_as or RunStatus.COMPLETED.value,
        "step_pk": step.pk,
        "result": _jsonb(stored.inline),
        # A run that compensated ends cancelled or failed: it has no output.
        "output": None if claim.finish_as else _jsonb(stored.public_value),
        "ref": stored.ref,
        "sha": stored.sha256,
        "attempts": claim.attempt,
        "started": started,
    }
    with connection.cursor() as cursor:
        cursor.execute(_commit_sql(final), params)
        return cursor.fetchone() is not None


def _jsonb(value: Any) -> str | None:
    # None stays SQL NULL, as the ORM stores it for a nullable JSONField.
    return None if value is None else json.dumps(value, cls=DjangoJSONEncoder)
