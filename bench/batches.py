"""Half-price turns at scale: a thousand two-turn conversations with `delivery="batch"`, parked holding nothing.

The conversation is bench/scale_agent.py's (one agent step: the model asks for `look_up_order`, the tool answers,
the model answers in text — two model calls), its model the real Anthropic SDK against the shipped fake Messages
API, whose Message Batches end `--processing` seconds after they are created. The workers are the Procfile's:
`model_worker` (gevent × `--greenlets` on the `durable-model` queue, a psycopg pool of `--pool-size`) and one
prefork process on the default queue with beat, which runs the sweep and the batcher it sends
(`durable_agents.batches`). Batches go out every BATCH_WINDOW_SECONDS (`--window`) and are polled from
BATCH_POLL_SECONDS (`--poll`), at most every BATCH_POLL_MAX_SECONDS (`--poll-max`).

Measured in one run, in order:

1. **live**: `--runs` runs of the conversation answered live (the fake takes `--latency` s an answer): the price
   the ledger charges for them, and their wall time;
2. **batch**: `--runs` runs of the same conversation, `delivery="batch"`: each call queued, sent in a batch, the run
   parked on a batch wait until the batch ends and its result is recorded, twice.

Printed: batches submitted (the ledger's MessageBatch rows and the fake's creates), the most runs parked at once
(status waiting, sampled every 0.5 s), and how many runs held a lease or ran while that many were parked (worker
slots held while parked: 0 expected), the peak Postgres connections by application (pg_stat_activity), wall
time, and the ledger's cost (sum of Run.cost_usd) of the batch runs beside the live ones (the goal: ≤ 0.52×).
Nothing is asserted; the bench exits 1 only if a run did not complete.

    python bench/batches.py                         # 1,000 runs, batches processing 60 s
    python bench/batches.py --runs 200 --processing 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DB_NAME", "durable_bench_batches")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13")
MODEL_QUEUE = "durable-model"
STARTERS = 8
# bench/delays_settings.py: the example project's settings, DURABLE_AGENTS updated from BENCH_DURABLE_AGENTS (the
# batch knobs, given to the workers in main).
ROOT = prepare(
    DB_NAME,
    BROKER,
    DJANGO_SETTINGS_MODULE="bench.delays_settings",
    DURABLE_SWEEP_SECONDS="1",
    DURABLE_MODEL_QUEUE=MODEL_QUEUE,
)

import redis  # noqa: E402
from django.db import connection, connections  # noqa: E402
from django.db.models import Sum  # noqa: E402

from bench.scale_agent import BATCHED_WORKFLOW, WORKFLOW, answer  # noqa: E402
from durable_agents import api, clock  # noqa: E402
from durable_agents.models import FINISHED_RUN_STATUSES, MessageBatch, Run, RunStatus  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic  # noqa: E402


@dataclass
class Peaks:
    connections: Counter[str] = field(default_factory=Counter)  # application_name → peak connections
    parked: int = 0  # runs waiting at once
    held_while_parked: int = 0  # runs running or holding a lease at the sample where most were parked
    held_while_all_parked: int | None = None  # the most such runs at any sample where every run was parked


class Sampler(threading.Thread):
    """Every 0.5 s: Postgres connections of this bench's database, and the batched runs parked or holding a lease."""

    def __init__(self, workflow: str, runs: int) -> None:
        super().__init__(daemon=True)
        self.workflow = workflow
        self.runs = runs
        self.peaks = Peaks()
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.5):
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s "
                        "GROUP BY application_name",
                        [DB_NAME],
                    )
                    for name, count in cursor.fetchall():
                        self.peaks.connections[name or "bench"] = max(self.peaks.connections[name or "bench"], count)
                    cursor.execute(
                        "SELECT count(*) FILTER (WHERE status = 'waiting'), "
                        "count(*) FILTER (WHERE status = 'running' OR lease_owner <> '') "
                        "FROM durable_agents_run WHERE workflow = %s",
                        [self.workflow],
                    )
                    parked, held = cursor.fetchone()
                if parked > self.peaks.parked:
                    self.peaks.parked, self.peaks.held_while_parked = parked, held
                if parked == self.runs:
                    self.peaks.held_while_all_parked = max(self.peaks.held_while_all_parked or 0, held)
        finally:
            connections.close_all()

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.join()


@dataclass
class Cohort:
    seconds: float
    cost: Decimal
    peaks: Peaks


def run_cohort(workflow: str, n: int, prefix: str, timeout: float) -> Cohort:
    """Start `n` runs of `workflow` (STARTERS threads, each woken as it starts); wait for all to finish."""

    def start_each(order_ids: list[str]) -> None:
        try:
            for order_id in order_ids:
                api.start(workflow, {"order_id": order_id})
        finally:
            connection.close()  # the starter thread's own connection

    order_ids = [f"{prefix}-{i}" for i in range(n)]
    these = Run.objects.filter(workflow=workflow, created_at__gte=clock.now())
    with Sampler(workflow, n) as sampler:
        began = time.monotonic()
        with ThreadPoolExecutor(STARTERS) as pool:
            list(pool.map(start_each, [order_ids[k::STARTERS] for k in range(STARTERS)]))
        print(f"  {n} runs started in {time.monotonic() - began:.1f} s ({load()})", flush=True)
        wait_for(
            lambda: these.filter(status__in=FINISHED_RUN_STATUSES).count() == n,
            timeout=timeout,
            interval=1.0,
            what=f"{n} runs of {workflow} to finish",
        )
        seconds = time.monotonic() - began
    failed = these.exclude(status=RunStatus.COMPLETED).count()
    if failed:
        raise SystemExit(f"{failed} of {n} runs of {workflow} did not complete; see var/bench-batches-*.log")
    cost = these.aggregate(total=Sum("cost_usd"))["total"] or Decimal(0)
    return Cohort(seconds=seconds, cost=cost, peaks=sampler.peaks)


