"""Overload: does a saturated model worker keep its throughput, and does the sweep keep its wake-ups in check?

The real Anthropic SDK talks to the shipped fake Messages API, which takes `--latency` seconds per answer; each run is
one agent step of two model calls (bench/scale_agent.py). One model worker (the Procfile's: gevent ×`--concurrency`,
a psycopg pool of `--pool-size` connections) serves them, beside one prefork worker running beat's sweep every
second with the library's default IDLE_RESWEEP_SECONDS (10 s). Measured in one run:

* **at capacity** (the baseline): `--waves` × concurrency runs started at once — each waits for a slot less than
  IDLE_RESWEEP_SECONDS, so the sweep has nothing to re-wake;
* **overload**: `--overload` times as many, started at once — most wait for a slot much longer than
  IDLE_RESWEEP_SECONDS, where the sweep used to add a wake-up per run every 10 s.

Printed: throughput (runs completed per second) of each and their ratio, wake-ups the sweep sent per run (its
`swept` events), the model worker's queue depth at its peak (`durable_agents.broker`), health's verdict while the
queue was deep, and the errors in the model worker's log: pool timeouts ("couldn't get a connection") and failed
acks ("Couldn't ack").

    python bench/overload.py                                    # 8 greenlets, 3 waves, 3× overload
    python bench/overload.py --concurrency 16 --pool-size 4 --latency 1

BENCH_DB_NAME names its database (default `durable_bench_overload`, dropped and created) and BENCH_BROKER_URL its
Redis database (default DB 11, emptied). Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DB_NAME", "durable_bench_overload")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/11")
MODEL_QUEUE = "durable-model"
STARTERS = 4
ROOT = prepare(
    DB_NAME,
    BROKER,
    SCALE_REDIS_URL=BROKER if BROKER.startswith("redis") else "redis://127.0.0.1:6379/11",
    DURABLE_LOG_LEVEL="WARNING",
    DURABLE_SWEEP_SECONDS="1",
    DURABLE_MODEL_QUEUE=MODEL_QUEUE,
)

import redis  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import override_settings  # noqa: E402

from bench.baseline import UNWOKEN  # noqa: E402
from bench.scale_agent import WORKFLOW, answer  # noqa: E402
from durable_agents import api, broker, clock  # noqa: E402
from durable_agents.engine.wake import wake  # noqa: E402
from durable_agents.health import system_health  # noqa: E402
from durable_agents.models import FINISHED_RUN_STATUSES, Event, Run, RunStatus, StepKind  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic  # noqa: E402

LOGS = ROOT / "var"
ERRORS = {"pool timeouts": "couldn't get a connection", "failed acks": "Couldn't ack", "tracebacks": "Traceback"}


def worker(name: str, fake: FakeAnthropic, *, pool: str, concurrency: int, queues: str, **env: str) -> WorkerProcess:
    LOGS.mkdir(exist_ok=True)
    return WorkerProcess(
        name=name,
        env={**fake.environ(), "DJANGO_DB_APPLICATION_NAME": name, **env},
        cwd=ROOT,
        pool=pool,
        concurrency=concurrency,
        beat=name == "sweeper",
        log_path=LOGS / f"bench-overload-{name}.log",
        extra_args=["--queues", queues, "--include", "bench.scale_agent"],
    ).start()


def _durable() -> dict[str, object]:
    from django.conf import settings

    return dict(settings.DURABLE_AGENTS)  # MODEL_QUEUE from DURABLE_MODEL_QUEUE


def _start_each(order_ids: list[str]) -> list[str]:
    try:
        return [str(api.start(WORKFLOW, {"order_id": order_id}).id) for order_id in order_ids]
    finally:
        connection.close()


class DepthWatch(threading.Thread):
    """Samples the model queue's depth every half second; keeps the peak and health's verdict at that peak."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.verdict = ""
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(0.5):
                depth = (broker.queue_depths([MODEL_QUEUE]) or {}).get(MODEL_QUEUE, 0)
                if depth >= self.peak:
                    self.peak = depth
                    self.verdict = system_health(count_by_status=False).verdict
        finally:
            connection.close()


