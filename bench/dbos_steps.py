"""DBOS's side of bench/steps.py: sequential no-op steps and one-step queued workflows, on Postgres.

    bench/.venv-dbos/bin/python bench/dbos_steps.py --database NAME [--steps 500] [--runs 500] [--workers 2]
                                                    [--threads 4]

Runs under bench/.venv-dbos (bench/requirements-dbos.txt), never the project's virtualenv, and imports
nothing from the project but bench/cpu.py and bench/starters.py (standard library only). bench/steps.py runs it as
a subprocess and reads the one JSON object it prints.
The database NAME is dropped and created, and dropped at the end (`--keep` leaves it). `--workers` DBOS
processes (`serve`) execute the queue, as the durable side's Celery workers do; this process only enqueues
and watches, as the durable side's does. The queue is polled every `--poll` seconds, 0.05 rather than
DBOS's default of 1: the best of 1, 0.2, 0.05 and 0.01 s in a trial on this machine, so DBOS is
measured well tuned.

* Sequential steps: one workflow of N `@DBOS.step` no-ops, enqueued; the workflow times its own body, so
  the figure is the cost of a step and leaves out the queue's polling delay before the workflow starts.
* One-step workflows, one enqueued per transaction (`DBOSClient.enqueue`, as a web request would): workflows/s
  from the first enqueue to the last one's completion as DBOS records it.
* The same from `--threads` threads at once (bench/starters.py), as a web server's request threads would.
* One-step workflows: M enqueued in one transaction (`DBOSClient.enqueue_in_transaction`), so all become
  visible at once, like the durable side's runs started in one transaction; workflows/s from that commit to
  the last one's completion as DBOS records it.

Each is measured for CPU as bench/steps.py measures the durable side (bench/cpu.py): the executor processes'
process trees, the Postgres backends of this database (the watching connection's left out) and the whole server,
and the enqueuing thread's own CPU; Postgres commits per step and per workflow net of what the idle executors
commit (their queue polls), each reading `--lag` seconds after the work so every backend has reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from importlib.metadata import version
from typing import Any

from cpu import Transactions, Watch
from starters import Starters

QUEUE = "bench"
APP = "durable_bench_dbos"


def database_url(name: str) -> str:
    return f"postgresql://postgres@127.0.0.1:5432/{name}"


def serve(name: str, poll: float, executor: str) -> None:
    """One DBOS executor: launch, serve the queue until stdin closes (the parent ends or stops it)."""
    from dbos import DBOS

    DBOS(
        config={
            "name": APP,
            "system_database_url": database_url(name),
            "executor_id": executor,
            "application_version": "bench",
            "log_level": "ERROR",
        }
    )

    @DBOS.step(name="bench_noop")
    def noop_step() -> None:
        """A step that does nothing: what is left is DBOS's own cost of a step."""

    @DBOS.workflow(name="bench_steps")
    def steps_workflow(steps: int) -> float:
        began = time.perf_counter()
        for _ in range(steps):
            noop_step()
        return time.perf_counter() - began

    @DBOS.workflow(name="bench_one_step")
    def one_step_workflow() -> None:
        noop_step()

    DBOS.launch()
    DBOS.register_queue(QUEUE, polling_interval_sec=poll, on_conflict="always_update")
    print("ready", flush=True)
    sys.stdin.read()
    DBOS.destroy()


def psql(sql: str) -> None:
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-qc", sql], check=True, capture_output=True)


def prepare_database(name: str) -> None:
    psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    psql(f"CREATE DATABASE {name}")


