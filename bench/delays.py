"""Retry delays on one single-slot worker: Redis, and RabbitMQ with its quorum queue on a direct or a topic exchange.

    python bench/delays.py [--runs 20] [--sweep-seconds 5] [--pool prefork|solo] [--case redis,short,2 ...]

Each case starts `--runs` runs of the test workflow `flaky` whose step fails once ("retried"), on one worker with one
slot (`--pool`, the Procfile's prefork by default; beat embedded, the sweep every `--sweep-seconds`); once each has
failed its first attempt, as many one-step `noop` runs ("quick"), which wait for the slot while a worker holds a
retry's message. Printed: each batch's time from its first start to its last completion (after a warm-up run), and
how many retried runs the sweep woke. The cases, all combinations unless `--case` names some:

  broker     redis; rabbitmq-direct (a quorum queue on Celery's direct exchange: the example project's RabbitMQ
             configuration before issue 29); rabbitmq-topic (its configuration now: a topic exchange)
  backoff    short (RETRY_BACKOFF_SECONDS 0.5: a first retry after 0.25-0.5 s) or long (6: after 3-6 s)
  countdown  MAX_COUNTDOWN_SECONDS 2 (the default now) or 30 (the default before): a longer delay parks the run
             for the sweep instead of going out as a Celery countdown

Each case runs in a process of its own (Django reads its settings once) on a fresh database (BENCH_DATABASE,
default durable_bench_delays), Redis database BENCH_REDIS_URL (default redis://127.0.0.1:6379/13, emptied) and a
RabbitMQ vhost of its own (rabbitmqctl). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench_delays")
REDIS = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672"
BROKERS = ("redis", "rabbitmq-direct", "rabbitmq-topic")
BACKOFFS = {"short": 0.5, "long": 6.0}
COUNTDOWNS = ("2", "30")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--sweep-seconds", type=float, default=5.0, help="beat's period (the example project's: 5)")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "solo"], help="the worker's pool (one slot)")
    parser.add_argument("--case", action="append", help="broker,backoff,countdown (e.g. rabbitmq-direct,long,30)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child.split(","), runs=args.runs, pool=args.pool)), flush=True)
        return
    cases = [tuple(case.split(",")) for case in args.case or []] or list(
        itertools.product(BROKERS, BACKOFFS, COUNTDOWNS)
    )
    print(
        f"{args.runs} runs of `flaky` (one failure each), one {args.pool} worker of one slot, "
        f"sweep every {args.sweep_seconds} s"
    )
    print(f"{'broker':<16} {'backoff':<8} {'countdown ≤':<12} {'retried':>8} {'quick':>8} {'woken by the sweep':>20}")
    for broker, backoff, countdown in cases:
        figures = run_case(broker, backoff, countdown, args.runs, args.sweep_seconds, args.pool)
        print(
            f"{broker:<16} {backoff:<8} {countdown + ' s':<12} {figures['seconds']:>7.1f}s {figures['quick']:>7.1f}s "
            f"{figures['swept']:>20}",
            flush=True,
        )


def run_case(broker: str, backoff: str, countdown: str, runs: int, sweep_seconds: float, pool: str) -> dict[str, float]:
    with _broker(broker) as url, tempfile.TemporaryDirectory(prefix="durable-bench-delays-") as var:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "bench.delays_settings",
            "DJANGO_LOCAL_SECRET_KEY": "1",
            "DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{DB_NAME}",
            "CELERY_BROKER_URL": url,
            "BENCH_EXCHANGE": "direct" if broker == "rabbitmq-direct" else "",
            "BENCH_DURABLE_AGENTS": json.dumps(
                {"RETRY_BACKOFF_SECONDS": BACKOFFS[backoff], "MAX_COUNTDOWN_SECONDS": float(countdown)}
            ),
            "DURABLE_SWEEP_SECONDS": str(sweep_seconds),
            "DURABLE_VAR_DIR": var,
            "DURABLE_LOG_LEVEL": "ERROR",
        }
        _prepare_database(env)
        child = [
            sys.executable,
            __file__,
            "--child",
            f"{broker},{backoff},{countdown}",
            "--runs",
            str(runs),
            "--pool",
            pool,
        ]
        out = subprocess.run(child, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def _broker(broker: str) -> Iterator[str]:
    if broker == "redis":
        import redis

        redis.Redis.from_url(REDIS).flushdb()
        yield REDIS
        return
    vhost = f"durable_bench_{uuid.uuid4().hex[:8]}"
    subprocess.run(["rabbitmqctl", "-q", "add_vhost", vhost], check=True, capture_output=True)
    try:
        subprocess.run(
            ["rabbitmqctl", "-q", "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
            check=True,
            capture_output=True,
        )
        yield f"{RABBITMQ}/{vhost}"
    finally:
        subprocess.run(["rabbitmqctl", "-q", "delete_vhost", vhost], check=True, capture_output=True)


def _prepare_database(env: dict[str, str]) -> None:
    for sql in (f"DROP DATABASE IF EXISTS {DB_NAME}", f"CREATE DATABASE {DB_NAME}"):
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", sql], check=True, capture_output=True)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0", "--skip-checks"], cwd=ROOT, env=env, check=True)


def measure(broker: str, backoff: str, countdown: str, *, runs: int, pool: str) -> dict[str, float]:
    """In the case's own process: one worker, a warm-up run; `runs` flaky runs, and once each has failed its first
    attempt, `runs` one-step runs that never fail. Each batch timed from its first start to its last completion."""
    import django

    django.setup()

    from durable_agents import api
    from durable_agents.models import Event, Run, RunStatus, Step
    from durable_agents.testing import WorkerProcess, wait_for, wait_for_run

    log = os.environ.get("BENCH_WORKER_LOG")  # the worker's log, kept there if set
    name = f"bench-delays-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(app="project", pool=pool, concurrency=1, beat=True, name=name, log_path=log).start()
    try:
        wait_for_run(api.start("noop", {"steps": 1}).id, "completed", timeout=120)
        started = time.monotonic()
        retried = [api.start("flaky", {"failures": 1}).id for _ in range(runs)]
        failed_once = Step.objects.filter(run_id__in=retried, step_id="flaky", attempts__gte=1)
        wait_for(lambda: failed_once.count() == runs, timeout=600, interval=0.05, what="every first attempt")
        quick_started = time.monotonic()
        quick = [api.start("noop", {"steps": 1}).id for _ in range(runs)]
        quick_done = Run.objects.filter(pk__in=quick, status=RunStatus.COMPLETED)
        wait_for(lambda: quick_done.count() == runs, timeout=600, interval=0.05, what=f"{runs} quick runs")
        quick_seconds = time.monotonic() - quick_started
        retried_done = Run.objects.filter(pk__in=retried, status=RunStatus.COMPLETED)
        wait_for(lambda: retried_done.count() == runs, timeout=600, interval=0.05, what=f"{runs} retried runs")
        seconds = time.monotonic() - started
        swept = Event.objects.filter(run_id__in=retried, kind="swept").values("run_id").distinct().count()
        return {"seconds": seconds, "quick": quick_seconds, "swept": swept}
    finally:
        worker.kill()


if __name__ == "__main__":
    main()
