"""The window no check-then-act can close: from a worker proving its lease to its act reaching the world.

    python bench/zombie_window.py [--runs 20] [--ticks 20] [--burn 0]

Needs Postgres (scripts/test starts it). Prints figures; asserts nothing.

A worker frozen inside this window (SIGSTOP, a GC pause, a VM stall) and thawed after another worker took
its run over still acts once: it sends the model request it was about to send, or starts the step body it was
about to start. Effects and commits are fenced in the database and never land twice; a repeated request is
never journaled and its usage is counted (DESIGN.md §2.3, §2.4). How wide is the window? Measured here,
in-process, against the fake Messages API on loopback:

* model: `StepContext.ensure_lease()` returns → the fake server has the request (SDK request building, HTTP);
* body: the claim statement returns → the step body starts (loading the definition, the guards).

`--burn N` runs N CPU-bound processes beside it, to show the window on a busy machine.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import time

try:
    from bench._setup import configure, reset_database
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import configure, reset_database

DB_NAME = "durable_bench_window"
configure(
    DB_NAME,
    # No broker: runs are driven in this process; wake-ups that find no broker are left to the sweep.
    "memory://",
    DJANGO_SECRET_KEY=os.environ.get("DJANGO_SECRET_KEY", "bench-only-not-a-secret"),
    ANTHROPIC_API_KEY="sk-ant-bench",
)


def _burn() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ticks", type=int, default=20, help="model turns per run")
    parser.add_argument("--burn", type=int, default=0, help="CPU-bound processes to run beside it")
    args = parser.parse_args()
    reset_database(DB_NAME)

    import django

    django.setup()

    from bench.agent_ticks import Ticker
    from durable_agents import api
    from durable_agents.engine import advance as engine_advance
    from durable_agents.engine import transitions
    from durable_agents.engine.context import StepContext
    from durable_agents.testing import drive
    from durable_agents.testing.fake_anthropic import FakeAnthropic

    proofs: list[float] = []
    claims: list[float] = []
    bodies: list[float] = []
    prove, claim, execute = StepContext.ensure_lease, transitions.claim_run, engine_advance._execute

    def proving(self):  # type: ignore[no-untyped-def]
        prove(self)
        proofs.append(time.time())

    def claiming(run_id):  # type: ignore[no-untyped-def]
        claimed = claim(run_id)
        if claimed is not None:
            claims.append(time.perf_counter())
        return claimed

    def executing(*a):  # type: ignore[no-untyped-def]
        bodies.append(time.perf_counter() - claims[-1])
        return execute(*a)

    StepContext.ensure_lease = proving  # type: ignore[method-assign]
    transitions.claim_run = claiming  # type: ignore[assignment]
    engine_advance._execute = executing  # type: ignore[assignment]

    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burn)]
    for burner in burners:
        burner.start()
    fake = FakeAnthropic(responder=Ticker()).start()
    fake._server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    os.environ["ANTHROPIC_BASE_URL"] = fake.url
    try:
        for _ in range(args.runs):
            drive(api.start("bench_ticks", {"ticks": args.ticks}).id)
            drive(api.start("noop", {"steps": args.ticks}).id)  # more step bodies: one per claim
    finally:
        fake.stop()
        for burner in burners:
            burner.terminate()
    received = [r.time for r in fake.requests if r.path == "/v1/messages"]
    model = [(r - p) * 1000 for p, r in zip(proofs, received, strict=False) if r >= p]
    body = [b * 1000 for b in bodies]
    print(f"zombie window, {args.runs} runs x {args.ticks} turns, {args.burn} CPU burners beside it (ms):")
    for name, values in (("lease proof -> request at the server", model), ("claim -> step body starts", body)):
        q = statistics.quantiles(values, n=100, method="inclusive")
        print(
            f"  {name:40s} n={len(values):5d}  p50 {q[49]:6.2f}  p95 {q[94]:6.2f}  p99 {q[98]:6.2f}  "
            f"max {max(values):6.2f}"
        )


if __name__ == "__main__":
    main()
