"""Engine at scale: resume cost against history length, SIGKILL recovery, waiting runs, one sweep pass.

    python bench/engine_scale.py [--kills 10] [--waiting 10000] [--sweep-runs 100000]

* resume cost — one advance (claim + load + a no-op step + commit) of a run with 10, 1,000 and 10,000
  completed steps: median time and SQL statements, as a ratio to the 10-step run (must be flat);
* recovery — SIGKILL the worker holding a run, measure kill → next committed step on another worker:
  p50 / p95 over --kills kills (lease 2 s, sweep every 0.5 s: the knobs that bound it);
* waiting — --waiting runs parked on open waits, a worker and beat running: Celery tasks active or
  reserved, and messages queued (all must be 0: waiting costs nothing);
* sweep — one sweep pass over --sweep-runs runs of which 1 % are lost (expired leases): time per pass.

Uses its own database, `durable_bench_engine`, and Redis DB 14. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from datetime import timedelta

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = "durable_bench_engine"
BROKER = "redis://127.0.0.1:6379/14"
ROOT = prepare(
    DB_NAME, BROKER, DURABLE_LEASE_SECONDS="2", DURABLE_SWEEP_SECONDS="0.5", DURABLE_IDLE_RESWEEP_SECONDS="1"
)

import redis  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from durable_agents import api  # noqa: E402
from durable_agents.engine.advance import advance  # noqa: E402
from durable_agents.engine.sweep import sweep  # noqa: E402
from durable_agents.models import Run, RunStatus, Step, StepStatus, Wait, WaitKind  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402
from project.celery import app as celery_app  # noqa: E402


def run_with_history(done: int, pending: int = 60) -> Run:
    """A noop run whose first `done` steps are committed checkpoints (bulk-inserted)."""
    with transaction.atomic():
        run = api.start("noop", {"steps": done + pending})
        Step.objects.filter(run=run, position__lt=done).update(
            status=StepStatus.DONE, result={"ok": True}, finished_at=timezone.now()
        )
        Run.objects.filter(pk=run.id).update(cursor=done, status=RunStatus.RUNNING)
    return run


def resume_cost() -> list[tuple[str, float, int]]:
    rows = []
    for done in (10, 1_000, 10_000):
        run = run_with_history(done)
        times, statements = [], 0
        for _ in range(50):
            with CaptureQueriesContext(connection) as queries:
                began = time.perf_counter()
                advance(run.id)
                times.append(time.perf_counter() - began)
            statements = len(queries.captured_queries)
        rows.append((f"{done:,} completed steps", statistics.median(times) * 1000, statements))
    return rows


def recovery(kills: int) -> list[float]:
    redis.Redis.from_url(BROKER).flushdb()
    workers = [WorkerProcess(name=f"bench-{i}", beat=i == 0, cwd=ROOT).start() for i in range(2)]
    seen = []
    try:
        run = api.start("noop", {"steps": 100_000, "sleep_ms": 20})
        wait_for(lambda: Run.objects.get(pk=run.id).cursor > 3, timeout=60, what="the run to start")
        for _ in range(kills):
            current = Run.objects.get(pk=run.id)
            victim = next((w for w in workers if current.lease_owner and w.owns(current.lease_owner)), workers[1])
            cursor = current.cursor
            killed = time.monotonic()
            victim.kill()
            workers[workers.index(victim)] = WorkerProcess(
                name=f"bench-{uuid.uuid4().hex[:4]}", beat=victim is workers[0], cwd=ROOT
            ).start()
            wait_for(
                lambda c=cursor: Run.objects.get(pk=run.id).cursor > c + 1,
                timeout=60,
                interval=0.01,
                what="a commit after the kill",
            )
            seen.append(time.monotonic() - killed)
            time.sleep(0.5)
        api.cancel(run.id)
    finally:
        for worker in workers:
            worker.kill()
    return seen


def waiting(count: int) -> tuple[int, int, int]:
    redis.Redis.from_url(BROKER).flushdb()
    now = timezone.now()
    runs = [
        Run(
            workflow="noop",
            workflow_version=1,
            status=RunStatus.WAITING,
            input={},
            input_hash="x",
            step_count=1,
            created_at=now,
            updated_at=now,
        )
        for _ in range(count)
    ]
    Run.objects.bulk_create(runs, batch_size=5000)
    steps = Step.objects.bulk_create(
        [Step(run=r, step_id="tick-1", name="tick", position=0, status=StepStatus.WAITING) for r in runs],
        batch_size=5000,
    )
    Wait.objects.bulk_create(
        [Wait(run=r, step=s, kind=WaitKind.SIGNAL, name="go") for r, s in zip(runs, steps, strict=True)],
        batch_size=5000,
    )
    worker = WorkerProcess(name="bench-waiting", beat=True, cwd=ROOT).start()
    try:
        wait_for(lambda: celery_app.control.inspect(timeout=1).ping(), timeout=60, what="the worker")
        time.sleep(3)  # six sweeps pass over the waiting runs
        inspect = celery_app.control.inspect(timeout=2)
        active = sum(len(v) for v in (inspect.active() or {}).values())
        reserved = sum(len(v) for v in (inspect.reserved() or {}).values())
        queued = redis.Redis.from_url(BROKER).llen("celery")
    finally:
        worker.kill()
    return active, reserved, queued


def sweep_pass(total: int) -> tuple[float, int, float]:
    now = timezone.now()
    lost = total // 100
    Run.objects.bulk_create(
        [
            Run(
                workflow="noop",
                workflow_version=1,
                input={},
                input_hash="x",
                step_count=1,
                created_at=now,
                status=RunStatus.RUNNING if i < lost else RunStatus.COMPLETED,
                updated_at=now - timedelta(minutes=5),
                lease_owner="gone:1" if i < lost else "",
                lease_expires_at=now - timedelta(minutes=1) if i < lost else None,
            )
            for i in range(total)
        ],
        batch_size=10_000,
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    from django.test.utils import override_settings

    with override_settings(DURABLE_AGENTS={"SWEEP_BATCH": lost, "WAKER": "bench.baseline.no_wake"}):
        began = time.perf_counter()
        report = sweep()
        first = time.perf_counter() - began
        began = time.perf_counter()
        sweep()
        idle = time.perf_counter() - began
    return first * 1000, report.woken, idle * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--sweep-runs", type=int, default=100_000)
    args = parser.parse_args()

    resume = resume_cost()
    base = resume[0][1]
    print("\nresume cost: one advance of a run with N completed steps (in-process, Postgres)")
    print(f"{'history':<26} {'median ms':>10} {'statements':>11} {'ratio to 10':>12}")
    for label, ms, statements in resume:
        print(f"{label:<26} {ms:>10.2f} {statements:>11} {ms / base:>12.2f}")

    recovered = sorted(recovery(args.kills))
    p95 = recovered[min(len(recovered) - 1, int(round(0.95 * (len(recovered) - 1))))]
    print(
        f"\nrecovery after SIGKILL ({len(recovered)} kills, lease 2 s, sweep every 0.5 s): "
        f"p50 {statistics.median(recovered):.2f} s, p95 {p95:.2f} s, max {recovered[-1]:.2f} s"
    )

    active, reserved, queued = waiting(args.waiting)
    print(
        f"\n{args.waiting:,} waiting runs with a worker and beat running: {active} tasks active, "
        f"{reserved} reserved, {queued} messages queued"
    )

    first, woken, idle = sweep_pass(args.sweep_runs)
    print(
        f"\none sweep pass over {args.sweep_runs:,} runs ({woken:,} lost): {first:.1f} ms; "
        f"the next pass (nothing to do): {idle:.1f} ms"
    )


if __name__ == "__main__":
    main()
