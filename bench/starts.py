"""Starting runs: what one start costs (statements, this process's CPU, the server's planning and execution) and how
many runs a process starts per second, one per transaction (`api.start`) and in batches (`api.start_many`).

    python bench/starts.py [--runs 2000] [--batch 1000] [--steps 3] [--repeat 5] [--no-fsync] [--celery]

In this process, on a database of its own (BENCH_DATABASE, default `durable_bench_starts`, dropped and created):

* `start` — `noop` runs of --steps steps, each `api.start` in autocommit (its own transaction, as a web request
  without ATOMIC_REQUESTS starts one), without and with an idempotency key, and each inside a `transaction.atomic()`
  of its own (a request with ATOMIC_REQUESTS: BEGIN and COMMIT are the caller's);
* `start_many` — --runs runs in calls of --batch.

Each figure is the best of --repeat passes (this machine may be shared: the best pass is the one least disturbed),
with the median beside it. CPU is this process's (time.process_time), per run: what the start costs the web
process, whatever the database's load. `--no-fsync` sets synchronous_commit off for this session: the commit no
longer waits for the disk, so the rate shows the start's own costs. Wakes go to a waker that keeps nothing; with
`--celery`, to Celery on BENCH_BROKER_URL (default Redis DB 13, emptied), no worker consuming them.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench_starts")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
ROOT = prepare(DB_NAME, BROKER, DJANGO_SETTINGS_MODULE="tests.settings")

import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext, override_settings  # noqa: E402

from durable_agents import api  # noqa: E402
from durable_agents.models import Run  # noqa: E402

WOKEN: list[str] = []


def keep_nothing(run_id: str, countdown: float | None = None, queue: str | None = None) -> None:
    """A WAKER that sends nothing: the bench measures the start, not the broker."""
    WOKEN.append(run_id)


def keep_nothing_batch(run_ids: list[str], queue: str | None = None) -> None:
    WOKEN.extend(run_ids)


def measure(label: str, runs: int, calls: int, fn: Callable[[], object], repeat: int) -> None:
    """Call fn `calls` times (starting `runs` runs), `repeat` times; print runs/s and CPU µs a run."""
    rates, cpu = [], []
    for _ in range(repeat):
        began, began_cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            fn()
        cpu.append((time.process_time() - began_cpu) / runs * 1e6)
        rates.append(runs / (time.perf_counter() - began))
    print(
        f"  {label:<40} {max(rates):>8,.0f} runs/s (median {statistics.median(rates):>6,.0f})"
        f"   CPU {min(cpu):>5,.0f} µs/run (median {statistics.median(cpu):>5,.0f})",
        flush=True,
    )


def statements(label: str, fn: Callable[[], object]) -> None:
    """The statements one call sends (Django logs BEGIN, COMMIT and savepoints too), and the server's planning and
    execution time of the start's own: EXPLAIN ANALYZE of it, in 20 more calls, each rolled back."""
    with CaptureQueriesContext(connection) as captured:
        fn()
    shown = ", ".join(query["sql"].split()[0] for query in captured.captured_queries)
    planning: list[float] = []
    execution: list[float] = []

    def explain(execute, sql, params, many, context):  # noqa: ANN001, ANN202 - Django's execute_wrapper
        if sql.startswith("WITH"):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN (ANALYZE, SUMMARY) {sql}", params)
                lines = [row[0] for row in cursor.fetchall()]
                planning.append(float(next(line for line in lines if line.startswith("Planning")).split()[2]))
                execution.append(float(next(line for line in lines if line.startswith("Execution")).split()[2]))
                transaction.set_rollback(True)
        return execute(sql, params, many, context)

    for _ in range(20):
        with transaction.atomic(), connection.execute_wrapper(explain):
            fn()
            transaction.set_rollback(True)
    timed = ""
    if planning:
        plans, runs = statistics.median(planning), statistics.median(execution)
        timed = f"   server: planning {plans:.2f} ms, execution {runs:.2f} ms"
    print(f"  {label:<40} {len(captured.captured_queries)}: {shown}{timed}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-fsync", action="store_true", help="synchronous_commit off for this session")
    parser.add_argument("--celery", action="store_true", help="wake through Celery on BENCH_BROKER_URL")
    options = parser.parse_args()
    durable = dict(settings.DURABLE_AGENTS)
    if options.celery:
        redis.Redis.from_url(BROKER).flushdb()
    else:
        durable.update(WAKER=f"{__name__}.keep_nothing", BATCH_WAKER=f"{__name__}.keep_nothing_batch")
    if options.no_fsync:
        with connection.cursor() as cursor:
            cursor.execute("SET synchronous_commit = off")
    with override_settings(DURABLE_AGENTS=durable):
        run(options)


def run(options: argparse.Namespace) -> None:
    steps, runs = {"steps": options.steps}, options.runs
    api.start("noop", steps)  # connection and caches warm
    has_many = hasattr(api, "start_many")
    print(
        f"noop runs of {options.steps} steps; waker: {'celery' if options.celery else 'none'}; "
        f"synchronous_commit: {'off' if options.no_fsync else 'on'}"
    )
    print("statements a call sends:")
    statements("start", lambda: api.start("noop", steps))
    statements("start, keyed", lambda: api.start("noop", steps, idempotency_key=uuid.uuid4().hex))
    key = uuid.uuid4().hex
    api.start("noop", steps, idempotency_key=key)
    statements("start, its key's run exists", lambda: api.start("noop", steps, idempotency_key=key))

    def in_atomic() -> None:
        with transaction.atomic():
            api.start("noop", steps)

    statements("start, in transaction.atomic()", in_atomic)
    if has_many:
        statements(f"start_many of {options.batch}", lambda: api.start_many("noop", [steps] * options.batch))
        statements(
            f"start_many of {options.batch}, keyed",
            lambda: api.start_many(
                "noop", [steps] * options.batch, idempotency_keys=[uuid.uuid4().hex for _ in range(options.batch)]
            ),
        )

    print(f"rates, best of {options.repeat} passes:")
    measure("start", runs, runs, lambda: api.start("noop", steps), options.repeat)
    measure(
        "start, keyed",
        runs,
        runs,
        lambda: api.start("noop", steps, idempotency_key=uuid.uuid4().hex),
        options.repeat,
    )
    measure("start, each in transaction.atomic()", runs, runs, in_atomic, options.repeat)
    if has_many:
        calls = max(runs // options.batch, 1)
        batch = [steps] * options.batch
        measure(
            f"start_many, {options.batch} a call",
            calls * options.batch,
            calls,
            lambda: api.start_many("noop", batch),
            options.repeat,
        )
        measure(
            f"start_many, {options.batch} a call, keyed",
            calls * options.batch,
            calls,
            lambda: api.start_many("noop", batch, idempotency_keys=[uuid.uuid4().hex for _ in batch]),
            options.repeat,
        )
    print(f"{Run.objects.count():,} runs written, {len(WOKEN):,} wakes kept")


if __name__ == "__main__":
    main()
