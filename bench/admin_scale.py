"""The operator console at a million runs: server time and query count of the run list with its overview,
unfiltered and under every list filter (each status, stuck, each workflow, aging, error type, overdue
waits, version drift, the date hierarchy, search by id prefix, by key and by search attribute, a deep page), of
run pages, and of a /metrics scrape. The goal for every list page: at most 15 queries and 300 ms of server time.

    python bench/admin_scale.py [--runs 1000000] [--reseed] [--repeat 5]

Seeds a database of its own (BENCH_DATABASE_URL, default
postgres://postgres@127.0.0.1:5432/durable_admin_scale) with INSERT ... SELECT generate_series: a mix of
completed, failed (with errors), cancelled, running (some with expired leases), pending and waiting runs
(with open waits, some past their deadline), 3 steps per run, retry events for failed runs, one
long-history run. A later invocation reuses it when it already holds that many runs. Requests go through
Django's test client in this process, so "server time" is the whole request: middleware, admin, queries
and template rendering. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from decimal import Decimal
from typing import Any

try:
    from bench._setup import configure
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import configure

DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/durable_admin_scale")
DB_NAME = DATABASE_URL.rsplit("/", 1)[-1]
ROOT = configure(DB_NAME, DATABASE_URL=DATABASE_URL)  # its database is kept between runs (prepare_database)
GOAL_QUERIES, GOAL_MS = 15, 300.0
WORKFLOWS = ["noop", "refund_agent", "billing", "onboarding", "report"]
ERROR_TYPES = ["ValueError", "BudgetExceededError", "ModelRequestError", "EffectOutcomeUnknownError"]
LONG_STEPS = 2000


def psql(sql: str, database: str = "postgres") -> str:
    result = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-d", database, "-tAqc", sql],
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout.strip()


def prepare_database(reseed: bool) -> None:
    exists = psql(f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'") == "1"
    if reseed and exists:
        psql(f"DROP DATABASE {DB_NAME}")
        exists = False
    if not exists:
        psql(f"CREATE DATABASE {DB_NAME}")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--reseed", action="store_true", help="drop and seed the database again")
    parser.add_argument("--repeat", type=int, default=5, help="timed requests per page (after one warm-up)")
    args = parser.parse_args()
    prepare_database(args.reseed)

    import django

    django.setup()

    from django.db import connection

    from durable_agents.models import Run

    have = Run.objects.count() if not args.reseed else 0
    if have != args.runs + 1:
        if have:
            print(f"{DB_NAME} holds {have:,} runs, not {args.runs + 1:,}: run with --reseed")
            return
        seed(args.runs)
    else:
        print(f"reusing {DB_NAME}: {have:,} runs")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_size_pretty(pg_database_size(current_database()))")
        print(f"database size: {cursor.fetchone()[0]}")
    refresh_clock()
    measure(args.repeat)


def _insert_select(model, expressions: dict[str, str], source: str) -> str:
    """INSERT INTO <model> (every column) SELECT <expression or the field's default> FROM <source>.

    Columns without an expression get their field's default as a literal, so new fields need no change here.
    """
    from django.db import connection
    from django.db.models import JSONField
    from django.db.models.fields import AutoFieldMixin

    columns, values = [], []
    for field in model._meta.concrete_fields:
        if isinstance(field, AutoFieldMixin):
            continue  # the sequence numbers it
        columns.append(connection.ops.quote_name(field.column))
        if field.column in expressions:
            values.append(expressions[field.column])
            continue
        default = field.get_default()
        if isinstance(field, JSONField):
            values.append("'" + json.dumps(default).replace("'", "''") + "'::jsonb")
        elif default is None:
            values.append("NULL")
        elif isinstance(default, bool):
            values.append("TRUE" if default else "FALSE")
        elif isinstance(default, int | float | Decimal):
            values.append(str(default))
        else:
            values.append("'" + str(default).replace("'", "''") + "'")
    return (
        f"INSERT INTO {connection.ops.quote_name(model._meta.db_table)} ({', '.join(columns)}) "
        f"SELECT {', '.join(values)} FROM {source}"
    )


def seed(runs: int) -> None:
    from django.db import connection

    from durable_agents.models import Event, Run, Step, Wait

    began = time.perf_counter()
    # i % 1000 decides the status: 90% completed, 5% failed, 2% cancelled, 1% each running, pending, waiting.
    # One running run in 20 lost its worker (expired lease) and one pending run in 20 never progressed:
    # 1,000 stuck runs in all, marked {"stuck": true} in their input so refresh_clock() leaves them stuck.
    bucket = "(i % 1000)"
    status = (
        f"CASE WHEN {bucket} < 900 THEN 'completed' WHEN {bucket} < 950 THEN 'failed' "
        f"WHEN {bucket} < 970 THEN 'cancelled' WHEN {bucket} < 980 THEN 'running' "
        f"WHEN {bucket} < 990 THEN 'pending' ELSE 'waiting' END"
    )
    stuck = f"({bucket} IN (970, 980) AND (i / 1000) % 2 = 0)"
    created = f"now() - ((i::float8 / {runs}) * interval '90 days') - interval '10 minutes'"
    finished = f"{bucket} < 970"
    run_sql = _insert_select(
        Run,
        {
            "id": "md5(i::text)::uuid",
            "workflow": f"(ARRAY{WORKFLOWS!r})[1 + i % {len(WORKFLOWS)}]",
            "workflow_version": "1 + (i % 7 = 0)::int",
            "status": status,
            "input": "jsonb_build_object('order_id', 'A-' || i) "
            f"|| CASE WHEN {stuck} THEN '{{\"stuck\": true}}'::jsonb ELSE '{{}}'::jsonb END",
            "input_hash": "md5(i::text)",
            "output": f"CASE WHEN {bucket} < 900 THEN jsonb_build_object('ok', true) END",
            "error": f"CASE WHEN {bucket} BETWEEN 900 AND 949 THEN jsonb_build_object("
            f"'type', (ARRAY{ERROR_TYPES!r})[1 + (i / 1000) % {len(ERROR_TYPES)}], "
            "'message', 'step failed permanently', 'step', 'step-2') END",
            "idempotency_key": "CASE WHEN i % 10 = 0 THEN 'order-' || i END",
            # Search attributes: every run's order number (unique) and one of 1,000 customers (1,000 runs each).
            "search": "jsonb_build_object('order_id', 'A-' || i, 'customer', 'c-' || (i % 1000))",
            "cursor": f"CASE WHEN {bucket} < 900 THEN 3 WHEN {finished} THEN 1 ELSE i % 3 END",
            "step_count": "3",
            "attempt": f"CASE WHEN {bucket} BETWEEN 900 AND 949 THEN 3 ELSE 0 END",
            "lease_owner": f"CASE WHEN {bucket} BETWEEN 970 AND 979 THEN 'worker-' || (i % 16) ELSE '' END",
            "lease_token": "1 + i % 5",
            "lease_expires_at": f"CASE WHEN {bucket} BETWEEN 970 AND 979 THEN now() - interval '5 minutes' END",
            "input_tokens": "(i % 5000) * 3",
            "output_tokens": "(i % 700)",
            "cost_usd": "((i % 5000) * 3 * 3 + (i % 700) * 15) / 1000000.0",
            "created_at": created,
            "updated_at": f"{created} + CASE WHEN {finished} THEN interval '40 seconds' ELSE interval '20 seconds' END",
            "started_at": f"{created} + interval '1 second'",
            "finished_at": f"CASE WHEN {finished} THEN {created} + interval '40 seconds' END",
        },
        f"generate_series(1, {runs}) AS i",
    )
    step_status = (
        "CASE WHEN r.status = 'completed' OR p < r.cursor THEN 'done' "
        "WHEN r.status = 'failed' AND p = r.cursor THEN 'failed' "
        "WHEN r.status = 'running' AND p = r.cursor THEN 'running' "
        "WHEN r.status = 'waiting' AND p = r.cursor THEN 'waiting' ELSE 'pending' END"
    )
    step_sql = _insert_select(
        Step,
        {
            "run_id": "r.id",
            "step_id": "'step-' || (p + 1)",
            "name": "'step-' || (p + 1)",
            "position": "p",
            "kind": "CASE WHEN p = 1 AND r.workflow = 'refund_agent' THEN 'agent' ELSE 'call' END",
            "status": step_status,
            "result": "CASE WHEN p < r.cursor THEN jsonb_build_object('step', p + 1) END",
            "error": "CASE WHEN r.status = 'failed' AND p = r.cursor THEN r.error END",
            "attempts": "CASE WHEN p <= r.cursor THEN 1 ELSE 0 END",
            "created_at": "r.created_at",
            "updated_at": "r.updated_at",
            "started_at": "CASE WHEN p <= r.cursor THEN r.created_at + (p * 10 + 1) * interval '1 second' END",
            "finished_at": "CASE WHEN p < r.cursor THEN r.created_at + (p * 10 + 9) * interval '1 second' END",
        },
        f"{Run._meta.db_table} r CROSS JOIN generate_series(0, 2) AS p",
    )
    event_sql = _insert_select(
        Event,
        {
            "run_id": "r.id",
            "step_id": "'step-2'",
            "kind": "'step_retry'",
            "detail": "jsonb_build_object('attempt', a, 'delay_seconds', 0.5 * a, 'error', r.error)",
            "created_at": "r.created_at + (10 + a) * interval '1 second'",
        },
        f"{Run._meta.db_table} r CROSS JOIN generate_series(1, 2) AS a WHERE r.status = 'failed'",
    )
    # Every waiting run waits on an approval; one in ten is past its deadline.
    wait_sql = _insert_select(
        Wait,
        {
            "run_id": "r.id",
            "step_id": "s.id",
            "kind": "'approval'",
            "status": "'open'",
            "name": "'approve'",
            "question": "'issue_refund'",
            "deadline": "CASE WHEN abs(hashtext(r.id::text)) % 10 = 0 THEN now() - interval '1 hour' "
            "ELSE now() + interval '2 days' END",
            "created_at": "r.updated_at",
            "updated_at": "r.updated_at",
        },
        f"{Run._meta.db_table} r JOIN {Step._meta.db_table} s ON s.run_id = r.id AND s.position = r.cursor "
        "WHERE r.status = 'waiting'",
    )
    with connection.cursor() as cursor:
        for label, sql in [("runs", run_sql), ("steps", step_sql), ("retry events", event_sql), ("waits", wait_sql)]:
            t = time.perf_counter()
            cursor.execute(sql)
            print(f"seeded {cursor.rowcount:>9,} {label} in {time.perf_counter() - t:.1f}s")
    seed_long_run()
    connection.cursor().execute("VACUUM ANALYZE")
    print(f"seeding took {time.perf_counter() - began:.0f}s")


def seed_long_run() -> None:
    """One run with a long history: 2,000 steps, 500 retries, 200 effects, 100 turns, stuck at step 1,500."""
    from datetime import timedelta

    from durable_agents import clock
    from durable_agents.models import Effect, Event, Run, Step, Turn

    now = clock.now()
    start = now - timedelta(hours=6)
    run = Run.objects.create(
        workflow="refund_agent",
        workflow_version=2,
        status="running",
        input={"order_id": "LONG"},
        input_hash="long",
        idempotency_key="long-history",
        cursor=1500,
        step_count=LONG_STEPS,
        lease_owner="worker-dead",
        lease_expires_at=now - timedelta(minutes=2),
        created_at=start,
        updated_at=now - timedelta(minutes=3),
        started_at=start,
    )
    steps = Step.objects.bulk_create(
        Step(
            run=run,
            step_id=f"step-{p + 1}",
            name="tick",
            position=p,
            kind="agent" if p % 10 == 0 else "call",
            status="done" if p < 1500 else ("running" if p == 1500 else "pending"),
            result={"step": p + 1} if p < 1500 else None,
            attempts=1 if p <= 1500 else 0,
            started_at=start + timedelta(seconds=10 * p) if p <= 1500 else None,
            finished_at=start + timedelta(seconds=10 * p + 8) if p < 1500 else None,
        )
        for p in range(LONG_STEPS)
    )
    Event.objects.bulk_create(
        Event(
            run=run,
            step_id=f"step-{p + 1}",
            kind="step_retry",
            detail={"attempt": 1, "error": {"type": "ModelUnavailableError", "message": "529 overloaded"}},
        )
        for p in range(0, 1500, 3)
    )
    Effect.objects.bulk_create(
        Effect(
            run=run,
            step=steps[p],
            idempotency_key=f"long-{p}",
            tool="charge",
            args={"amount": "1.00"},
            args_hash="x",
            status="applied" if p < 1490 else "pending",
        )
        for p in range(0, 1500, 7)
    )
    Turn.objects.bulk_create(
        Turn(
            run=run,
            step=steps[p],
            index=0,
            request_digest="d" * 64,
            content=[{"type": "text", "text": "Looking the order up. " * 30}],
            stop_reason="end_turn",
        )
        for p in range(0, 1500, 15)
    )


def refresh_clock() -> None:
    """Make the live runs live *now* (the database may have been seeded hours ago): running runs hold a
    fresh lease and progressed within the minute, pending ones were queued within five minutes.
    The runs seeded stuck stay stuck."""
    from django.db import connection

    from durable_agents.models import Run

    table = connection.ops.quote_name(Run._meta.db_table)
    jitter = "(abs(hashtext(id::text)) % {}) * interval '1 second'"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET updated_at = now() - {jitter.format(60)}, "
            "lease_expires_at = now() + interval '1 hour' WHERE status = 'running' AND NOT input ? 'stuck'"
        )
        cursor.execute(
            f"UPDATE {table} SET created_at = now() - {jitter.format(300)}, updated_at = now() - {jitter.format(300)} "
            "WHERE status = 'pending' AND NOT input ? 'stuck'"
        )
        cursor.execute(f"VACUUM ANALYZE {table}")


def list_pages() -> list[tuple[str, str]]:
    """The run list unfiltered and under every one of its filters, as an operator reaches them."""
    from durable_agents.admin.filters import AGING
    from durable_agents.models import Run, RunStatus

    failed = Run.objects.filter(status="failed").order_by("-created_at").first()
    keyed = Run.objects.filter(idempotency_key="order-500000").first() or failed
    day = failed.created_at
    base = "/admin/durable_agents/run/"
    return [
        ("run list + overview", base),
        *[(f"status={status}", f"{base}?status__exact={status}") for status in RunStatus.values],
        ("stuck", f"{base}?stuck=yes"),
        ("stuck + status=running", f"{base}?stuck=yes&status__exact=running"),
        *[(f"workflow={name}", f"{base}?workflow={name}") for name in WORKFLOWS],
        *[(f"aging {key}", f"{base}?aging={key}") for key in AGING],
        ("error type", f"{base}?error_type=BudgetExceededError"),
        ("waits past deadline", f"{base}?wait=overdue"),
        ("version drift", f"{base}?drift=yes"),
        ("date: a year", f"{base}?created_at__year={day.year}"),
        ("date: a month", f"{base}?created_at__year={day.year}&created_at__month={day.month}"),
        ("date: a day", f"{base}?created_at__year={day.year}&created_at__month={day.month}&created_at__day={day.day}"),
        ("search id prefix", f"{base}?q={str(failed.pk)[:8]}"),
        ("search key", f"{base}?q={keyed.idempotency_key}"),
        # Search attributes (GIN index): a value in any declared field, one field's value, a customer's 1,000
        # runs, and a value no run has.
        ("search value", f"{base}?q=A-500001"),
        ("search order_id:value", f"{base}?q=order_id:A-500001"),
        ("search customer:value", f"{base}?q=customer:c-7"),
        ("search no match", f"{base}?q=A-none"),
        ("page 100", f"{base}?p=100"),
    ]


def measure(repeat: int) -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    from durable_agents.models import Run

    user = User.objects.filter(username="bench-admin").first() or User.objects.create_superuser("bench-admin")
    client = Client(HTTP_HOST="localhost")
    client.force_login(user)
    failed = Run.objects.filter(status="failed").order_by("-created_at").first()
    long_run = Run.objects.get(idempotency_key="long-history")
    other_pages = [
        ("run page: failed run", f"/admin/durable_agents/run/{failed.pk}/change/"),
        ("run page: 2,000-step run", f"/admin/durable_agents/run/{long_run.pk}/change/"),
        ("metrics scrape", "/metrics"),
    ]
    # wall: the request as the browser waits for it (the "server time": the test client runs the whole
    # request in this process); python: this process's CPU (admin, templates); SQL: the database's time
    # as the driver saw it. On a busy machine wall > python + SQL.
    header = f"{'page':<30}{'wall ms':>9}{'max ms':>9}{'python ms':>11}{'SQL ms':>9}{'queries':>9}{'bytes':>10}"
    print(f"\nrun list (goal: <= {GOAL_QUERIES} queries and <= {GOAL_MS:.0f} ms median)")
    print(f"{header}  goal")
    misses = 0
    for label, url in list_pages():
        wall, count, line = measure_page(client, url, repeat)
        met = count <= GOAL_QUERIES and wall <= GOAL_MS
        misses += not met
        print(f"{label:<30}{line}  {'met' if met else 'MISSED'}")
    print(f"{'all list pages meet the goal' if not misses else f'{misses} list pages miss the goal'}\n")
    print(header)
    for label, url in other_pages:
        print(f"{label:<30}{measure_page(client, url, repeat)[2]}")


def measure_page(client: Any, url: str, repeat: int) -> tuple[float, int, str]:
    """(median wall ms, queries per request, the table's columns) over `repeat` requests after a warm-up."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    response = client.get(url)  # warm-up: templates compiled, connection open
    assert response.status_code == 200, (url, response.status_code)
    times, cpu, sql_ms, count = [], [], [], 0
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as queries:
            began, began_cpu = time.perf_counter(), time.process_time()
            response = client.get(url)
            times.append((time.perf_counter() - began) * 1000)
            cpu.append((time.process_time() - began_cpu) * 1000)
        count = len(queries)
        sql_ms.append(sum(float(q["time"]) for q in queries) * 1000)
    wall = statistics.median(times)
    line = (
        f"{wall:>9.1f}{max(times):>9.1f}{statistics.median(cpu):>11.1f}"
        f"{statistics.median(sql_ms):>9.1f}{count:>9}{len(response.content):>10,}"
    )
    return wall, count, line


if __name__ == "__main__":
    main()
