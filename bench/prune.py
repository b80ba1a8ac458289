"""Prune beside a live engine: step latency while `durable_prune` deletes old runs, against an idle database.

    python bench/prune.py [--runs 200000] [--batch 50] [--duty-cycle 0.1] [--pause 0] [--chains 2] [--steps 200]
                          [--prune-for S] [--idle-seconds S] [--seed-only | --reuse]

Writes --runs finished refund_agent runs a year old (real rows, copied in SQL: bench/records.py), starts a
`celery worker` (prefork, 2 processes), and measures the same workload twice in the same run: --chains runs of
noop steps at a time, each --steps long, started again as they end. First on an idle database for as long as
the prune will take (measured on a first pass), then while `manage.py durable_prune --older-than 30d` runs in a
subprocess. A step's latency is the time from the previous step's commit to its own (claim, body, commit and,
between tasks, a broker hop): p50, p95 and p99 of each phase and their ratio (the goal: p95 within 20 %).
Prints figures; asserts nothing. BENCH_DATABASE names the database (dropped and created); BENCH_BROKER_URL the
Redis database (emptied). Seeding a million runs takes a while: `--seed-only` writes them and stops, and a later
`--reuse` measures on what is there (the database kept, topped up to --runs), so the measurement can wait for
a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

try:
    from bench._setup import configure, reset_database
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import configure, reset_database

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_prune_bench")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/9")
ROOT = configure(DB_NAME, BROKER)

if __name__ == "__main__" and "--reuse" not in sys.argv:
    reset_database(DB_NAME)
    subprocess.run(["redis-cli", "-u", BROKER, "flushdb"], check=True, capture_output=True)

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402

from bench.records import copy_runs, real_runs  # noqa: E402
from durable_agents import api  # noqa: E402
from durable_agents.models import Run, Step  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402

OLD = timedelta(days=365)


def seed(total: int) -> float:
    began = time.monotonic()
    if Run.objects.filter(workflow="refund_agent").count() >= total:
        return 0.0  # --reuse, and there already
    templates = real_runs()
    per_chunk = 2000
    while (left := total - Run.objects.filter(workflow="refund_agent").count()) > 0:
        copy_runs(templates, max(1, min(per_chunk, left // len(templates))), status="completed", age=OLD)
    with connection.cursor() as cursor:
        # A year on, the approval emails of these runs went out long ago (here no worker ran to send them).
        cursor.execute(
            "UPDATE durable_agents_effect SET status = 'applied' WHERE kind = 'notification' AND status = 'pending' "
            "AND run_id IN (SELECT id FROM durable_agents_run "
            "WHERE updated_at < STATEMENT_TIMESTAMP() - interval '30 days')"
        )
        cursor.execute("VACUUM ANALYZE")
    return time.monotonic() - began


def workload(stop: threading.Event, chains: int, steps: int) -> list[str]:
    """Keep `chains` noop runs going until `stop`; returns their ids."""
    ids: list[str] = []
    live: list[str] = []
    while not stop.is_set():
        live = [run_id for run_id in live if not Run.objects.filter(pk=run_id, status="completed").exists()]
        while len(live) < chains:
            run_id = str(api.start("noop", {"steps": steps}).id)
            live.append(run_id)
            ids.append(run_id)
        time.sleep(0.05)
    wait_for(
        lambda: Run.objects.filter(pk__in=live).exclude(status="completed").count() == 0,
        timeout=600,
        what="the last chains",
    )
    return ids


def latencies(run_ids: list[str], since: float, until: float) -> list[float]:
    """Commit-to-commit gaps (ms) between consecutive steps of each run, for steps committed in [since, until]."""
    gaps = []
    for run_id in run_ids:
        times = list(
            Step.objects.filter(run_id=run_id, finished_at__isnull=False)
            .order_by("position")
            .values_list("finished_at", flat=True)
        )
        for before, after in zip(times, times[1:], strict=False):
            if since <= after.timestamp() <= until:
                gaps.append((after - before).total_seconds() * 1000)
    return gaps


def measure(chains: int, steps: int, during: Callable[[], None]) -> tuple[list[float], float]:
    stop = threading.Event()
    found: list[str] = []
    thread = threading.Thread(target=lambda: found.extend(workload(stop, chains, steps)))
    thread.start()
    time.sleep(2)  # the chains are under way before the phase's clock starts
    since = time.time()
    during()
    until = time.time()
    stop.set()
    thread.join()
    return latencies(found, since, until), until - since


def figures(gaps: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(gaps, n=100)
    return {"n": len(gaps), "p50": statistics.median(gaps), "p95": cuts[94], "p99": cuts[98]}


def prune_command(batch: int, pause: float, duty_cycle: float, seconds: float) -> subprocess.CompletedProcess[str]:
    command = ["durable_prune", "--older-than", "30d", "--batch-size", str(batch), "--pause", str(pause)]
    command += ["--duty-cycle", str(duty_cycle), "--json"]
    if seconds:
        command += ["--stop-after", f"{seconds}s"]
    return subprocess.run(
        [sys.executable, "manage.py", *command],
        cwd=ROOT,
        env={**os.environ},
        capture_output=True,
        text=True,
        check=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.0, help="least seconds the prune rests between batches")
    parser.add_argument("--duty-cycle", type=float, default=0.1, help="share of the time the prune may work")
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prune-for", type=float, default=0, help="stop the prune after S seconds (0: prune all)")
    parser.add_argument("--idle-seconds", type=float, default=0, help="idle phase length (0: as long as the prune)")
    kept = parser.add_mutually_exclusive_group()
    kept.add_argument("--seed-only", action="store_true", help="write the runs and stop (measure later: --reuse)")
    kept.add_argument("--reuse", action="store_true", help="keep the database and its runs (topped up to --runs)")
    args = parser.parse_args()

    took = seed(args.runs)
    rows = {m.__name__: m.objects.count() for m in (Run, Step)}
    print(f"seeded {args.runs:,} finished refund_agent runs a year old in {took:.0f} s ({rows})", flush=True)
    if args.seed_only:
        return
    worker = WorkerProcess(name="bench-prune", pool="prefork", concurrency=2, cwd=ROOT).start()
    try:
        pruned: dict[str, object] = {}

        def run_prune() -> None:
            pruned.update(json.loads(prune_command(args.batch, args.pause, args.duty_cycle, args.prune_for).stdout))

        # The prune first, so the idle phase can last as long as it did (the same number of steps seen).
        loaded, prune_seconds = measure(args.chains, args.steps, run_prune)
        idle_for = args.idle_seconds or prune_seconds
        idle, _ = measure(args.chains, args.steps, lambda: time.sleep(idle_for))
    finally:
        worker.stop()
    rate = pruned.get("deleted", 0) / prune_seconds
    print(
        f"pruned {pruned.get('deleted'):,} runs in {pruned.get('batches')} batches of {args.batch} "
        f"(--duty-cycle {args.duty_cycle}, --pause {args.pause}) in {prune_seconds:.1f} s, "
        f"{pruned.get('rested'):.0f} s of it resting ({rate:,.0f} runs/s, with their steps, turns, effects, waits "
        "and events)"
    )
    a, b = figures(idle), figures(loaded)
    print(f"{'step latency (ms)':<24}{'steps':>8}{'p50':>9}{'p95':>9}{'p99':>9}")
    for label, f in (("idle database", a), ("while pruning", b)):
        print(f"{label:<24}{f['n']:>8}{f['p50']:>9.2f}{f['p95']:>9.2f}{f['p99']:>9.2f}")
    ratio = b["p95"] / a["p95"]
    verdict = "within" if ratio <= 1.2 else "over"
    print(f"p95 ratio pruning/idle: {ratio:.2f} ({verdict} the 1.20 goal)")
    print(f"runs left: {Run.objects.filter(workflow='refund_agent').count():,}")


if __name__ == "__main__":
    main()
