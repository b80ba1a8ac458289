"""The statements of a step's work between its claim and its commit, on Postgres: what a model turn writes, each in one
statement (hotpath.py has the claim and the commit, and an effect's start and outcome: they write statuses).

* `journal_turn`: a billed answer journaled — its Turn, its usage on the run and the step, the step's conversation
  head frozen with its first call — fenced by the lease token;
* `write_tool_results`: the tool results of a turn, fenced by the lease, which the same statement proves and extends
  (the model call that follows needs no proof of its own);
* `step_journal`: what an agent step reads as it starts: its context, its frozen head, its last turn's index.

Each is one round trip and, in autocommit, one transaction, written once per process and sent through
statements.cursor() (prepared on the server where the connection allows it). Each writes exactly what the ORM path
it replaces writes, under the same fence; the ORM path stays for SQLite and for the rarer cases (a batched answer,
a refusal, a compaction). Time is the database's (`STATEMENT_TIMESTAMP()` plus the tests'
clock shift).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from django.db import connection

from durable_agents import clock
from durable_agents.engine import statements
from durable_agents.engine.lease import Claim, Spent, proof_params, proving_update, spent
from durable_agents.models import Run, Step, Turn

NOW = "(STATEMENT_TIMESTAMP() + %(shift)s)"
COUNTERS = ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")


def is_available() -> bool:
    return connection.vendor == "postgresql"


def _table(model: Any) -> str:
    return connection.ops.quote_name(model._meta.db_table)


# A journaled turn's columns besides its run (the fenced row's id) and created_at (the database's default).
TURN_COLUMNS = (
    "step_id", "index", "purpose", "request_digest", "content", "stop_reason", "stop_details", "model", "participant",
    "request_id", "cost_usd", *COUNTERS,
)  # fmt: skip


@cache
def _journal_sql() -> str:
    added = ", ".join(f"{c} = {c} + %({c})s" for c in COUNTERS)
    quote = connection.ops.quote_name
    columns = ", ".join(quote(c) for c in ("run_id", *TURN_COLUMNS))
    values = ", ".join("%(stop_details)s::jsonb" if c == "stop_details" else f"%({c})s" for c in TURN_COLUMNS)
    # The run row first (its lock orders this against a takeover), then the step and the turn only if it was fenced.
    # Progress resets the run's attempt count, so a long agent is not failed for retries spread over hours. The head
    # is frozen only by the first journaled call: a head already there (a racing zombie's is fenced out) stays.
    return f"""
        WITH fenced AS (
            UPDATE {_table(Run)}
               SET attempt = 1, updated_at = {NOW}, cost_usd = cost_usd + %(cost_usd)s, {added}
             WHERE id = %(run_id)s AND lease_token = %(token)s
         RETURNING id
        ), step AS (
            UPDATE {_table(Step)}
               SET cost_usd = cost_usd + %(cost_usd)s, {added},
                   frozen_request = CASE WHEN frozen_request IS NULL THEN %(head)s ELSE frozen_request END
             WHERE id = %(step_id)s AND EXISTS (SELECT 1 FROM fenced)
         RETURNING id
        )
        INSERT INTO {_table(Turn)} ({columns})
        SELECT fenced.id, {values} FROM fenced
        RETURNING id, created_at
    """


def journal_turn(run_id: Any, token: int, step_pk: int, fields: dict[str, Any], head: Any) -> Turn | None:
    """Journal an answer: its Turn (`fields`: TURN_COLUMNS but the step), its usage added to the run and the step, and
    the step's head frozen if it has none (`head`: None to leave it) — iff `token` still holds run `run_id`. The Turn,
    or None if the lease was lost and nothing was written. A turn already journaled at its index (by another worker)
    raises IntegrityError, nothing written."""
    content = Turn._meta.get_field("content")
    params = {
        **fields,
        "run_id": run_id,
        "token": token,
        "step_id": step_pk,
        "shift": clock.offset(),
        "content": content.get_db_prep_value(fields["content"], connection),
        "stop_details": None if fields["stop_details"] is None else json.dumps(fields["stop_details"]),
        "head": None if head is None else Step._meta.get_field("frozen_request").get_db_prep_value(head, connection),
    }
    with statements.cursor() as cursor:
        cursor.execute(_journal_sql(), params)
        row = cursor.fetchone()
    if row is None:
        return None
    return Turn(id=row[0], run_id=run_id, step_id=step_pk, created_at=row[1], tool_results=None, **fields)


@cache
def _tool_results_sql() -> str:
    # The run row first, as prove_lease updates it (its lock orders this against a takeover), then the turn only if
    # the lease held: a zombie writes nothing. The spend comes back as prove_lease reads it. A turn that has its
    # results already is not written, and the lease is not extended for it either: nothing comes back.
    return f"""
        WITH proven AS (
            {proving_update(f"AND EXISTS (SELECT 1 FROM {_table(Turn)} WHERE id = %(id)s AND tool_results IS NULL)")}
        ), written AS (
            UPDATE {_table(Turn)} SET tool_results = %(results)s
             WHERE id = %(id)s AND tool_results IS NULL AND EXISTS (SELECT 1 FROM proven)
         RETURNING id
        )
        SELECT proven.* FROM proven, written
    """


def write_tool_results(turn_pk: int, results: list[Any], claim: Claim) -> Spent | None:
    """Store a turn's tool results iff none are stored and `claim` still holds its run, proving and extending the
    lease in the same statement (as prove_lease does); the run's spend as that statement read it, or None if nothing
    was written (the lease was lost, or the turn had its results) and the lease left as it was. (A transaction
    writing the same turn's results meanwhile, which only this lease's holder does, would leave it extended.)"""
    params = {
        "id": turn_pk,
        "results": Turn._meta.get_field("tool_results").get_db_prep_value(results, connection),
        **proof_params(claim),
    }
    with statements.cursor() as cursor:
        cursor.execute(_tool_results_sql(), params)
        row = cursor.fetchone()
    return None if row is None else spent(row)


@cache
def _step_journal_sql() -> str:
    return f"""
        SELECT s.context, s.frozen_request, (SELECT MAX(t."index") FROM {_table(Turn)} t WHERE t.step_id = s.id)
          FROM {_table(Step)} s WHERE s.id = %(id)s
    """


def step_journal(step_pk: int) -> tuple[Any, Any, int | None] | None:
    """An agent step's context and frozen head (decoded as the ORM decodes them) and the index of its last journaled
    turn (None: none yet); None if the step is gone."""
    with statements.cursor() as cursor:
        cursor.execute(_step_journal_sql(), {"id": step_pk})
        row = cursor.fetchone()
    if row is None:
        return None
    context, frozen, last = row
    decode = Step._meta.get_field("context").from_db_value
    frozen_field = Step._meta.get_field("frozen_request")
    return decode(context, None, connection), frozen_field.from_db_value(frozen, None, connection), last
