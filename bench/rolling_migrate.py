"""A rolling deploy's migration beside the previous release's starts: how long each start waits while `migrate` runs.

    python bench/rolling_migrate.py [--runs 1000000] [--from 0013_rate_buckets] [--rev REV] [--reuse]

Seeds --runs runs into a database migrated to --from (the schema of the code still running), then, for each of two
sets of migrations — the ones of git revision --rev (default: the commit before the newest migration was added) and
this checkout's — copies that database and migrates the copy to the newest migration while one connection starts
runs one after another as the code of --from does (a raw INSERT naming only the columns it knows). Prints, per set:
the time `migrate` took, the starts made, how many failed (and why), and the p50, p99 and longest wait of a start.
Asserts nothing. BENCH_DATABASE names the seeded database (dropped and created; kept, with --reuse, for a later run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB_NAME = os.environ.get("BENCH_DATABASE", "durable_rolling_bench")
os.environ.update(
    DJANGO_SETTINGS_MODULE="tests.settings",
    DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{DB_NAME}",
    CELERY_BROKER_URL="memory://",
)

import django  # noqa: E402

django.setup()

import psycopg  # noqa: E402
from django.db import connections  # noqa: E402
from django.db.migrations.executor import MigrationExecutor  # noqa: E402
from django.test import override_settings  # noqa: E402

APP = "durable_agents"
SERVER = "host=127.0.0.1 user=postgres dbname=postgres"


def admin(sql: str) -> None:
    with psycopg.connect(SERVER, autocommit=True) as connection:
        connection.execute(sql)


def use(name: str) -> None:
    """Point Django's default connection at database `name`."""
    connections["default"].close()
    connections["default"].settings_dict["NAME"] = name


def seed(runs: int, start: str) -> None:
    admin(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
    admin(f'CREATE DATABASE "{DB_NAME}"')
    use(DB_NAME)
    MigrationExecutor(connections["default"]).migrate([(APP, start)])
    columns = run_columns(start)
    with connections["default"].cursor() as cursor:
        cursor.execute(
            'INSERT INTO durable_agents_run (id, workflow, workflow_version, status, input, input_hash, "cursor", '
            "step_count, attempt, lease_owner, lease_token, previous_lease_owner, input_tokens, output_tokens, "
            "cache_write_tokens, cache_read_tokens, cost_usd, cancel_reason, cancel_compensate, finish_as, "
            "participant, effect_scope) "
            "SELECT gen_random_uuid(), 'bench', 1, (ARRAY['completed','completed','completed','failed','pending',"
            "'running','waiting'])[1 + i %% 7], '{\"n\": 1}', 'h', 0, 3, 1, '', 0, '', 0, 0, 0, 0, 0, '', false, "
            "'', '', '' FROM generate_series(1, %s) AS i",
            [runs],
        )
    connections["default"].close()
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={DB_NAME}", autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE durable_agents_run")
        size = connection.execute("SELECT pg_size_pretty(pg_total_relation_size('durable_agents_run'))").fetchone()
    print(f"seeded {runs:,} runs at {start} ({size[0]}; a start names {len(columns)} columns)")


def run_columns(name: str) -> list[str]:
    state = MigrationExecutor(None).loader.project_state((APP, name))
    model = state.apps.get_model(APP, "run")
    return [field.column for field in model._meta.local_concrete_fields]


def previous_migrations(rev: str | None) -> tuple[str, Path]:
    if rev is None:
        git = ["git", "-C", str(ROOT), "log", "-1", "--diff-filter=A", "--format=%H", "--", f"{APP}/migrations/0*.py"]
        rev = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip() + "^"
    short = ["git", "-C", str(ROOT), "rev-parse", "--short", rev]
    rev = subprocess.run(short, capture_output=True, text=True, check=True).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, f"{APP}/migrations"], capture_output=True, check=True
    ).stdout
    where = Path(tempfile.mkdtemp(prefix="rolling-bench-"))
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    (where / f"{APP}/migrations").rename(where / "previous_migrations")
    sys.path.insert(0, str(where))
    return rev, where


def measure(label: str, migration_modules: dict[str, str], start: str, columns: list[str]) -> None:
    copy = f"{DB_NAME}_copy"
    admin(f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)')
    admin(f'CREATE DATABASE "{copy}" TEMPLATE "{DB_NAME}"')
    use(copy)
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={copy}", autocommit=True) as starter:
        template = starter.execute("SELECT id FROM durable_agents_run LIMIT 1").fetchone()[0]
        names = ", ".join(f'"{column}"' for column in columns)
        copied = ", ".join("gen_random_uuid()" if column == "id" else f'"{column}"' for column in columns)
        insert = f"INSERT INTO durable_agents_run ({names}) SELECT {copied} FROM durable_agents_run WHERE id = %s"
        done = threading.Event()
        error: list[BaseException] = []
        took: list[float] = []

        def migrate() -> None:
            began = time.perf_counter()
            try:
                with override_settings(MIGRATION_MODULES=migration_modules):
                    executor = MigrationExecutor(connections["default"])
                    [leaf] = executor.loader.graph.leaf_nodes(APP)
                    executor.migrate([(APP, leaf[1])])
            except BaseException as failure:  # noqa: BLE001 - printed
                error.append(failure)
            finally:
                took.append(time.perf_counter() - began)
                connections["default"].close()
                done.set()

        waits: list[float] = []
        failures: Counter[str] = Counter()
        thread = threading.Thread(target=migrate)
        thread.start()
        while not done.is_set():
            began = time.perf_counter()
            try:
                starter.execute(insert, [template])
            except psycopg.Error as failure:
                failures[str(failure).splitlines()[0][:100]] += 1
            waits.append(time.perf_counter() - began)
        thread.join()
    admin(f'DROP DATABASE IF EXISTS "{copy}" WITH (FORCE)')
    waits_ms = sorted(wait * 1000 for wait in waits)
    p99 = waits_ms[int(len(waits_ms) * 0.99) - 1] if len(waits_ms) >= 100 else waits_ms[-1]
    print(
        f"{label:<28} migrate {took[0]:6.1f} s  starts {len(waits):6,}  failed {sum(failures.values()):6,}  "
        f"wait p50 {statistics.median(waits_ms):7.1f} ms  p99 {p99:8.1f} ms  longest {waits_ms[-1]:8.1f} ms"
        + (f"  migrate failed: {error[0]!r}" if error else "")
    )
    for why, count in failures.most_common(3):
        print(f"    {count:6,} × {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument(
        "--from", dest="start", default="0013_rate_buckets", help="from 0007_plans_forks to the default"
    )
    parser.add_argument("--rev", help="the git revision of the previous migrations")
    parser.add_argument("--reuse", action="store_true", help="measure on the database a previous run seeded")
    args = parser.parse_args()
    if not args.reuse:
        seed(args.runs, args.start)
    columns = run_columns(args.start)
    rev, _ = previous_migrations(args.rev)
    measure(f"migrations of {rev}", {APP: "previous_migrations"}, args.start, columns)
    measure("migrations of this checkout", {}, args.start, columns)


if __name__ == "__main__":
    main()
