"""Child runs: spawn and join of 1,000 children, against 1,000 independent runs; and the sweep's cost.

    python bench/children.py [--children 1000] [--workers 2] [--parents 1000]

* spawn and join — one parent whose `children` step starts --children `noop` runs (one step each) and waits
  for all of them, on --workers real solo workers (one with beat): wall time from `api.start` of the parent
  to its completion, split into spawn (parent started → children inserted) and the rest; the baseline, on the
  same workers in the same run: --children independent `noop` runs started one by one with `api.start`, from
  the first start to the last completion;
* the sweep's cost — --parents parents each parked on an open join whose child has not finished: one sweep
  pass that re-checks every join (all due), and a pass right after (each checked join waits
  IDLE_RESWEEP_SECONDS), against a pass over the same database with no join due.

BENCH_DATABASE names its database (default `durable_bench_children`, dropped and created) and BENCH_BROKER_URL its
Redis database (default DB 13, emptied). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench_children")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
ROOT = prepare(
    DB_NAME,
    BROKER,
    DJANGO_SETTINGS_MODULE="tests.settings",  # its test app has the fan-out workflows (tests/testapp/family.py)
    DURABLE_LEASE_SECONDS="5",
    DURABLE_SWEEP_SECONDS="0.5",
    # The library's default (the test settings' 1 s would re-wake a backlog of 1,000 runs again and again).
    DURABLE_TEST_SETTINGS='{"IDLE_RESWEEP_SECONDS": 10.0}',
)

import django  # noqa: E402  (django.utils.timezone below)
import redis  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from durable_agents import api  # noqa: E402
from durable_agents.engine.family import sweep_children  # noqa: E402
from durable_agents.engine.sweep import sweep  # noqa: E402
from durable_agents.models import Event, Run, RunStatus, Wait, WaitKind  # noqa: E402
from durable_agents.testing import WorkerProcess, drive, wait_for  # noqa: E402


def _all_done(ids: list) -> bool:
    return Run.objects.filter(pk__in=ids, status=RunStatus.COMPLETED).count() == len(ids)


def _swept() -> int:
    return Event.objects.filter(kind="swept").count()


def baseline(count: int) -> tuple[float, float, int]:
    swept = _swept()
    began = time.perf_counter()
    ids = [api.start("noop", {"steps": 1}).id for _ in range(count)]
    started = time.perf_counter() - began
    wait_for(lambda: _all_done(ids), timeout=1800, interval=0.1, what="the independent runs")
    return started, time.perf_counter() - began, _swept() - swept


def fan_out(count: int) -> tuple[float, float, int]:
    swept = _swept()
    began = time.perf_counter()
    parent = api.start("fan_noop", {"n": count})
    wait_for(lambda: Event.objects.filter(run_id=parent.id, kind="children_started").exists(), timeout=600)
    spawned = time.perf_counter() - began
    wait_for(lambda: _all_done([parent.id]), timeout=1800, interval=0.1, what="the parent to join its children")
    return spawned, time.perf_counter() - began, _swept() - swept


def sweep_cost(parents: int) -> tuple[float, float, float, float]:
    """(a whole sweep pass with nothing due, the family's share of it, the family's share with every join due, and
    right after), in ms."""
    settings = {"WAKER": "bench.baseline.no_wake", "SWEEP_BATCH": parents}
    with override_settings(DURABLE_AGENTS=settings):
        for _ in range(parents):
            drive(api.start("fan_all", {"items": [{"item": 0, "hold": True}]}).id)  # parks; its child never runs
        assert Wait.objects.open().filter(kind=WaitKind.CHILDREN).count() == parents
        sweep()  # the children never ran: this pass marks them swept
        Wait.objects.open().filter(kind=WaitKind.CHILDREN).update(updated_at=django.utils.timezone.now())
        whole = _timed(sweep)
        share = _timed(sweep_children)
    with override_settings(DURABLE_AGENTS={**settings, "IDLE_RESWEEP_SECONDS": 0}):
        all_due = _timed(sweep_children)
    with override_settings(DURABLE_AGENTS=settings):
        after = _timed(sweep_children)
    return whole, share, all_due, after


def _timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--children", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--parents", type=int, default=1000)
    args = parser.parse_args()
    redis.Redis.from_url(BROKER).flushdb()
    workers = [WorkerProcess(name=f"bench-children-{i}", beat=i == 0, cwd=ROOT).start() for i in range(args.workers)]
    try:
        time.sleep(3)  # the workers connect
        warm = api.start("noop", {"steps": 1})
        wait_for(lambda: _all_done([warm.id]), timeout=120, what="a warm-up run")
        started, independent, swept_baseline = baseline(args.children)
        spawned, joined, swept_fan = fan_out(args.children)
    finally:
        for worker in workers:
            worker.kill()
    print(f"\n{args.children} runs on {args.workers} solo workers (one with beat):")
    print(f"  baseline: {args.children} independent runs by api.start   {independent:8.2f} s", end="")
    print(f"  (starting them {started:.2f} s; runs re-woken by the sweep {swept_baseline})")
    print(f"  one parent spawning and joining {args.children} children    {joined:8.2f} s", end="")
    print(f"  ({joined / independent:.2f}x the baseline; spawn {spawned:.2f} s; re-woken by the sweep {swept_fan})")
    whole, share, all_due, after = sweep_cost(args.parents)
    print(f"\nsweep with {args.parents} parents parked on open joins (each child still running):")
    print(f"  a whole sweep pass, nothing due                       {whole:8.1f} ms")
    print(f"  its child-runs share (no join due for a re-check)     {share:8.1f} ms")
    each = all_due * 1000 / args.parents
    print(f"  child-runs share with every join due (re-checked)     {all_due:8.1f} ms  ({each:.0f} µs a join)")
    print(f"  the pass right after (checked joins wait their turn)  {after:8.1f} ms")


if __name__ == "__main__":
    main()
