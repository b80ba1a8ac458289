"""The crash demo: runs on real worker subprocesses, SIGKILLs one mid-run, and shows nothing was lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.db.models import Sum

from durable_agents import api
from durable_agents.models import FINISHED_RUN_STATUSES, Event, Run, RunStatus, Step, StepStatus
from durable_agents.testing.workers import WorkerProcess

RUNS = 3
STEPS = 12
STEP_MS = 250


def run_demo(write: Callable[[str], None] = print, *, kill_after: float = 1.5, timeout: float = 180.0) -> bool:
    """Start runs, kill their worker with SIGKILL mid-run, start another; True if every run completed."""
    log_dir = Path(settings.VAR_DIR) / "demo"
    log_dir.mkdir(parents=True, exist_ok=True)
    broker = settings.CELERY_BROKER_URL.split("://")[0]
    database = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    write(
        f"durable_agents demo — database: {database}, broker: {broker}, lease: "
        f"{settings.DURABLE_AGENTS.get('LEASE_SECONDS')}s"
    )

    first = WorkerProcess(name="demo-a", beat=True, log_path=log_dir / "worker-a.log", cwd=settings.BASE_DIR).start()
    runs = [api.start("noop", {"steps": STEPS, "sleep_ms": STEP_MS}) for _ in range(RUNS)]
    write(f"started {RUNS} runs of noop ({STEPS} steps of {STEP_MS} ms each) on worker A (pid {first.pid})")

    second: WorkerProcess | None = None
    killed_at: float | None = None
    recovered_after: float | None = None
    started = time.monotonic()
    try:
        while time.monotonic() - started < timeout:
            time.sleep(0.5)
            rows = {r.id: r for r in Run.objects.filter(pk__in=[r.id for r in runs])}
            write("  " + "  ".join(f"{str(i)[:8]} {r.cursor:>2}/{r.step_count} {r.status:<9}" for i, r in rows.items()))
            if killed_at is None and time.monotonic() - started > kill_after:
                done_before = Step.objects.filter(run__in=runs, status=StepStatus.DONE).count()
                first.kill()
                killed_at = time.monotonic()
                write(f"!! SIGKILL worker A mid-run ({done_before} steps committed); starting worker B")
                second = WorkerProcess(
                    name="demo-b", beat=True, log_path=log_dir / "worker-b.log", cwd=settings.BASE_DIR
                ).start()
            elif (
                killed_at is not None
                and recovered_after is None
                and Step.objects.filter(run__in=runs, status=StepStatus.DONE).count() > done_before
            ):
                recovered_after = time.monotonic() - killed_at
                write(f"   recovered: the next step committed {recovered_after:.1f}s after the kill")
            if all(r.status in FINISHED_RUN_STATUSES for r in rows.values()):
                break
    finally:
        first.kill()
        if second is not None:
            second.stop()

    return _summary(write, runs, recovered_after)


def _summary(write: Callable[[str], None], runs: list[Run], recovered_after: float | None) -> bool:
    write("")
    write(f"{'run':<10} {'status':<10} {'steps':>6} {'executions':>11} {'takeovers':>10}")
    ok = True
    for run in Run.objects.filter(pk__in=[r.id for r in runs]).order_by("created_at"):
        executions = Step.objects.filter(run=run).aggregate(n=Sum("attempts"))["n"] or 0
        takeovers = Event.objects.filter(run=run, kind__in=["lease_takeover", "swept"]).count()
        write(
            f"{str(run.id)[:8]:<10} {run.status:<10} {run.cursor:>3}/{run.step_count:<2} {executions:>11} "
            f"{takeovers:>10}"
        )
        ok = ok and run.status == RunStatus.COMPLETED
    if recovered_after is not None:
        write(f"time to recover after SIGKILL: {recovered_after:.1f}s")
    write("")
    write("Every step committed once; the killed worker's run resumed from its last checkpoint, not from the start.")
    write("Look at the same runs: python manage.py durable_runs   |   python manage.py durable_show RUN_ID")
    write("or the admin: python manage.py createsuperuser && python manage.py runserver → http://127.0.0.1:8000/admin/")
    return ok
