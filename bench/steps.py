"""Step cost: sequential durable no-op steps and one-step-run throughput, beside raw Celery and DBOS.

    python bench/steps.py [--steps 500] [--runs 500] [--workers 2] [--threads 4] [--slice-ms 100] [--dbos | --no-dbos]
                          [--tracing-only | --no-tracing] [--tracing-rounds 2]

Needs Postgres and Redis (scripts/test starts them). Prints figures and ratios; asserts nothing.
Both sides use the same broker, worker pool and Celery settings (acks_late, prefetch 1), measured in the
same run. The durable side runs twice, with eager continuation (EAGER_SLICE_MS=--slice-ms: a worker runs a
run's next steps itself) and without (0: one step per task, a broker hop per step). BENCH_DATABASE and
BENCH_BROKER_URL name the database (dropped and created) and the Redis database (emptied) it uses, BENCH_REDIS_URL
the Redis database of the raw tasks' counters (bench/baseline.py).

Measured for each side: a sequential no-op step (wall ms; CPU ms of the workers, of the Postgres backends of its
database and of the whole server; Postgres transactions) and one-step runs started one per transaction, as a web
request would start one, Django's request_started and its connection health check included (runs/s; CPU ms per run
of the starting thread, the workers and Postgres), the same from --threads threads at once, as a web server's
request threads would (bench/starters.py: each thread's connection is made before the clock starts, on both sides),
then one-step runs all started in one transaction (runs/s, CPU per run). CPU comes from /proc (bench/cpu.py): user +
system time of the workers' process trees (pool children and those they reaped included), of the database's backends
(named in their process titles) and of the postmaster's tree; the bench's own waiting connection is left out.
Transactions are pg_stat_database commits (its reads are rolled back), each read once every backend has reported,
net of what the idle workers commit (measured first, over STATS_LAG seconds): heartbeats and lease renewals, DBOS's
queue polls. The server's and the machine's figures include whatever else runs there.

DBOS Transact runs in the same run when bench/.venv-dbos exists (--dbos creates it with bench/dbos_env.sh,
--no-dbos skips it): bench/dbos_steps.py, in that virtualenv, measures the same N steps and M one-step
workflows through a DBOS queue served by --workers DBOS processes, on its own database BENCH_DATABASE_dbos;
its CPU is its executor processes', and its database's backends and the same server's over its own intervals.
The ratios durable/DBOS print beside the goals of issue 17: a step no slower than DBOS's, one-step runs at
2.5 times DBOS's queued workflows/s.

Tracing's cost per step (`DURABLE_AGENTS["TRACING"]`): the same sequential no-op steps on workers with tracing
off, on with the SDK's in-memory exporter (SimpleSpanProcessor: each span exported as it ends, in the step's
thread) and on with a BatchSpanProcessor and the OTLP/HTTP exporter sending to a receiver in this process (an
http.server answering 200 to POST /v1/traces and counting the spans it is sent). bench/tracing_settings.py sets up
each worker's SDK. The modes alternate for --tracing-rounds rounds and the best of each is printed, with its ratio to
off: noise on a shared machine only ever adds time. Then the same in this process, without broker or worker (one
`advance()` a step, the provider's processor switched between modes), and a step's span alone in a loop.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import threading
import time
import uuid
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench")
BROKER = os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/14")
# A backend that went idle less than a second after its last report holds its statistics back for up to ten
# seconds (PostgreSQL's PGSTAT_IDLE_INTERVAL): read the counters only once every backend has reported.
STATS_LAG = 11.0
ROOT = prepare(DB_NAME, BROKER)
DBOS_PYTHON = ROOT / "bench" / ".venv-dbos" / "bin" / "python"

import psycopg  # noqa: E402
import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from django.db import close_old_connections, connection, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from bench.baseline import _redis, hop, noop  # noqa: E402
from bench.cpu import Transactions, Usage, Watch  # noqa: E402
from bench.starters import Starters  # noqa: E402
from bench.steps_report import print_cpu, print_table  # noqa: E402
from durable_agents import api, tracing  # noqa: E402
from durable_agents.engine.advance import advance  # noqa: E402
from durable_agents.models import Run, RunStatus  # noqa: E402
from durable_agents.testing import WorkerProcess, wait_for  # noqa: E402

RUNS = Run._meta.db_table
COMPLETED = RunStatus.COMPLETED.value
SPANS_TIMED = 20_000
TRACING_MODES = {
    "off": "tracing off",
    "memory": "on, in-memory exporter (SimpleSpanProcessor)",
    "otlp": "on, OTLP/HTTP exporter (BatchSpanProcessor)",
}


@functools.cache
def watch() -> Watch:
    """This process's connection for waiting on runs: its reads are neither counted as commits nor measured."""
    return Watch(psycopg.connect(os.environ["DATABASE_URL"]), DB_NAME)


