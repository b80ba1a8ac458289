"""The step loop's statements: the claim (with the step's load, on Postgres), the checkpoint commit, and on an
eager slice both at once (the commit of one step and the claim and load of the next: `commit_and_claim`); and an
external effect's, on Postgres: its outbox row with the lease proof (`start_effect`) and its outcome (`applied`).

Only `transitions.py` calls this module: it is the fast implementation of two of its operations, built from
the same rules (`states.RUN_RULES`). Each statement is one round trip and, in autocommit, one transaction:
no BEGIN/COMMIT trips, no ORM query compilation per step. Time is the database's (`STATEMENT_TIMESTAMP()`,
plus the tests' clock shift), never the worker's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, connection, connections
from django.db.models import DEFERRED

from durable_agents import clock
from durable_agents.engine import statements
from durable_agents.engine.lease import Claim
from durable_agents.engine.payloads import StoredResult
from durable_agents.engine.wake import MODEL_BOUND_KINDS
from durable_agents.models import Effect, EffectKind, EffectStatus, Run, Step
from durable_agents.states import EFFECT_RULES, RUN_RULES, STEP_RULES, EffectOp, RunOp, RunStatus, StepOp, StepStatus


def _in_model_order(model: Any, names: set[str]) -> tuple[str, ...]:
    # Model.from_db matches values to fields in the model's field order, whatever order names are given in.
    return tuple(f.attname for f in model._meta.concrete_fields if f.attname in names)


# The run and step fields a step needs; the rest stay deferred (loaded on first access, if ever).
RUN_FIELDS = _in_model_order(
    Run,
    {
        "id",
        "workflow",
        "workflow_version",
        "input",
        "participant",
        "effect_scope",
        "parent_id",
        "concurrency_key",
        "replay_lane",
        "trace_context",
    },
)
STEP_FIELDS = _in_model_order(
    Step, {"id", "run_id", "step_id", "name", "position", "kind", "status", "args", "depends_on", "fresh_for"}
)
CLAIM_RETURNS = (
    "lease_token, cursor, step_count, attempt, previous_lease_owner, finish_as, previous_claimed_at, "
    "previous_lease_expires_at"
)


@cache
def is_available() -> bool:
    # The default database's backend, which a process does not change.
    return connection.vendor == "postgresql"


def _clock() -> tuple[str, str]:
    # Postgres: the database's time in the statement. SQLite (in this process): the time as parameters.
    if is_available():
        return "(STATEMENT_TIMESTAMP() + %(shift)s)", "(STATEMENT_TIMESTAMP() + %(shift)s + %(lease)s)"
    return "%(now)s", "%(expires)s"


# What a commit writes to the run besides its cursor: the lease released. A claim in the same statement as the
# commit (commit_and_claim) reads these columns as the commit left them, as a claim after it would.
RELEASED_ROW = {"lease_owner": "''", "lease_expires_at": "NULL", "attempt": "0"}


def _live(alias: str = "") -> str:
    """A live (not superseded) step of `alias`, the status written out: a partial index serves a prepared statement's
    generic plan only where its predicate follows from the query's text (durable_step_run_position_uniq's from this;
    from `status <> $1` nothing, and a run's step was then found among all of the run's steps)."""
    column = f"{alias}.status" if alias else "status"
    return f"{column} <> '{StepStatus.SUPERSEDED.value}'"


def _claim_sets(now: str, expires: str, row: Mapping[str, str]) -> dict[str, str]:
    """What a claim writes, column by column, from the run's row as `row` has it (absent: the column itself)."""

    def was(column: str) -> str:
        return row.get(column, column)

    # The previous holder's claim and expiry are kept by this same statement: a takeover draws its attempt.
    return {
        "status": "%(running)s",
        "previous_lease_owner": was("lease_owner"),
        "lease_owner": "%(owner)s",
        "previous_claimed_at": was("claimed_at"),
        "previous_lease_expires_at": was("lease_expires_at"),
        "claimed_at": now,
        "lease_token": f"{was('lease_token')} + 1",
        "lease_expires_at": expires,
        "attempt": f"{was('attempt')} + 1",
        "started_at": f"COALESCE({was('started_at')}, {now})",
        "wake_at": "NULL",
    }


