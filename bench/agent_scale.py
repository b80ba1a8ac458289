"""A thousand agent conversations in flight on one worker machine, no process or connection held while Claude thinks.

The real Anthropic SDK talks to the shipped fake Messages API, which takes `--latency` seconds per answer. Each run
is one agent step of two model calls (a tool call, then the answer: bench/scale_agent.py). Measured in one run:

* **model worker**: the Procfile's `model_worker` (a gevent pool of `--concurrency` greenlets on the `durable-model`
  queue, `--model-pool threads` for threads; a psycopg pool of `--pool-size` connections) beside one prefork
  process on the default queue for the sweep; `--runs` conversations created, then woken at once;
* **baseline**: the Procfile's prefork `worker` (`--concurrency 4`) serving every step, `--baseline-runs`
  conversations, its time for `--runs` extrapolated from its throughput.

Printed: peak requests in flight at the fake, peak Postgres connections of each worker (pg_stat_activity, by
application_name), the model worker's RSS (idle, peak, per conversation in flight), wall time against the ideal
(2 × latency), and with `--burst-429` the size of each retry wave after the fake answered 429 `retry-after: 5` to
every conversation's first request. Per conversation, from the runs' creation to the last one's end (bench/cpu.py):
CPU ms of the workers' process trees (user + system, the kernel's part apart), of the Postgres backends of this
bench's database (BENCH_DB_NAME) and of the whole server, and Postgres commits (pg_stat_database, each read once every
backend has reported, net of what the idle workers commit). The bench's own polling connections are left out of both.

    python bench/agent_scale.py                      # 1,000 runs × 2 calls of 2 s
    python bench/agent_scale.py --latency 20         # answers of 20 s: how many conversations wait at once
    python bench/agent_scale.py --runs 200 --baseline-runs 20 --latency 1
    python bench/agent_scale.py --burst-429
    python bench/agent_scale.py --model-pool threads   # the same worker on Celery's threads pool
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DB_NAME", "durable_bench_scale")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/12")
MODEL_QUEUE = "durable-model"
STARTERS = 8
PREFORK_CONCURRENCY = 4  # the Procfile's worker
# A backend that went idle less than a second after its last report holds its statistics back for up to ten
# seconds (PostgreSQL's PGSTAT_IDLE_INTERVAL): read the commit counter only once every backend has reported.
STATS_LAG = 11.0
ROOT = prepare(
    DB_NAME,
    BROKER,
    # The effect counter, when the broker is RabbitMQ.
    SCALE_REDIS_URL=os.environ.get("SCALE_REDIS_URL", "redis://127.0.0.1:6379/12"),
    DURABLE_SWEEP_SECONDS="1",
    DURABLE_MODEL_QUEUE=MODEL_QUEUE,
)

import psycopg  # noqa: E402
import redis  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import override_settings  # noqa: E402

from bench.baseline import UNWOKEN  # noqa: E402
from bench.cpu import TICK_MS, Transactions, Usage, Watch, snapshot  # noqa: E402
from bench.scale_agent import WORKFLOW, answer  # noqa: E402
from durable_agents import api, clock  # noqa: E402
from durable_agents.engine.wake import wake  # noqa: E402
from durable_agents.models import FINISHED_RUN_STATUSES, Run, RunStatus, StepKind  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault  # noqa: E402

RUNS = Run._meta.db_table


@dataclass
class Sample:
    """Peaks sampled every 100 ms while a scenario runs."""

    connections: Counter[str] = field(default_factory=Counter)  # application_name → peak connections
    rss_kb: int = 0


class Sampler(threading.Thread):
    """Samples the workers' Postgres connections and RSS, on a connection of its own that the CPU figures leave out
    (`self.watch.pid`) and whose reads are not counted as commits."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.sample = Sample()
        self.stopped = threading.Event()
        self.watch = Watch(psycopg.connect(os.environ["DATABASE_URL"]), DB_NAME)

    def run(self) -> None:
        query = "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s GROUP BY application_name"
        try:
            while not self.stopped.wait(0.1):
                with self.watch.connection.cursor() as cursor:
                    cursor.execute(query, [DB_NAME])
                    for name, count in cursor.fetchall():
                        self.sample.connections[name] = max(self.sample.connections[name], count)
                self.watch.connection.rollback()
                self.sample.rss_kb = max(self.sample.rss_kb, sum(rss_kb(pid) for pid in self.pids))
        finally:
            self.watch.connection.close()