def start_workers(n: int, slice_ms: int, env: dict[str, str] | None = None) -> list[WorkerProcess]:
    workers = [
        WorkerProcess(
            name=f"bench-{i}",
            app="project",
            log_path=os.environ.get("BENCH_WORKER_LOG") or None,
            env={"DURABLE_EAGER_SLICE_MS": str(slice_ms), **(env or {})},
            extra_args=["--include", "bench.baseline"],
            cwd=ROOT,
        ).start()
        for i in range(n)
    ]
    # Warm up: one hop through each worker so imports and connections are made before timing.
    key = f"warm-{uuid.uuid4()}"
    for _ in range(n * 4):
        noop.delay(key)
    try:
        wait_for(lambda: int(_redis.get(key) or 0) >= n * 4, timeout=60, what="workers to start")
    except TimeoutError:
        for worker in workers:
            worker.stop()
        raise
    return workers


def raw_sequential(steps: int, pids: list[int]) -> tuple[float, Usage]:
    """Seconds per hop of a chain of `steps` raw Celery no-op hops, and the CPU the chain took."""
    key = f"hop-{uuid.uuid4()}"
    with watch().meter(pids) as meter:
        began = time.time()
        hop.delay(steps, key)
        wait_for(lambda: _redis.get(key), timeout=600, interval=0.01, what="the hop chain")
    return (float(_redis.get(key)) - began) / steps, meter.usage


def durable_step(steps: int) -> float:
    """Seconds per step of one run of `steps` sequential no-op steps, from its creation to its completion."""
    query = f"SELECT created_at, finished_at FROM {RUNS} WHERE id = %s AND status = %s"
    run = api.start("noop", {"steps": steps})
    created, finished = wait_for(
        lambda: watch().one(query, [run.id, COMPLETED]),
        timeout=600,
        interval=0.01,
        what="the durable run",
    )
    return (finished - created).total_seconds() / steps


def wait_completed(ids: list[Any], what: str) -> datetime:
    """Wait until every run of `ids` has completed; when the last one did."""
    query = f"SELECT count(*), max(finished_at) FROM {RUNS} WHERE id = ANY(%s) AND status = %s"
    count, last = wait_for(
        lambda: (row := watch().one(query, [ids, COMPLETED]))[0] == len(ids) and row,
        timeout=600,
        interval=0.05,
        what=what,
    )
    return last


def raw_throughput(runs: int, pids: list[int]) -> dict[str, float | None]:
    """Raw Celery no-op tasks sent one by one from this process: tasks/s, the sender's and the rest's CPU per task."""
    key = f"noop-{uuid.uuid4()}"
    with watch().meter(pids) as meter:
        began, thread = time.monotonic(), time.thread_time()
        for _ in range(runs):
            noop.delay(key)
        sent = time.thread_time() - thread
        wait_for(lambda: int(_redis.get(key) or 0) >= runs, timeout=600, interval=0.01, what="raw tasks")
        tps = runs / (time.monotonic() - began)
    return {"tps": tps, "starter_ms": sent * 1000 / runs, **meter.usage.per(runs)}


def start_in_a_request() -> Any:
    """`api.start` of a one-step run as a view calls it: Django's `request_started` first closes an obsolete
    connection and, with CONN_HEALTH_CHECKS (the example project's), has the request's first query check the kept
    one (a `SELECT 1`), as DBOS's client pings each pooled connection it takes (`pool_pre_ping`)."""
    close_old_connections()
    return api.start("noop", {"steps": 1}).id


