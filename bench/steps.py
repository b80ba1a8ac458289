"""Step cost: sequential durable no-op steps and one-step-run throughput, beside raw Celery no-op tasks.

    python bench/steps.py [--steps 500] [--runs 500] [--workers 2] [--slice-ms 100]

Needs Postgres and Redis (scripts/test starts them). Prints figures and ratios; asserts nothing.
Both sides use the same broker, worker pool and Celery settings (acks_late, prefetch 1), measured in the
same run. The durable side runs twice, with eager continuation (EAGER_SLICE_MS=--slice-ms: a worker runs a
run's next steps itself) and without (0: one step per task, a broker hop per step). Postgres figures come
from pg_stat_database deltas: transactions, and new sessions per step. BENCH_DATABASE and BENCH_BROKER_URL
name the database (dropped and created) and the Redis database (emptied) it uses.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/14")
os.environ.update(
    DJANGO_SETTINGS_MODULE="project.settings",
    DJANGO_LOCAL_SECRET_KEY="1",  # a random key for this machine (project/settings.py)
    DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{DB_NAME}",
    CELERY_BROKER_URL=BROKER,
    DURABLE_LOG_LEVEL="ERROR",
)


def _prepare_database() -> None:
    subprocess.run(
        ["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", f"DROP DATABASE IF EXISTS {DB_NAME}"],
        check=True,
        capture_output=True,
    )
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", f"CREATE DATABASE {DB_NAME}"], check=True)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, check=True)


_prepare_database()

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from bench.baseline import _redis, hop, noop  # noqa: E402
from durable_agents import api  # noqa: E402
from durable_agents.engine.advance import advance  # noqa: E402
from durable_agents.models import Run  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402


def pg_counters() -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = %s", [DB_NAME])
        return cursor.fetchone()


def start_workers(n: int, slice_ms: int) -> list[WorkerProcess]:
    workers = [
        WorkerProcess(
            name=f"bench-{i}",
            env={"DURABLE_EAGER_SLICE_MS": str(slice_ms)},
            extra_args=["--include", "bench.baseline"],
            cwd=ROOT,
        ).start()
        for i in range(n)
    ]
    # Warm up: one hop through each worker so imports and connections are made before timing.
    key = f"warm-{uuid.uuid4()}"
    for _ in range(n * 4):
        noop.delay(key)
    wait_for(lambda: int(_redis.get(key) or 0) >= n * 4, timeout=60, what="workers to start")
    return workers


def sequential(steps: int) -> tuple[float, float, float, float]:
    key = f"hop-{uuid.uuid4()}"
    began = time.time()
    hop.delay(steps, key)
    wait_for(lambda: _redis.get(key), timeout=600, interval=0.01, what="the hop chain")
    raw = (float(_redis.get(key)) - began) / steps

    time.sleep(1.5)
    xact0, sessions0 = pg_counters()
    run = api.start("noop", {"steps": steps})
    done = wait_for(
        lambda: Run.objects.filter(pk=run.id, status="completed").first(),
        timeout=600,
        interval=0.01,
        what="the durable run",
    )
    durable = (done.finished_at - done.created_at).total_seconds() / steps
    time.sleep(1.5)  # backends report their statistics at most once a second, when idle
    xact1, sessions1 = pg_counters()
    return raw, durable, (xact1 - xact0) / steps, (sessions1 - sessions0) / steps


def throughput(runs: int) -> tuple[float, float, float]:
    key = f"noop-{uuid.uuid4()}"
    began = time.monotonic()
    for _ in range(runs):
        noop.delay(key)
    wait_for(lambda: int(_redis.get(key) or 0) >= runs, timeout=600, interval=0.01, what="raw tasks")
    raw = runs / (time.monotonic() - began)

    # All runs are created in one transaction, so their wake-ups go out together on commit and the
    # figure measures the workers, not this process's start() loop (reported separately).
    made = time.monotonic()
    with transaction.atomic():
        ids = [api.start("noop", {"steps": 1}).id for _ in range(runs)]
        began = time.monotonic()
    starts = runs / (began - made)
    wait_for(
        lambda: Run.objects.filter(pk__in=ids, status="completed").count() == runs,
        timeout=600,
        interval=0.05,
        what="durable one-step runs",
    )
    durable = runs / (time.monotonic() - began)
    return raw, durable, starts


def statements_per_step() -> int:
    run = api.start("noop", {"steps": 3})
    Run.objects.filter(pk=run.id).update(status="running")  # keep workers out: claim it here
    Run.objects.filter(pk=run.id).update(status="pending")
    advance(run.id)
    with CaptureQueriesContext(connection) as queries:
        advance(run.id)
    return len(queries.captured_queries)


def measure(workers: int, slice_ms: int, steps: int, runs: int) -> dict[str, float]:
    """Both sides' figures with the durable workers' EAGER_SLICE_MS at `slice_ms`."""
    redis.Redis.from_url(BROKER).flushdb()
    started = start_workers(workers, slice_ms)
    try:
        raw_hop, durable_step, xacts, sessions = sequential(steps)
        raw_tps, durable_tps, starts = throughput(runs)
    finally:
        for worker in started:
            worker.stop()
    return {
        "raw_hop": raw_hop,
        "step": durable_step,
        "xacts": xacts,
        "sessions": sessions,
        "raw_tps": raw_tps,
        "tps": durable_tps,
        "starts": starts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slice-ms", type=int, default=100)
    args = parser.parse_args()
    modes = {f"eager {args.slice_ms} ms": args.slice_ms, "one step per task": 0}
    figures = {name: measure(args.workers, ms, args.steps, args.runs) for name, ms in modes.items()}
    statements = statements_per_step()
    print(f"\nstep cost — {args.workers} solo workers, Redis broker, Postgres, same Celery settings both sides")
    print(f"{'durable workers':<20} {'measure':<36} {'raw celery':>11} {'durable':>10} {'ratio':>7}")
    for name, f in figures.items():
        print(
            f"{name:<20} {'sequential no-op step latency (ms)':<36} {f['raw_hop'] * 1000:>11.2f} "
            f"{f['step'] * 1000:>10.2f} {f['step'] / f['raw_hop']:>7.2f}"
        )
        print(
            f"{name:<20} {'one-step runs per second':<36} {f['raw_tps']:>11.0f} {f['tps']:>10.0f} "
            f"{f['raw_tps'] / f['tps']:>7.2f}"
        )
        print(
            f"{name:<20} postgres per durable step: {f['xacts']:.2f} transactions, {f['sessions']:.3f} new "
            f"connections; api.start() {f['starts']:.0f}/s from one process"
        )
    print(f"{statements} SQL statements in one advance (in-process)")


if __name__ == "__main__":
    main()