def _status_in(sources: frozenset[str]) -> str:
    """`status IN (sources)`, for a statement that names its run by id, written as an expression no index of the run
    table matches, so the planner always takes the row by its primary key.

    Written plainly, it let the planner scan the status index (or a partial index on status) for every run in
    those statuses when the table's statistics said there were few — a young table, statistics not refreshed since
    runs piled up — and a prepared statement keeps its plan: a lookup per step that grew with the runs in flight
    (bench/agent_scale.py read 636 index entries per commit at 1,000 conversations).
    """
    listed = ", ".join(f"'{s}'" for s in sorted(sources))
    return f"(status || '') IN ({listed})"


def _claimable(now: str, row: Mapping[str, str]) -> str:
    """When a run may be claimed: runnable, no cancel requested, its lease free, due, admitted if it has a
    concurrency key (engine/admission.py) (`row` as for _claim_sets)."""
    expiry = row.get("lease_expires_at", "lease_expires_at")
    return (
        f"{_status_in(RUN_RULES[RunOp.CLAIM].sources)} AND cancel_requested_at IS NULL"
        f" AND ({expiry} IS NULL OR {expiry} < {now}) AND (wake_at IS NULL OR wake_at <= {now})"
        " AND (concurrency_key IS NULL OR admitted_at IS NOT NULL)"
    )


def _claim_update_sql(target: str = "%(id)s", served: str = "") -> str:
    """The claim's UPDATE of the run `target` (an SQL expression of its id), if claimable (and `served`)."""
    now, expires = _clock()
    sets = ", ".join(f"{column} = {value}" for column, value in _claim_sets(now, expires, {}).items())
    return f"""
        UPDATE {connection.ops.quote_name(Run._meta.db_table)} SET {sets}
         WHERE id = {target} AND {_claimable(now, {})}{f" AND {served}" if served else ""}
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


def _load_sql(stale: str, first: str = "") -> str:
    """The claimed run (`c`) with its step under the cursor, as this statement's snapshot has them; `stale`: the
    plan may have changed under the claim's row lock; `first`: columns before these."""
    step = Step._meta.db_table
    run_cols = ", ".join(f"c.{name}" for name in RUN_FIELDS[1:])
    step_cols = ", ".join(f"s.{name}" for name in STEP_FIELDS)
    return f"""
        SELECT {first}{", ".join(f"c.{col}" for col in CLAIM_RETURNS.split(", "))}, c.claimed_at,
               {stale} AS stale, {run_cols}, {step_cols}
          FROM c JOIN {Run._meta.db_table} seen ON seen.id = c.id
          LEFT JOIN {step} s ON s.run_id = c.id AND s.position = c.cursor AND {_live("s")}
    """


@cache
def _claim_and_load_sql(model_bound: bool = False) -> str:
    # `seen` is the run as this statement's snapshot has it; `c` the row the claim updated. A claim that waited
    # for another transaction's row lock updates the row that transaction committed, but the join still reads
    # the plan as it was before: a differing updated_at says the plan may have changed (a saga planned, a
    # migration), and the step is then read again (`stale`).
    served = _model_bound() if model_bound else ""
    return f"""
        WITH c AS ({_claim_update_sql(served=served)} RETURNING *)
        {_load_sql("seen.updated_at IS DISTINCT FROM c.updated_at")}
    """


def _model_bound() -> str:
    """A run the model queue's worker serves (wake.queue_for): a replay run with a replay queue set
    (`replay_queue`) iff that queue is the model queue (`replay_here`), whatever its step; any other run iff its step
    under the cursor waits on the model."""
    run, step = Run._meta.db_table, Step._meta.db_table
    kind = f"""(SELECT kind FROM {step} k
                 WHERE k.run_id = {run}.id AND k.position = {run}.cursor AND {_live("k")})"""
    return (
        f"CASE WHEN %(replay_queue)s AND {run}.replay_lane <> '' THEN %(replay_here)s"
        f" ELSE {kind} = ANY(%(model_kinds)s) END"
    )