def one_per_transaction(runs: int, pids: list[int]) -> dict[str, float | None]:
    """One-step runs started one by one, each in its own transaction as a web request would: runs/s from the first
    start to the last completion, the starting thread's CPU per run (api.start) and the rest's."""
    began = time.time()
    with watch().meter(pids) as meter:
        thread = time.thread_time()
        ids = [start_in_a_request() for _ in range(runs)]
        started = time.thread_time() - thread
        last = wait_completed(ids, "durable one-step runs, one per transaction")
    return {"tps": runs / (last.timestamp() - began), "starter_ms": started * 1000 / runs, **meter.usage.per(runs)}


def raw_from_threads(runs: int, threads: int, pids: list[int]) -> dict[str, float | None]:
    """Raw Celery no-op tasks sent from `threads` threads at once: tasks/s, the senders' and the rest's CPU per task."""
    key = f"noop-{uuid.uuid4()}"
    with Starters(threads) as starters, watch().meter(pids) as meter:
        began = time.monotonic()
        starters.run(runs, lambda i: noop.delay(key))
        wait_for(lambda: int(_redis.get(key) or 0) >= runs, timeout=600, interval=0.01, what="raw tasks")
        tps = runs / (time.monotonic() - began)
    return {"tps": tps, "starter_ms": starters.cpu * 1000 / runs, **meter.usage.per(runs)}


def from_threads(runs: int, threads: int, pids: list[int]) -> dict[str, float | None]:
    """One-step runs started one per transaction from `threads` threads at once, as a web server's request threads
    would: runs/s from the first start to the last completion, the threads' CPU per run and the rest's."""
    connect, disconnect = lambda: connection.ensure_connection(), lambda: connection.close()
    with Starters(threads, connect, disconnect) as starters, watch().meter(pids) as meter:
        began = time.time()
        ids = starters.run(runs, lambda i: start_in_a_request())
        last = wait_completed(ids, f"durable one-step runs, one per transaction from {threads} threads")
    return {"tps": runs / (last.timestamp() - began), "starter_ms": starters.cpu * 1000 / runs, **meter.usage.per(runs)}


def throughput(runs: int, pids: list[int]) -> tuple[float, dict[str, float | None], float]:
    """One-step runs all started in one transaction: runs/s, CPU per run, and api.start()s per second."""
    # All runs are created in one transaction, so their wake-ups go out together on commit and the
    # figure measures the workers, not this process's start() loop (reported separately).
    query = f"SELECT count(*) FROM {RUNS} WHERE id = ANY(%s) AND status = %s"
    with watch().meter(pids) as meter:
        made, thread = time.monotonic(), time.thread_time()
        with transaction.atomic():
            ids = [api.start("noop", {"steps": 1}).id for _ in range(runs)]
            began = time.monotonic()
        started = time.thread_time() - thread
        wait_for(
            lambda: watch().one(query, [ids, COMPLETED])[0] == runs,
            timeout=600,
            interval=0.05,
            what="durable one-step runs",
        )
        durable = runs / (time.monotonic() - began)
    return durable, {"starter_ms": started * 1000 / runs, **meter.usage.per(runs)}, runs / (began - made)


def statements_per_step() -> int:
    run = api.start("noop", {"steps": 3})
    Run.objects.filter(pk=run.id).update(status="running")  # keep workers out: claim it here
    Run.objects.filter(pk=run.id).update(status="pending")
    advance(run.id)
    with CaptureQueriesContext(connection) as queries:
        advance(run.id)
    return len(queries.captured_queries)


def measure(workers: int, slice_ms: int, steps: int, runs: int, threads: int) -> dict[str, Any]:
    """Both sides' figures with the durable workers' EAGER_SLICE_MS at `slice_ms`."""
    redis.Redis.from_url(BROKER).flushdb()
    started = start_workers(workers, slice_ms)
    pids = [worker.pid for worker in started]
    try:
        raw_hop, raw_cpu = raw_sequential(steps, pids)
        ledger = Transactions(watch(), STATS_LAG)
        idle = ledger.idle(pids)
        with watch().meter(pids) as meter:
            step = durable_step(steps)
        xacts, sessions = ledger.per(steps)
        each = one_per_transaction(runs, pids)
        each["xacts"], _ = ledger.per(runs)
        threaded = from_threads(runs, threads, pids)
        threaded["xacts"], _ = ledger.per(runs)
        raw_each = raw_throughput(runs, pids)
        raw_threaded = raw_from_threads(runs, threads, pids)
        tps, batch, starts = throughput(runs, pids)
    finally:
        for worker in started:
            worker.stop()
    return {
        "raw_hop": raw_hop,
        "step": step,
        "xacts": xacts,
        "sessions": sessions,
        "raw_tps": raw_each["tps"],
        "tps": tps,
        "raw_threaded_tps": raw_threaded["tps"],
        "threaded_tps": threaded["tps"],
        "threads": threads,
        "starts": starts,
        "cpu": {
            "raw": {
                "step": {"wall_ms": raw_hop * 1000, **raw_cpu.per(steps)},
                "each": raw_each,
                "threads": raw_threaded,
            },
            "durable": {
                "step": {"wall_ms": step * 1000, "xacts": xacts, **meter.usage.per(steps)},
                "each": each,
                "threads": threaded,
                "batch": {"tps": tps, **batch},
                "idle": {"xacts": ledger.rate, **idle.per(idle.seconds)},
            },
        },
    }


