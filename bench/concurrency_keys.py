"""Concurrency keys' cost: one-step runs started and advanced in this process, without a key, each with a key of
its own, and all on one key (limit 1, so each run waits for the one before).

    python bench/concurrency_keys.py [--runs 300]

Needs Postgres (BENCH_DATABASE, dropped and created). No broker: wake-ups are dropped (the bench advances every
run itself). Prints, per mode, SQL statements and milliseconds per run (start + claim + commit + hand-off), and
the ratio to runs without a key measured in the same run; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_bench_keys")
prepare(DB_NAME)  # no broker: the bench advances every run itself

from django.conf import settings  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import CaptureQueriesContext, override_settings  # noqa: E402

from durable_agents import api  # noqa: E402
from durable_agents.engine.advance import advance  # noqa: E402
from durable_agents.models import Run  # noqa: E402


def no_wake(run_id: str, countdown: float | None = None, **kwargs: object) -> None:
    """The bench advances every run itself."""


api.workflow("bench_one_step", steps=[api.call("one", lambda ctx: {"ok": True})])


def _measure(runs: int, key_of: object) -> tuple[float, float]:
    """(statements per run, ms per run) for `runs` runs started and advanced one after the other."""
    timings, statements = [], []
    for i in range(runs):
        key = key_of(i) if callable(key_of) else None
        connection.queries_log.clear()  # the log keeps 9,000 queries: a full one would count none
        with CaptureQueriesContext(connection) as queries:
            began = time.perf_counter()
            run = api.start("bench_one_step", {"i": i}, concurrency_key=key)
            advance(run.id)
            timings.append((time.perf_counter() - began) * 1000)
        statements.append(len(queries))
        assert Run.objects.get(pk=run.id).status == "completed", "the bench run did not complete"
    return statistics.mean(statements), statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=300)
    args = parser.parse_args()
    modes = {
        "no key": None,
        "a key per run": lambda i: f"customer-{i}",
        "one key (limit 1)": lambda i: "one-customer",
    }
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": "__main__.no_wake"}):
        _measure(50, None)  # warm-up
        results = {name: _measure(args.runs, key) for name, key in modes.items()}
    base = results["no key"][1]
    print(f"\n{args.runs} one-step runs per mode, started and advanced in this process (median ms per run)")
    print(f"{'mode':<20} {'statements/run':>15} {'ms/run':>8} {'vs no key':>10}")
    for name, (stmts, ms) in results.items():
        print(f"{name:<20} {stmts:>15.1f} {ms:>8.2f} {ms / base:>9.2f}x")


if __name__ == "__main__":
    main()