def claim_and_load(
    run_id: uuid.UUID,
    owner: str,
    lease: timedelta,
    *,
    model_bound: bool = False,
    replay_queue: bool = False,
    replay_here: bool = False,
) -> tuple[Claim, Step | None] | None:
    """Claim the run and read its current step with the run's input, in one statement (Postgres). `model_bound`: only
    a run the model queue's worker serves (`replay_queue`: replay runs have a queue of their own; `replay_here`: it is
    the model queue)."""
    params = {"id": run_id, **_claim_params(owner, lease)}
    if model_bound:
        params.update(model_kinds=sorted(MODEL_BOUND_KINDS), replay_queue=replay_queue, replay_here=replay_here)
    with statements.cursor() as cursor:
        cursor.execute(_claim_and_load_sql(model_bound), params)
        row = cursor.fetchone()
    return None if row is None else _loaded(run_id, owner, row)


def _claim_params(owner: str, lease: timedelta) -> dict[str, Any]:
    return {
        "owner": owner,
        "running": RunStatus.RUNNING.value,
        "shift": clock.offset(),
        "lease": lease,
    }


def _loaded(run_id: uuid.UUID, owner: str, row: Any) -> tuple[Claim, Step | None]:
    """The claim and its step from a row of `_load_sql`."""
    claimed = _claim_of(run_id, owner, row)
    width = len(CLAIM_RETURNS.split(", ")) + 2
    stale = row[width - 1]
    run_values = (run_id, *row[width : width + len(RUN_FIELDS) - 1])
    step_values = row[width + len(RUN_FIELDS) - 1 :]
    run = _instance(Run, RUN_FIELDS, run_values)
    if stale:
        # A fresh statement, a fresh snapshot: the plan as the transaction this claim waited for left it.
        step = Step.objects.live().filter(run_id=run_id, position=claimed.cursor).only(*STEP_FIELDS).first()
        if step is not None:
            step.run = run
        return claimed, step
    if step_values[0] is None:
        return claimed, None
    step = _instance(Step, STEP_FIELDS, step_values)
    step.run = run
    return claimed, step


def _instance(model: Any, names: tuple[str, ...], values: Sequence[Any]) -> Any:
    """The model instance of a raw row's `values` of the fields `names` (in the model's order), the rest deferred, as
    `Model.from_db` makes it; given every field's place, from_db skips its own matching of names to fields."""
    # Django loads jsonb as text and decodes it in JSONField.from_db_value; do the same for raw rows.
    db = connections[DEFAULT_DB_ALIAS]
    row, places = _row_layout(model, names)
    row = list(row)
    for (place, decode), value in zip(places, values, strict=True):
        row[place] = value if decode is None else decode(value, None, db)
    return model.from_db(DEFAULT_DB_ALIAS, None, row)


@cache
def _row_layout(
    model: Any, names: tuple[str, ...]
) -> tuple[tuple[Any, ...], tuple[tuple[int, Callable[..., Any] | None], ...]]:
    """A row of `model` with every field deferred, and each of `names`' place in it with its from_db_value (None for a
    field that takes the value as the database gives it)."""
    fields = model._meta.concrete_fields
    index = {field.attname: i for i, field in enumerate(fields)}
    return (
        (DEFERRED,) * len(fields),
        tuple((index[name], getattr(fields[index[name]], "from_db_value", None)) for name in names),
    )


def _held(sources: frozenset[str], also: str = "") -> str:
    """The commit's fence: the run's row, locked first, iff the claim still holds it at the step it claimed."""
    return f"""
        held AS (
            SELECT id{also} FROM {Run._meta.db_table}
             WHERE id = %(run_id)s AND lease_token = %(token)s
               AND cursor = %(position)s AND step_count = %(step_count)s
               AND {_status_in(sources)}
               FOR UPDATE
        )"""


def _step_done(now: str) -> str:
    """The step's checkpoint, written only under the fence: a step no longer live is not written."""
    step_sources = ", ".join(f"'{s}'" for s in sorted(STEP_RULES[StepOp.COMMIT].sources))
    return f"""
        done AS (
            UPDATE {Step._meta.db_table}
               SET status = %(done)s, result = %(result)s::jsonb, result_ref = %(ref)s, result_hash = %(sha)s,
                   error = NULL, attempts = %(attempts)s, started_at = %(started)s, finished_at = {now},
                   updated_at = {now}, observed_at = CASE WHEN fresh_for IS NULL THEN NULL ELSE %(started)s END
             WHERE id = %(step_pk)s AND status IN ({step_sources}) AND EXISTS (SELECT 1 FROM held)
         RETURNING id
        )"""