def start_servers(name: str, workers: int, poll: float) -> list[subprocess.Popen[str]]:
    """Start the executors one after another: the first creates DBOS's schema, the rest find it made."""
    servers = []
    for i in range(workers):
        server = subprocess.Popen(
            [sys.executable, __file__, "serve", "--database", name, "--poll", str(poll), "--executor", f"bench-{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        servers.append(server)
        if server.stdout is None or server.stdout.readline().strip() != "ready":
            raise SystemExit(f"DBOS executor {i} did not start")
    return servers


def stop_servers(servers: list[subprocess.Popen[str]]) -> None:
    for server in servers:
        if server.stdin:
            server.stdin.close()
    for server in servers:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def wait_done(watch: Watch, ids: str, n: int, interval: float) -> float:
    """Wait until `n` workflows whose ids are LIKE `ids` have succeeded; the epoch seconds of the last success."""
    query = (
        "SELECT count(*), max(updated_at) FROM dbos.workflow_status WHERE workflow_uuid LIKE %s AND status = 'SUCCESS'"
    )
    deadline = time.monotonic() + 600
    while True:
        count, last = watch.one(query, [ids])
        if count == n:
            return last / 1000
        if time.monotonic() > deadline:
            raise SystemExit(f"{count} of {n} DBOS workflows finished in 600 s")
        time.sleep(interval)


def sequential(client, watch: Watch, pids: list[int], steps: int) -> tuple[float, dict[str, Any]]:
    """Seconds per step of one workflow of `steps` no-op steps, timed inside the workflow, and the CPU per step
    from the enqueue to the workflow's success."""
    with watch.meter(pids) as meter:
        handle = client.enqueue({"workflow_name": "bench_steps", "queue_name": QUEUE}, steps)
        wait_done(watch, handle.get_workflow_id(), 1, 0.01)
    return handle.get_result() / steps, meter.usage.per(steps)


def one_per_transaction(client, watch: Watch, pids: list[int], runs: int) -> dict[str, Any]:
    """One-step workflows enqueued one by one, each in its own transaction: workflows/s from the first enqueue to
    the last success, the enqueuing thread's CPU per workflow, and the rest's."""
    batch = uuid.uuid4().hex
    began = time.time()
    with watch.meter(pids) as meter:
        thread = time.thread_time()
        for i in range(runs):
            client.enqueue({"workflow_name": "bench_one_step", "queue_name": QUEUE, "workflow_id": f"{batch}-{i}"})
        enqueued = time.thread_time() - thread
        last = wait_done(watch, f"{batch}-%", runs, 0.05)
    return {"tps": runs / (last - began), "starter_ms": enqueued * 1000 / runs, **meter.usage.per(runs)}


def from_threads(client, watch: Watch, pids: list[int], runs: int, threads: int) -> dict[str, Any]:
    """One-step workflows enqueued one per transaction from `threads` threads at once (bench/starters.py), as a web
    server's request threads would: workflows/s from the first enqueue to the last success, CPU per workflow."""
    batch = uuid.uuid4().hex
    with Starters(threads) as starters, watch.meter(pids) as meter:
        began = time.time()
        options = {"workflow_name": "bench_one_step", "queue_name": QUEUE}
        starters.run(runs, lambda i: client.enqueue({**options, "workflow_id": f"{batch}-{i}"}))
        last = wait_done(watch, f"{batch}-%", runs, 0.05)
    return {"tps": runs / (last - began), "starter_ms": starters.cpu * 1000 / runs, **meter.usage.per(runs)}


def throughput(client, engine, watch: Watch, pids: list[int], runs: int) -> tuple[float, float, dict[str, Any]]:
    """One-step workflows completed per second from the commit that enqueued them all, enqueues/s, CPU per one."""
    batch = uuid.uuid4().hex
    with watch.meter(pids) as meter:
        made, thread = time.time(), time.thread_time()
        with engine.begin() as conn:
            for i in range(runs):
                client.enqueue_in_transaction(
                    conn, {"workflow_name": "bench_one_step", "queue_name": QUEUE, "workflow_id": f"{batch}-{i}"}
                )
            began = time.time()
        enqueued = time.thread_time() - thread
        last = wait_done(watch, f"{batch}-%", runs, 0.05)
    cpu = {"tps": runs / (last - began), "starter_ms": enqueued * 1000 / runs, **meter.usage.per(runs)}
    return runs / (last - began), runs / (began - made), cpu


def measure(name: str, steps: int, runs: int, workers: int, poll: float, lag: float, threads: int) -> dict[str, object]:
    import psycopg
    import sqlalchemy as sa
    from dbos import DBOSClient

    prepare_database(name)
    servers = start_servers(name, workers, poll)
    pids = [server.pid for server in servers]
    # Its pool (5 connections by default, no overflow) holds one for each enqueuing thread, as the durable side's do.
    pool = max(5, threads)
    client = DBOSClient(system_database_url=database_url(name), application_name=APP, system_database_pool_size=pool)
    engine = sa.create_engine(database_url(name).replace("postgresql://", "postgresql+psycopg://"))
    watch = Watch(psycopg.connect(database_url(name)), name)
    try:
        sequential(client, watch, pids, 20)
        throughput(client, engine, watch, pids, 20)  # warm up: imports, connections, the queue's first polls
        from_threads(client, watch, pids, threads * 4, threads)  # and one pooled connection per starting thread
        ledger = Transactions(watch, lag)
        idle = ledger.idle(pids)
        step, step_cpu = sequential(client, watch, pids, steps)
        xacts, _ = ledger.per(steps)
        each = one_per_transaction(client, watch, pids, runs)
        each["xacts"], _ = ledger.per(runs)
        threaded = from_threads(client, watch, pids, runs, threads)
        threaded["xacts"], _ = ledger.per(runs)
        tps, enqueues, batch = throughput(client, engine, watch, pids, runs)
    finally:
        watch.connection.close()
        client.destroy()
        engine.dispose()
        stop_servers(servers)
    return {
        "version": version("dbos"),
        "step": step,
        "xacts": xacts,
        "tps": tps,
        "threaded_tps": threaded["tps"],
        "threads": threads,
        "enqueues": enqueues,
        "workers": workers,
        "poll": poll,
        "cpu": {
            "step": {"wall_ms": step * 1000, "xacts": xacts, **step_cpu},
            "each": each,
            "threads": threaded,
            "batch": batch,
            "idle": {"xacts": ledger.rate, **idle.per(idle.seconds)},
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["measure", "serve"], default="measure")
    parser.add_argument("--database", default=os.environ.get("BENCH_DATABASE", "durable_bench") + "_dbos")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4, help="enqueuing threads for the concurrent row")
    parser.add_argument("--poll", type=float, default=0.05, help="the queue's polling interval, seconds")
    parser.add_argument("--executor", default="bench")
    parser.add_argument("--lag", type=float, default=11.0, help="seconds to wait for Postgres's statistics")
    parser.add_argument("--keep", action="store_true", help="leave the database in place afterwards")
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.database, args.poll, args.executor)
        return
    try:
        figures = measure(args.database, args.steps, args.runs, args.workers, args.poll, args.lag, args.threads)
    finally:
        if not args.keep:
            psql(f"DROP DATABASE IF EXISTS {args.database} WITH (FORCE)")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