def worker(name: str, fake: FakeAnthropic, *, pool: str, concurrency: int, queues: str, **kw: Any) -> WorkerProcess:
    log = ROOT / "var" / f"bench-batches-{name}.log"
    log.parent.mkdir(exist_ok=True)
    env = {
        **fake.environ(),
        "DJANGO_DB_APPLICATION_NAME": name,
        "DURABLE_VAR_DIR": str(ROOT / "var"),  # beat's schedule file there, not in a /tmp other benches share
        **kw.pop("env", {}),
    }
    return WorkerProcess(
        name=name,
        env=env,
        cwd=ROOT,
        app="project",  # the example project's Celery app, on bench.delays_settings
        pool=pool,
        concurrency=concurrency,
        log_path=log,
        extra_args=["--queues", queues, "--include", "bench.scale_agent"],
        **kw,
    ).start()


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="conversations of each cohort (live, batch)")
    parser.add_argument("--processing", type=float, default=60.0, help="seconds a fake Message Batch processes")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds the fake takes per live answer")
    parser.add_argument("--window", type=float, default=2.0, help="BATCH_WINDOW_SECONDS")
    parser.add_argument("--poll", type=float, default=5.0, help="BATCH_POLL_SECONDS")
    parser.add_argument("--poll-max", type=float, default=10.0, help="BATCH_POLL_MAX_SECONDS")
    parser.add_argument("--greenlets", type=int, default=1000, help="the model worker's gevent concurrency")
    parser.add_argument("--pool-size", type=int, default=16, help="the model worker's Postgres connections")
    args = parser.parse_args()
    knobs = {
        "BATCH_WINDOW_SECONDS": args.window,
        "BATCH_POLL_SECONDS": args.poll,
        "BATCH_POLL_MAX_SECONDS": args.poll_max,
    }
    redis.Redis.from_url(BROKER).flushdb()
    timeout = args.runs * args.latency * 4 + args.processing * 10 + 600

    with FakeAnthropic(responder=answer, latency=args.latency, batch_processing_seconds=args.processing) as fake:
        env = {"BENCH_DURABLE_AGENTS": json.dumps(knobs)}
        sweeper = worker("batches_sweeper", fake, pool="prefork", concurrency=1, queues="celery", beat=True, env=env)
        models = worker(
            "model_worker",
            fake,
            pool="gevent",
            concurrency=args.greenlets,
            queues=MODEL_QUEUE,
            env={"DJANGO_DB_POOL": str(args.pool_size), **env},
        )
        try:
            run_cohort(WORKFLOW, 1, "warm", timeout=120)  # the workers up, imported and connected
            print(f"live: {args.runs} runs, answers of {args.latency:g} s ({load()})", flush=True)
            asked = len(fake.requests)
            # The same orders in both cohorts: the same prompts, so the same tokens, at two prices.
            live = run_cohort(WORKFLOW, args.runs, "order", timeout)
            live_requests = len(fake.requests) - asked
            print(f"  done in {live.seconds:.1f} s ({load()})", flush=True)
            print(
                f"batch: {args.runs} runs, batches of {args.processing:g} s, window {args.window:g} s, "
                f"polls from {args.poll:g} s ({load()})",
                flush=True,
            )
            batch = run_cohort(BATCHED_WORKFLOW, args.runs, "order", timeout)
            print(f"  done in {batch.seconds:.1f} s ({load()})", flush=True)
            creates = fake.batch_creates
            answered = fake.batch_requests_answered
        finally:
            models.kill()
            sweeper.kill()
    batches = MessageBatch.objects.count()
    sizes = sorted(MessageBatch.objects.values_list("request_count", flat=True))
    connection.close()

    live_cost = live.cost

    def conns(peaks: Counter[str]) -> str:
        return ", ".join(f"{name} {count}" for name, count in sorted(peaks.items()))

    print(
        f"\n{args.runs} two-turn runs of bench/scale_agent.py's conversation (the model asks for look_up_order, "
        "then answers), real SDK → fake Messages API"
    )
    print(f"batches submitted:            {batches} (the fake created {creates}); requests each: {sizes}")
    print(f"batched requests answered:    {answered} (2 a run: {2 * args.runs})")
    print(f"runs parked at once (peak):   {batch.peaks.parked} of {args.runs}")
    print(
        f"worker slots held while parked: {batch.peaks.held_while_parked} runs running or leased at that peak; "
        f"while all {args.runs} were parked: "
        + ("never all at once" if batch.peaks.held_while_all_parked is None else str(batch.peaks.held_while_all_parked))
    )
    print(f"PG connections at peak, batch: {conns(batch.peaks.connections)}")
    print(f"PG connections at peak, live:  {conns(live.peaks.connections)}")
    print(
        f"wall time:                    batch {batch.seconds:.1f} s (2 batches of {args.processing:g} s a run); "
        f"live {live.seconds:.1f} s ({live_requests} requests of {args.latency:g} s)"
    )
    ratio = batch.cost / live_cost if live_cost else Decimal(0)
    print(
        f"ledger cost (sum of Run.cost_usd): batch ${batch.cost:.4f}, live ${live_cost:.4f} → "
        f"{ratio:.3f}× live (goal ≤ 0.52×)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