def _released() -> str:
    return ", ".join(f"{column} = {value}" for column, value in RELEASED_ROW.items())


@cache
def _commit_sql(ending: bool, claims_next: bool = False) -> str:
    run = Run._meta.db_table
    now = "(STATEMENT_TIMESTAMP() + %(shift)s)"
    run_sources = RUN_RULES[RunOp.COMPLETE if ending else RunOp.CHECKPOINT].sources
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
    update = f"""
        UPDATE {run}
           SET cursor = %(cursor)s, {_released()}, updated_at = {now}{finish}
         WHERE id IN (SELECT id FROM held) AND EXISTS (SELECT 1 FROM done)
     RETURNING {ends}"""
    if not claims_next:
        return f"WITH {_held(run_sources)}, {_step_done(now)} {update}"
    # And the claim and load of the batch's next run (`next_id`), made only once this commit is written (`f`):
    # the committed run's row is locked first, the next run's is taken only if no one holds its lock (SKIP
    # LOCKED: this statement never waits on a second row, so two batches in opposite orders cannot deadlock).
    # Not claimed — locked, not claimable, another queue's step — the next run is claimed by its own statement.
    step = Step._meta.db_table
    next_kind = f"""(SELECT kind FROM {step} k
                      WHERE k.run_id = {run}.id AND k.position = {run}.cursor AND {_live("k")})"""
    served = f"CASE WHEN {next_kind} = ANY(%(model_kinds)s) THEN %(model_ok)s ELSE %(plain_ok)s END"
    target = f"(SELECT id FROM {run} WHERE id = %(next_id)s AND EXISTS (SELECT 1 FROM f) FOR UPDATE SKIP LOCKED)"
    return f"""
        WITH {_held(run_sources)}, {_step_done(now)}, f AS ({update} AS ended),
        c AS ({_claim_update_sql(target, served)} RETURNING *)
        SELECT a.written, a.ended, l.*
          FROM (SELECT COUNT(*) > 0 AS written, BOOL_OR(ended) AS ended FROM f) a
          LEFT JOIN ({_load_sql("seen.updated_at IS DISTINCT FROM c.updated_at")}) l ON TRUE
    """


def commit_checkpoint(claim: Claim, step: Step, stored: StoredResult, *, ending: str | None) -> str:
    """Commit a step: checkpoint + cursor + lease release (+ the run's end, `ending`), fenced by the token.

    "lost": the token no longer holds the run (or the step is no longer live) and nothing was written;
    "finished": the run ended; "checkpointed": it goes on (or a pending cancel is settled next).
    """
    if ending is not None:
        op = RunOp.COMPLETE if ending == RunStatus.COMPLETED else RunOp.FINISH
        assert RUN_RULES[op].allows(ending), f"a run cannot end {ending!r}"
    params = _commit_params(claim, step, stored)
    # A run that compensated ends cancelled or failed: it has no output.
    params.update(ending=ending, output=_output(claim, stored, params["result"]))
    with statements.cursor() as cursor:
        cursor.execute(_commit_sql(ending is not None), params)
        row = cursor.fetchone()
    if row is None:
        return "lost"
    return "finished" if row[0] else "checkpointed"


def commit_and_claim_next(
    claim: Claim,
    step: Step,
    stored: StoredResult,
    ending: str,
    next_id: uuid.UUID,
    owner: str,
    lease: timedelta,
    *,
    model_bound: bool,
    plain: bool,
) -> tuple[str, tuple[Claim, Step | None] | None]:
    """Commit a run's last step as commit_checkpoint does (`ending`) and, in the same statement, claim run
    `next_id` — the next run of the caller's batch — as claim_and_load would right after, if the commit was
    written, the run is claimable, its row is not locked, and its step is one the caller runs (`model_bound`,
    `plain`). The commit's outcome ("lost": nothing written, no claim made), and the next run's claim or None."""
    assert RUN_RULES[RunOp.COMPLETE if ending == RunStatus.COMPLETED else RunOp.FINISH].allows(ending)
    committed = _commit_params(claim, step, stored)
    params = {
        **committed,
        **_claim_params(owner, lease),
        "ending": ending,
        "output": _output(claim, stored, committed["result"]),
        "next_id": next_id,
        "model_kinds": sorted(MODEL_BOUND_KINDS),
        "model_ok": model_bound,
        "plain_ok": plain,
    }
    with statements.cursor() as cursor:
        cursor.execute(_commit_sql(True, claims_next=True), params)
        row = cursor.fetchone()
    written, ended, loaded = row[0], row[1], row[2:]
    if not written:
        return "lost", None
    outcome = "finished" if ended else "checkpointed"
    return outcome, None if loaded[0] is None else _loaded(next_id, owner, loaded)