def rss_kb(pid: int) -> int:
    """Resident memory of a process and its children, in KiB (from /proc)."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            continue
    return total


def rest_of_machine() -> dict[str, float]:
    """CPU milliseconds so far of what shares the machine with the workers besides Postgres: Redis, this process (the
    fake Messages API and the starters)."""
    redis_pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdecimal() and (proc / "comm").read_text().startswith("redis"):
                redis_pids.append(int(proc.name))
        except FileNotFoundError:
            continue
    usage = resource.getrusage(resource.RUSAGE_SELF)  # this process's threads only, not its worker children
    return {
        "redis": sum(spent for spent, _ in snapshot(redis_pids).values()) * TICK_MS,
        "fake API + starters": (usage.ru_utime + usage.ru_stime) * 1000,
    }


@functools.cache
def watch() -> Watch:
    """This process's connection for waiting on runs: its reads are neither counted as commits nor measured."""
    return Watch(psycopg.connect(os.environ["DATABASE_URL"]), DB_NAME)


def per_conversation(usage: Usage, commits: float, runs: int, sweeper: int | None = None) -> dict[str, float]:
    """CPU ms and Postgres commits per conversation: the workers' (the sweeper's apart), its database's backends, the
    whole Postgres server, the machine; the total is the workers' and its database's backends'."""
    sweeping = usage.trees_ms.get(sweeper, 0.0) if sweeper else 0.0
    worker = usage.workers_ms - sweeping
    return {
        "worker_ms": worker / runs,
        "system_ms": usage.workers_system_ms / runs,
        "sweeper_ms": sweeping / runs,
        "database_ms": (usage.database_ms or 0.0) / runs,
        "server_ms": (usage.postgres_ms or 0.0) / runs,
        "machine_ms": usage.machine_ms / runs,
        "commits": commits,
        "total_ms": (usage.workers_ms + (usage.database_ms or 0.0)) / runs,
    }


def worker(
    name: str,
    fake: FakeAnthropic,
    *,
    pool: str,
    concurrency: int,
    queues: str,
    app_name: str = "",
    beat: bool = False,
    **env: str,
) -> WorkerProcess:
    log = ROOT / "var" / f"bench-scale-{name}.log"
    log.parent.mkdir(exist_ok=True)
    return WorkerProcess(
        name=name,
        env={**fake.environ(), "DJANGO_DB_APPLICATION_NAME": app_name or name, **env},
        cwd=ROOT,
        pool=pool,
        concurrency=concurrency,
        beat=beat,
        log_path=log,
        extra_args=["--queues", queues, "--include", "bench.scale_agent"],
    )