def measure_dbos(workers: int, steps: int, runs: int, threads: int, create: bool) -> dict[str, Any] | str:
    """DBOS's figures from bench/dbos_steps.py in its own virtualenv, or why there are none."""
    if create and not DBOS_PYTHON.exists():
        subprocess.run([ROOT / "bench" / "dbos_env.sh"], check=True)
    if not DBOS_PYTHON.exists():
        return "not measured: bench/.venv-dbos is missing (run with --dbos to create it)"
    command = [str(DBOS_PYTHON), str(ROOT / "bench" / "dbos_steps.py"), "--database", f"{DB_NAME}_dbos"]
    command += ["--steps", str(steps), "--runs", str(runs), "--workers", str(workers), "--lag", str(STATS_LAG)]
    command += ["--threads", str(threads)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        return f"not measured: bench/dbos_steps.py exited {done.returncode}\n{done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


class OtlpReceiver:
    """A local OTLP/HTTP trace receiver: 200 to each POST /v1/traces, counting the requests and the spans."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests = self.spans = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest.FromString(body)
                    receiver.requests += 1
                    receiver.spans += sum(
                        len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans
                    )
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def tracing_overhead(workers: int, slice_ms: int, steps: int, rounds: int) -> tuple[dict[str, float], OtlpReceiver]:
    """Seconds per sequential step with tracing off, in memory and to OTLP: the best of `rounds` alternating runs."""
    receiver = OtlpReceiver()
    best: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for mode in TRACING_MODES:
                redis.Redis.from_url(BROKER).flushdb()
                env = {
                    "DJANGO_SETTINGS_MODULE": "bench.tracing_settings",
                    "BENCH_TRACING": mode,
                    "BENCH_OTLP_ENDPOINT": receiver.url,
                }
                started = start_workers(workers, slice_ms, env)
                try:
                    took = durable_step(steps)
                finally:
                    for worker in started:
                        worker.stop()  # a warm shutdown: the batch processor sends what it still holds
                best[mode] = min(took, best.get(mode, took))
    except BaseException:
        receiver.close()
        raise
    return best, receiver


def tracing_in_process(steps: int, rounds: int, receiver_url: str) -> dict[str, float]:
    """Seconds per `advance()` in this process, without broker or worker: what a span adds to a step's own work.

    One tracer provider serves every mode (the API takes one per process); its processor is switched between modes.
    """
    from django.test import override_settings
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class Switch(SpanProcessor):
        def __init__(self) -> None:
            self.active: SpanProcessor | None = None

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            if self.active is not None:
                self.active.on_start(span, parent_context)

        def on_end(self, span: Any) -> None:
            if self.active is not None:
                self.active.on_end(span)

    switch = Switch()
    provider = TracerProvider()
    provider.add_span_processor(switch)
    trace.set_tracer_provider(provider)
    processors = {
        "memory": SimpleSpanProcessor(InMemorySpanExporter()),
        "otlp": BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver_url)),
    }
    best: dict[str, float] = {}
    for _ in range(rounds):
        for mode in TRACING_MODES:
            switch.active = processors.get(mode)
            with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "TRACING": mode != "off"}):
                run = api.start("noop", {"steps": steps})
                began = time.perf_counter()
                for _ in range(steps):
                    advance(run.id)
                took = (time.perf_counter() - began) / steps
            assert Run.objects.get(pk=run.id).status == "completed"
            best[mode] = min(took, best.get(mode, took))
    # The span alone, without the step's database work around it: what one attempt's span costs this process.
    parent = Run.objects.get(pk=run.id).trace_context
    attributes = {
        "durable_agents.run.id": str(run.id),
        "durable_agents.step.id": "tick-1",
        "durable_agents.step.attempt": 1,
    }
    for mode in ("memory", "otlp"):
        switch.active = processors[mode]
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "TRACING": True}):
            began = time.perf_counter()
            for _ in range(SPANS_TIMED):
                with tracing.run_span("step tick", parent, attributes) as traced:
                    traced.set({"durable_agents.step.outcome": "committed"})
            best[f"span {mode}"] = (time.perf_counter() - began) / SPANS_TIMED
    processors["otlp"].shutdown()
    redis.Redis.from_url(BROKER).flushdb()  # the wake-ups of those runs: no worker took them
    return best


def print_tracing(figures: dict[str, float], receiver: OtlpReceiver, workers: int, slice_ms: int, args: Any) -> None:
    eager = f"eager {slice_ms} ms" if slice_ms else "one step per task"
    print(
        f"\ntracing cost per step — {workers} solo workers ({eager}), {args.steps} sequential no-op steps, "
        f"best of {args.tracing_rounds} rounds"
    )
    print(f"{'tracing':<48} {'ms/step':>8} {'÷ off':>6}")
    for mode, label in TRACING_MODES.items():
        print(f"{label:<48} {figures[mode] * 1000:>8.2f} {figures[mode] / figures['off']:>6.2f}")
    print(f"the OTLP receiver got {receiver.spans} spans in {receiver.requests} requests")
    local = tracing_in_process(args.steps, args.tracing_rounds, receiver.url)
    print(f"\none advance() in this process, no broker or worker ({args.steps} steps, best of {args.tracing_rounds})")
    print(f"{'tracing':<48} {'ms/step':>8} {'÷ off':>6} {'+ µs':>6}")
    for mode, label in TRACING_MODES.items():
        added = (local[mode] - local["off"]) * 1e6
        print(f"{label:<48} {local[mode] * 1000:>8.3f} {local[mode] / local['off']:>6.2f} {added:>6.0f}")
    print(
        f"a step's span alone ({SPANS_TIMED:,} in a loop, no database): {local['span memory'] * 1e6:.0f} µs in memory, "
        f"{local['span otlp'] * 1e6:.0f} µs batched to OTLP (its export thread's work included)"
    )
    receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4, help="starting threads for the concurrent row")
    parser.add_argument("--slice-ms", type=int, default=100)
    parser.add_argument("--dbos", action="store_true", help="create bench/.venv-dbos first if it is missing")
    parser.add_argument("--no-dbos", action="store_true", help="leave DBOS out")
    parser.add_argument("--tracing-only", action="store_true", help="measure only tracing's cost per step")
    parser.add_argument("--no-tracing", action="store_true", help="leave tracing's cost per step out")
    parser.add_argument("--tracing-rounds", type=int, default=2)
    args = parser.parse_args()
    if args.tracing_only:
        figures_traced, receiver = tracing_overhead(args.workers, args.slice_ms, args.steps, args.tracing_rounds)
        print_tracing(figures_traced, receiver, args.workers, args.slice_ms, args)
        return
    modes = {f"eager {args.slice_ms} ms": args.slice_ms, "one step per task": 0}
    figures = {name: measure(args.workers, ms, args.steps, args.runs, args.threads) for name, ms in modes.items()}
    statements = statements_per_step()
    dbos = (
        "skipped (--no-dbos)"
        if args.no_dbos
        else measure_dbos(args.workers, args.steps, args.runs, args.threads, args.dbos)
    )
    print(
        f"\nstep cost — {args.workers} solo workers, Redis broker, Postgres, same Celery settings for raw and durable;"
        f" {args.steps} sequential steps, {args.runs} one-step runs"
    )
    print_table(figures, dbos, statements)
    print_cpu(figures, dbos, args.workers)
    if not args.no_tracing:
        figures_traced, receiver = tracing_overhead(args.workers, args.slice_ms, args.steps, args.tracing_rounds)
        print_tracing(figures_traced, receiver, args.workers, args.slice_ms, args)


if __name__ == "__main__":
    main()