def _output(claim: Claim, stored: StoredResult, result: str | None) -> str | None:
    """The run's output if the step ends it (`result`: the step's result as the commit writes it): none for a run that
    compensated, which ends cancelled or failed."""
    if claim.finish_as:
        return None
    return result if not stored.ref else _jsonb(stored.public_value)


def _commit_params(claim: Claim, step: Step, stored: StoredResult) -> dict[str, Any]:
    return {
        "run_id": claim.run_id,
        "token": claim.token,
        "cursor": claim.cursor + 1,
        "position": claim.cursor,
        "step_count": claim.step_count,
        "shift": clock.offset(),
        "done": StepStatus.DONE.value,
        "step_pk": step.pk,
        "result": _jsonb(stored.inline),
        "ref": stored.ref,
        "sha": stored.sha256,
        "attempts": claim.attempt,
        "started": claim.claimed_at,
    }


@cache
def _commit_and_claim_sql() -> str:
    run, step = Run._meta.db_table, Step._meta.db_table
    now, expires = _clock()
    # One UPDATE of the run row (a statement cannot update a row twice): the commit's writes, and the claim's
    # over them where the claim is made, each claim write reading the row as the commit leaves it.
    claims = _claim_sets(now, expires, RELEASED_ROW)
    sets = ", ".join(
        f"{column} = CASE WHEN h.go THEN {value} ELSE {RELEASED_ROW.get(column, column)} END"
        for column, value in claims.items()
    )
    next_kind = f"(SELECT kind FROM {step} WHERE run_id = %(run_id)s AND position = %(cursor)s AND {_live()})"
    served = f"CASE WHEN {next_kind} = ANY(%(model_kinds)s) THEN %(model_ok)s ELSE %(plain_ok)s END"
    # `go` is decided under the row lock, on the row as the last transaction before it left it (a cancel
    # requested while the step ran is seen); `locked_at` is that row's updated_at, which differs from the
    # snapshot's (`seen`) if the plan may have changed meanwhile (claim_and_load's `stale`).
    fence = _held(
        RUN_RULES[RunOp.CHECKPOINT].sources,
        f", updated_at AS locked_at, {next_kind} AS next_kind, ({_claimable(now, RELEASED_ROW)}) AND {served} AS go",
    )
    return f"""
        WITH {fence}, {_step_done(now)},
        c AS (
            UPDATE {run} SET cursor = %(cursor)s, updated_at = {now}, {sets}
              FROM held h
             WHERE {run}.id = h.id AND EXISTS (SELECT 1 FROM done)
         RETURNING {run}.*, h.go, h.next_kind, h.locked_at
        )
        {_load_sql("seen.updated_at IS DISTINCT FROM c.locked_at", first="c.go, c.next_kind, ")}
    """


def commit_and_claim(
    claim: Claim, step: Step, stored: StoredResult, owner: str, lease: timedelta, *, model_bound: bool, plain: bool
) -> tuple[str, tuple[Claim, Step | None] | None, str | None]:
    """Commit a step that is not the run's last and, in the same statement, claim the run again for its next step
    (a new token, attempt 1, `owner`) with the rules of a claim after the commit — if its next step is
    one the caller runs (a model-bound one: `model_bound`; any other: `plain`).

    ("lost", None, None): as commit_checkpoint, nothing was written. ("checkpointed", claimed, kind): the
    checkpoint is written; `claimed` is the next step's claim and load as claim_and_load returns them, or None if
    no claim was made (the run is then as commit_checkpoint leaves it); `kind` is the next step's kind.
    """
    params = {
        **_commit_params(claim, step, stored),
        **_claim_params(owner, lease),
        "model_kinds": sorted(MODEL_BOUND_KINDS),
        "model_ok": model_bound,
        "plain_ok": plain,
    }
    with statements.cursor() as cursor:
        cursor.execute(_commit_and_claim_sql(), params)
        row = cursor.fetchone()
    if row is None:
        return "lost", None, None
    went, kind = row[0], row[1]
    return "checkpointed", _loaded(claim.run_id, owner, row[2:]) if went else None, kind