def run_wave(n: int, prefix: str, timeout: float) -> dict[str, float]:
    """Create `n` runs unwoken, wake them all at once, wait for all: throughput and the sweep's re-wakes."""
    since = clock.now()
    order_ids = [f"{prefix}-{i}" for i in range(n)]
    unwoken = override_settings(DURABLE_AGENTS={**_durable(), **UNWOKEN})
    with unwoken, ThreadPoolExecutor(STARTERS) as starters:
        ids = [
            i for chunk in starters.map(_start_each, [order_ids[k::STARTERS] for k in range(STARTERS)]) for i in chunk
        ]
    watch = DepthWatch()
    watch.start()
    began = time.monotonic()
    for run_id in ids:
        wake(run_id, kind=StepKind.AGENT)
    these = Run.objects.filter(workflow=WORKFLOW, created_at__gte=since)
    wait_for(
        lambda: these.filter(status__in=FINISHED_RUN_STATUSES).count() == n, timeout=timeout, interval=0.5, what=prefix
    )
    elapsed = time.monotonic() - began
    watch.stopped.set()
    watch.join()
    incomplete = Run.objects.filter(pk__in=ids).exclude(status=RunStatus.COMPLETED).count()
    swept = Event.objects.filter(run_id__in=ids, kind="swept").count()
    return {
        "runs": n,
        "seconds": elapsed,
        "throughput": n / elapsed,
        "swept_per_run": swept / n,
        "incomplete": incomplete,
        "peak_depth": watch.peak,
        "verdict": watch.verdict,
    }


def log_errors(name: str) -> dict[str, int]:
    text = (LOGS / f"bench-overload-{name}.log").read_text(errors="replace")
    return {label: text.count(needle) for label, needle in ERRORS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8, help="greenlets of the model worker")
    parser.add_argument("--pool-size", type=int, default=4, help="the model worker's Postgres connections")
    parser.add_argument("--latency", type=float, default=1.0, help="seconds the fake takes per answer")
    parser.add_argument("--waves", type=int, default=3, help="runs at capacity: this many times the concurrency")
    parser.add_argument("--overload", type=float, default=3.0, help="the overload: this many times capacity's runs")
    args = parser.parse_args()
    if BROKER.startswith("redis"):
        redis.Redis.from_url(BROKER).flushdb()
    capacity_runs = args.waves * args.concurrency
    overload_runs = int(capacity_runs * args.overload)
    per_run = 2 * args.latency
    with FakeAnthropic(responder=answer, latency=args.latency) as fake:
        sweeper = worker("sweeper", fake, pool="prefork", concurrency=1, queues="celery")
        model = worker(
            "model_worker",
            fake,
            pool="gevent",
            concurrency=args.concurrency,
            queues=MODEL_QUEUE,
            DJANGO_DB_POOL=str(args.pool_size),
        )
        try:
            run_wave(1, "warm", timeout=120)
            ideal = args.concurrency / per_run
            print(f"ideal throughput: {ideal:.2f} runs/s ({args.concurrency} slots, {per_run:g} s a run)", flush=True)
            capacity = run_wave(capacity_runs, "capacity", timeout=capacity_runs * per_run * 4 + 120)
            print(f"  at capacity: {capacity}", flush=True)
            overload = run_wave(overload_runs, "overload", timeout=overload_runs * per_run * 4 + 120)
            print(f"  overload: {overload}", flush=True)
        finally:
            model.kill()
            sweeper.kill()
    connection.close()
    errors = log_errors("model_worker")

    print(
        f"\nmodel worker: gevent ×{args.concurrency}, {args.pool_size} connections; 2 model calls of {args.latency:g} s"
    )
    print(f"{'load':<28} {'runs':>6} {'wall s':>8} {'runs/s':>8} {'re-wakes/run':>13} {'peak queue':>11}")
    for label, r in ((f"at capacity ({args.waves} waves)", capacity), (f"{args.overload:g}× overload", overload)):
        print(
            f"{label:<28} {r['runs']:>6} {r['seconds']:>8.1f} {r['throughput']:>8.2f} "
            f"{r['swept_per_run']:>13.2f} {r['peak_depth']:>11}"
        )
    print(
        f"\nthroughput at {args.overload:g}× overload / at capacity: "
        f"{overload['throughput'] / capacity['throughput']:.2f}"
    )
    print(f"runs not completed: {capacity['incomplete'] + overload['incomplete']}")
    print(f"model worker log: {', '.join(f'{k} {v}' for k, v in errors.items())}")
    print(f"health at the overload's peak queue: {overload['verdict']}")


if __name__ == "__main__":
    main()
