"""Real run records for the growth and prune benches: driven once, then copied by the thousand in SQL.

Needs Django set up by the caller (the bench names its database first). `real_runs()` drives the example
project's refund_agent once per demo customer with the scripted participant, in this process, approving every
approval, so each row is one the engine wrote. `copy_runs()` copies them with INSERT ... SELECT: new run ids,
new step, turn, effect, reliance, wait and event ids, foreign keys remapped, effect keys made unique.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.db import connection, transaction
from django.db.models import Model

from durable_agents import api
from durable_agents.models import Effect, Event, Reliance, Run, Step, Turn, Wait
from durable_agents.testing import drive
from project.refunds.seed import CASES, seed_shop


def real_runs() -> list[uuid.UUID]:
    """One refund_agent run per demo customer, driven to its end in this process (approvals approved)."""
    seed_shop()
    ids = []
    for case in CASES:
        run = drive(api.start("refund_agent", case.run_input).id)
        for _ in range(5):
            wait = Wait.objects.filter(run=run, status="open").first()
            if wait is None:
                break
            api.decide(wait.id, True, by="bench")
            run = drive(run.id)
        ids.append(run.id)
    return ids


def _insert(cursor, model: type[Model], source: str, overrides: dict[str, str]) -> None:
    """INSERT INTO model's table every column, from `x.<column>` of `source` unless overridden."""
    quote = connection.ops.quote_name
    columns = [field.column for field in model._meta.concrete_fields]
    values = [overrides.get(column, f"x.{quote(column)}") for column in columns]
    cursor.execute(
        f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(map(quote, columns))}) "
        f"SELECT {', '.join(values)} {source}"
    )


def _id_map(cursor, name: str, model: type[Model], runs: str = "m") -> None:
    """A temp table `name` (src, dst, run): a new id for each row of `model` in each copy of its run."""
    table = model._meta.db_table
    cursor.execute(
        f"CREATE TEMP TABLE {name} ON COMMIT DROP AS SELECT x.id AS src, "
        f"nextval(pg_get_serial_sequence('{table}', 'id')) AS dst, {runs}.dst AS run "
        f"FROM {table} x JOIN {runs} ON x.run_id = {runs}.src"
    )
    cursor.execute(f"CREATE INDEX ON {name} (src, run)")


def copy_runs(
    templates: list[uuid.UUID], copies: int, *, status: str | None = None, age: timedelta | None = None
) -> None:
    """`copies` copies of each template run (all its rows), in one transaction; `status` and `age` (since their
    last change, on the database's clock) override the copies'."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE m ON COMMIT DROP AS SELECT t.src::uuid AS src, gen_random_uuid() AS dst "
            "FROM unnest(%s::uuid[]) t(src), generate_series(1, %s)",
            [[str(t) for t in templates], copies],
        )
        run_overrides = {"id": "m.dst", "idempotency_key": "NULL", "forked_from_id": "NULL"}
        if status:
            run_overrides["status"] = f"'{status}'"
        if age:
            seconds = int(age.total_seconds())
            when = f"(STATEMENT_TIMESTAMP() - interval '{seconds} seconds')"
            run_overrides.update(created_at=when, updated_at=when, finished_at=when)
        _insert(cursor, Run, "FROM durable_agents_run x JOIN m ON x.id = m.src", run_overrides)
        _id_map(cursor, "sm", Step)
        _insert(
            cursor, Step, "FROM durable_agents_step x JOIN sm ON x.id = sm.src", {"id": "sm.dst", "run_id": "sm.run"}
        )
        _insert(
            cursor,
            Turn,
            "FROM durable_agents_turn x JOIN sm ON x.step_id = sm.src",
            {
                "id": f"nextval(pg_get_serial_sequence('{Turn._meta.db_table}', 'id'))",
                "run_id": "sm.run",
                "step_id": "sm.dst",
            },
        )
        _id_map(cursor, "em", Effect)
        _insert(
            cursor,
            Effect,
            "FROM durable_agents_effect x JOIN em ON x.id = em.src "
            "LEFT JOIN sm ON sm.src = x.step_id AND sm.run = em.run",
            {
                "id": "em.dst",
                "run_id": "em.run",
                "step_id": "sm.dst",
                "compensates_id": "NULL",
                "idempotency_key": "x.idempotency_key || ':' || em.dst",
            },
        )
        _insert(
            cursor,
            Reliance,
            "FROM durable_agents_reliance x JOIN m ON x.run_id = m.src JOIN em ON em.src = x.effect_id AND "
            "em.run = m.dst JOIN sm ON sm.src = x.step_id AND sm.run = m.dst",
            {
                "id": f"nextval(pg_get_serial_sequence('{Reliance._meta.db_table}', 'id'))",
                "run_id": "m.dst",
                "effect_id": "em.dst",
                "step_id": "sm.dst",
            },
        )
        _insert(
            cursor,
            Wait,
            "FROM durable_agents_wait x JOIN m ON x.run_id = m.src "
            "LEFT JOIN sm ON sm.src = x.step_id AND sm.run = m.dst",
            {
                "id": f"nextval(pg_get_serial_sequence('{Wait._meta.db_table}', 'id'))",
                "run_id": "m.dst",
                "step_id": "sm.dst",
            },
        )
        _insert(
            cursor,
            Event,
            "FROM durable_agents_event x JOIN m ON x.run_id = m.src",
            {"id": f"nextval(pg_get_serial_sequence('{Event._meta.db_table}', 'id'))", "run_id": "m.dst"},
        )