def _jsonb(value: Any) -> str | None:
    # None stays SQL NULL, as the ORM stores it for a nullable JSONField.
    return None if value is None else json.dumps(value, cls=DjangoJSONEncoder)


@cache
def _start_effect_sql() -> str:
    columns = "idempotency_key, run_id, step_id, kind, tool, args, args_hash, status, attempts, needs_attention"
    # The run's row lock (the lease proof) is taken first: a saga being planned holds it, so the two never interleave.
    return f"""
        WITH held AS (
            UPDATE {Run._meta.db_table} SET lease_expires_at = STATEMENT_TIMESTAMP() + %(lease)s
             WHERE id = %(run_id)s AND lease_token = %(token)s AND lease_owner = %(owner)s
               AND lease_expires_at IS NOT NULL AND {_status_in(frozenset({RunStatus.RUNNING.value}))}
         RETURNING id
        ), started AS (
            INSERT INTO {Effect._meta.db_table} ({columns})
            SELECT %(key)s, held.id, %(step_id)s, %(kind)s, %(tool)s, %(args)s::jsonb, %(args_hash)s, %(pending)s, 1, ''
              FROM held
            ON CONFLICT (idempotency_key) DO NOTHING
         RETURNING id
        )
        SELECT EXISTS (SELECT 1 FROM held), (SELECT id FROM started)
    """


def start_effect(
    claim: Claim, lease: timedelta, *, key: str, step_pk: int, tool: str, args: Any, args_hash: str
) -> tuple[bool, Effect | None]:
    """Prove and extend the lease (the run running, its token held) and, under it, write a new effect's outbox row
    already counted as invoked once — the call may be sent once this commits. (held, effect): held False: the lease
    was lost, nothing written; effect None: the key is already recorded (nothing written: look it up)."""
    params = {
        "run_id": claim.run_id,
        "token": claim.token,
        "owner": claim.owner,
        "lease": clock.offset(lease),
        "key": key,
        "step_id": step_pk,
        "kind": EffectKind.EFFECT.value,
        "tool": tool,
        "args": json.dumps(args),  # as the ORM stores a JSONField
        "args_hash": args_hash,
        "pending": EffectStatus.PENDING.value,
    }
    with statements.cursor() as cursor:
        cursor.execute(_start_effect_sql(), params)
        held, pk = cursor.fetchone()
    if not held or pk is None:
        return bool(held), None
    effect = Effect(
        id=pk,
        idempotency_key=key,
        run_id=claim.run_id,
        step_id=step_pk,
        kind=EffectKind.EFFECT,
        tool=tool,
        args=args,
        args_hash=args_hash,
        status=EffectStatus.PENDING,
        attempts=1,
    )
    return True, effect


@cache
def _applied_sql() -> str:
    now = "(STATEMENT_TIMESTAMP() + %(shift)s)"
    sources = ", ".join(f"'{s}'" for s in sorted(EFFECT_RULES[EffectOp.APPLY].sources))
    return f"""
        UPDATE {Effect._meta.db_table}
           SET status = %(applied)s, result = %(result)s::jsonb, error = NULL, needs_attention = '',
               applied_at = {now}, updated_at = {now}
         WHERE id = %(id)s AND status IN ({sources})
    """


def applied(effect_pk: int, result: Any) -> bool:
    """Record an effect (not a compensation) applied with `result`, as transitions.move_effect(APPLY) does; True if
    it moved."""
    params = {
        "id": effect_pk,
        "applied": EffectStatus.APPLIED.value,
        "result": None if result is None else json.dumps(result),
        "shift": clock.offset(),
    }
    with statements.cursor() as cursor:
        cursor.execute(_applied_sql(), params)
        return cursor.rowcount == 1