def model_workers(args: argparse.Namespace, fake: FakeAnthropic) -> list[WorkerProcess]:
    """The Procfile's `model_worker`, `--model-workers` of them (the process type scaled): the model queue only,
    `--model-pool` × `--concurrency` and `--pool-size` connections shared out among them."""
    n = args.model_workers
    return [
        worker(
            f"model_worker-{i}",
            fake,
            pool=args.model_pool,
            concurrency=args.concurrency // n,
            queues=MODEL_QUEUE,
            app_name="model_worker",
            DJANGO_DB_POOL=str(max(args.pool_size // n, 1)),
        ).start()
        for i in range(n)
    ]


def warm_up(model_queue: str, n: int = 1) -> None:
    """`n` conversations at once through the workers before the clock starts: they are up, imported and connected.
    A prefork pool needs one per child (its concurrency): each child imports the SDK and connects on its first."""
    with override_settings(DURABLE_AGENTS={**_durable(), "MODEL_QUEUE": model_queue}):
        run_all(n, f"warm-{model_queue or 'default'}", timeout=120)


def _start_each(order_ids: list[str]) -> list[str]:
    try:
        return [str(api.start(WORKFLOW, {"order_id": order_id}).id) for order_id in order_ids]
    finally:
        connection.close()  # the starter thread's own connection


def run_all(n: int, prefix: str, timeout: float) -> tuple[float, list[str]]:
    """Create `n` runs (from STARTERS threads, unwoken), then wake them all at once: a thousand conversations
    in flight, measured on the workers rather than on how fast this process inserts rows. Waits for all to
    finish: (seconds from the first wake-up, ids)."""
    since = clock.now()
    created = time.monotonic()
    order_ids = [f"{prefix}-{i}" for i in range(n)]
    unwoken = override_settings(DURABLE_AGENTS={**_durable(), **UNWOKEN})
    with unwoken, ThreadPoolExecutor(STARTERS) as starters:
        chunks = starters.map(_start_each, [order_ids[k::STARTERS] for k in range(STARTERS)])
        ids = [i for chunk in chunks for i in chunk]
    started = time.monotonic()
    for run_id in ids:
        wake(run_id, kind=StepKind.AGENT)
    print(
        f"  {n} runs: created in {started - created:.1f} s ({STARTERS} threads), woken in "
        f"{time.monotonic() - started:.2f} s",
        flush=True,
    )
    # Polled cheaply (an index range, not a thousand ids): the poll shares the machine with what it measures.
    finished = [str(status) for status in FINISHED_RUN_STATUSES]
    query = f"SELECT count(*) FROM {RUNS} WHERE workflow = %s AND created_at >= %s AND status = ANY(%s)"
    wait_for(
        lambda: watch().one(query, [WORKFLOW, since, finished])[0] == n,
        timeout=timeout,
        interval=0.5,
        what=f"{n} runs to finish",
    )
    elapsed = time.monotonic() - started
    failed = watch().one(
        f"SELECT count(*) FROM {RUNS} WHERE id = ANY(%s::uuid[]) AND status <> %s",
        [ids, RunStatus.COMPLETED.value],
    )[0]
    if failed:
        raise SystemExit(f"{failed} of {n} runs did not complete; see var/bench-scale-*.log")
    return elapsed, ids


def scenario_model_worker(args: argparse.Namespace, fake: FakeAnthropic) -> dict[str, Any]:
    sweeper = worker("sweeper", fake, pool="prefork", concurrency=1, queues="celery").start()
    models = model_workers(args, fake)
    pids = [model.pid for model in models]
    try:
        warm_up(MODEL_QUEUE)
        idle = sum(rss_kb(pid) for pid in pids)
        ledger = Transactions(watch(), STATS_LAG)
        idle_cpu = ledger.idle([*pids, sweeper.pid])
        machine_before = rest_of_machine()
        sampler = Sampler(pids)
        sampler.start()
        fake.reset_peak()
        with (
            override_settings(DURABLE_AGENTS={**_durable(), "MODEL_QUEUE": MODEL_QUEUE}),
            watch().meter([*pids, sweeper.pid], exclude=[sampler.watch.pid]) as meter,
        ):
            elapsed, _ = run_all(args.runs, "scale", timeout=args.runs * args.latency * 4 + 120)
        machine = {name: after - machine_before[name] for name, after in rest_of_machine().items()}
        sampler.stopped.set()
        sampler.join()
        commits, _ = ledger.per(args.runs)
        peak = fake.peak_in_flight
        return {
            "seconds": elapsed,
            "in_flight": peak,
            "connections": sampler.sample.connections["model_worker"],
            "renewer_connections": sampler.sample.connections["model_worker:lease-renewer"],
            "sweeper_connections": sampler.sample.connections["sweeper"],
            "rss_idle_mb": idle / 1024,
            "rss_peak_mb": sampler.sample.rss_kb / 1024,
            "rss_per_conversation_kb": (sampler.sample.rss_kb - idle) / max(peak, 1),
            "cpu": per_conversation(meter.usage, commits, args.runs, sweeper.pid),
            "idle": {"commits": ledger.rate, **idle_cpu.per(idle_cpu.seconds)},
            "machine": {"postgres (whole server)": meter.usage.postgres_ms or 0.0, **machine},
            "machine_ms": meter.usage.machine_ms,
        }
    finally:
        for model in models:
            model.kill()
        sweeper.kill()


def scenario_baseline(args: argparse.Namespace, fake: FakeAnthropic) -> dict[str, Any]:
    prefork = worker(
        "prefork_worker", fake, pool="prefork", concurrency=PREFORK_CONCURRENCY, queues="celery", DURABLE_MODEL_QUEUE=""
    ).start()
    try:
        warm_up("", PREFORK_CONCURRENCY)
        ledger = Transactions(watch(), STATS_LAG)
        idle = ledger.idle([prefork.pid])
        sampler = Sampler([prefork.pid])
        sampler.start()
        fake.reset_peak()
        with (
            override_settings(DURABLE_AGENTS={**_durable(), "MODEL_QUEUE": ""}),
            watch().meter([prefork.pid], exclude=[sampler.watch.pid]) as meter,
        ):
            elapsed, _ = run_all(args.baseline_runs, "base", timeout=args.baseline_runs * args.latency * 2 + 120)
        sampler.stopped.set()
        sampler.join()
        commits, _ = ledger.per(args.baseline_runs)
        return {
            "seconds": elapsed,
            "in_flight": fake.peak_in_flight,
            "connections": sampler.sample.connections["prefork_worker"],
            "rss_peak_mb": sampler.sample.rss_kb / 1024,
            "cpu": per_conversation(meter.usage, commits, args.baseline_runs),
            "idle": {"commits": ledger.rate, **idle.per(idle.seconds)},
        }
    finally:
        prefork.kill()


def scenario_burst(args: argparse.Namespace, fake: FakeAnthropic) -> list[int]:
    """Every conversation's first request gets 429 retry-after 5: the retries' arrival, second by second. A backoff
    of 5-10 s is longer than MAX_COUNTDOWN_SECONDS: the runs are parked until then, and the sweep (beat, here in the
    sweeper) wakes each when it is due."""
    sweeper = worker("sweeper", fake, pool="prefork", concurrency=1, queues="celery", beat=True).start()
    models = model_workers(args, fake)
    try:
        warm_up(MODEL_QUEUE)
        fake.reset()
        fake.fail_next(args.runs, Fault.status(429, "rate limited", {"retry-after": "5"}))
        with override_settings(DURABLE_AGENTS={**_durable(), "MODEL_QUEUE": MODEL_QUEUE}):
            run_all(args.runs, "burst", timeout=args.runs * args.latency * 4 + 180)
        retries = [r.time for r in fake.requests if r.turn == 0 and r.attempt == 2]
        first = min(r.time for r in fake.requests if r.attempt == 1)
        waves = Counter(int(t - first) for t in retries)
        return [waves.get(second, 0) for second in range(max(waves) + 1)] if waves else []
    finally:
        for model in models:
            model.kill()
        sweeper.kill()


def print_cpu(scale: dict[str, float], base: dict[str, float], label: str) -> None:
    """CPU ms per conversation, from the runs' creation to the last one's end: each side's workers, its database's
    Postgres backends, the whole server; Postgres commits per conversation, net of the idle workers'."""
    print(
        "\nper conversation: CPU ms (user + system, /proc), Postgres commits (pg_stat_database, net of the idle "
        "workers'); Postgres on a shared server: its database's backends, and the whole server (others' work included)"
    )
    print(
        f"{'worker':<44} {'worker':>7} {'system':>7} {'sweeper':>8} {'PG db':>7} {'PG all':>7} {'commits':>8} "
        f"{'total':>7}"
    )
    for name, f in ((label, scale), ("baseline: Procfile worker, prefork ×4", base)):
        print(
            f"{name:<44} {f['worker_ms']:>7.1f} {f['system_ms']:>7.1f} {f['sweeper_ms']:>8.1f} "
            f"{f['database_ms']:>7.1f} {f['server_ms']:>7.1f} {f['commits']:>8.1f} {f['total_ms']:>7.1f}"
        )
    print(
        "worker: the worker processes' trees (system: the kernel's part, the sweeper's included); total: workers + "
        f"sweeper + its database's backends; model worker ÷ baseline, total: {scale['total_ms'] / base['total_ms']:.2f}"
    )


def _durable() -> dict[str, object]:
    from django.conf import settings

    return dict(settings.DURABLE_AGENTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=1000, help="conversations started at once")
    parser.add_argument("--latency", type=float, default=2.0, help="seconds the fake takes per answer")
    parser.add_argument("--concurrency", type=int, default=1000, help="greenlets (threads) of the model worker")
    parser.add_argument("--model-pool", default="gevent", help="the model worker's Celery pool (gevent, threads)")
    parser.add_argument("--model-workers", type=int, default=1, help="model worker processes (sharing the counts)")
    parser.add_argument("--pool-size", type=int, default=16, help="the model worker's Postgres connections")
    parser.add_argument("--baseline-runs", type=int, default=40, help="conversations for the prefork baseline")
    parser.add_argument("--burst-429", action="store_true", help="also measure the retry waves after a 429 burst")
    args = parser.parse_args()
    if BROKER.startswith("redis"):
        redis.Redis.from_url(BROKER).flushdb()
    ideal = 2 * args.latency
    with FakeAnthropic(responder=answer, latency=args.latency) as fake:
        scale = scenario_model_worker(args, fake)
        base = scenario_baseline(args, fake)
        waves = scenario_burst(args, fake) if args.burst_429 else None
    connection.close()

    base_projected = base["seconds"] * args.runs / args.baseline_runs
    print(f"\n{args.runs} agent runs × 2 model calls of {args.latency:g} s (ideal {ideal:g} s), real SDK → fake API")
    print(f"{'worker':<44} {'runs':>5} {'wall s':>8} {'× ideal':>8} {'in flight':>10} {'PG conns':>9} {'RSS MB':>8}")
    label = f"model_worker ×{args.model_workers}: {args.model_pool} ×{args.concurrency}, pool {args.pool_size}"
    print(
        f"{label:<44} {args.runs:>5} "
        f"{scale['seconds']:>8.1f} {scale['seconds'] / ideal:>8.1f} {scale['in_flight']:>10} "
        f"{scale['connections']:>9} {scale['rss_peak_mb']:>8.0f}"
    )
    print(
        f"{'baseline: Procfile worker, prefork ×4':<44} {args.baseline_runs:>5} {base['seconds']:>8.1f} "
        f"{base['seconds'] / ideal:>8.1f} {base['in_flight']:>10} {base['connections']:>9} {base['rss_peak_mb']:>8.0f}"
    )
    print(
        f"\nbaseline projected to {args.runs} runs: {base_projected:.0f} s; model worker "
        f"{base_projected / scale['seconds']:.1f}× faster"
    )
    print(
        f"model worker RSS: {scale['rss_idle_mb']:.0f} MB idle, {scale['rss_peak_mb']:.0f} MB peak, "
        f"{scale['rss_per_conversation_kb']:.0f} KB per conversation in flight; sweeper's PG connections: "
        f"{scale['sweeper_connections']}; lease renewers' connections: {scale['renewer_connections']}"
    )
    print_cpu(scale["cpu"], base["cpu"], label)
    for name, f in (("model worker and sweeper", scale["idle"]), ("prefork baseline", base["idle"])):
        print(
            f"idle, per second ({name}): {f['workers_ms']:.1f} ms workers' CPU, {f['database_ms']:.1f} ms its "
            f"database's backends, {f['commits']:.1f} commits"
        )
    shares = ", ".join(f"{name} {ms / 1000:.1f} s" for name, ms in scale["machine"].items())
    print(
        f"CPU of the rest of the machine over the model worker's {scale['seconds']:.0f} s (2 cores, shared with "
        f"others' work): {shares}; every process {scale['machine_ms'] / 1000:.1f} s"
    )
    if waves is not None:
        print("\nretries after a 429 (retry-after: 5) to every first request, per second since the burst:")
        print("  " + " ".join(f"{n}" for n in waves))
        print(f"  largest wave {max(waves, default=0)} of {args.runs}; none before second 5: {sum(waves[:5]) == 0}")


if __name__ == "__main__":
    main()
