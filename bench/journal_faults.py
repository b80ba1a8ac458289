"""Billed answers whose database connection dies while the model thinks: how many are asked again, and is each counted.

    python bench/journal_faults.py [--runs 10] [--ticks 12] [--every 3]

Needs Postgres (scripts/test starts it). Prints figures; asserts nothing.

Runs are driven in this process on Django's psycopg pool (DJANGO_DB_POOL=4), as on the model worker: a step gives
its pooled connection back while the model thinks. Before every `--every`-th answer goes out, the fake Messages API
ends every server process of this client (pg_terminate_backend, as a restart or a failover would), so the journal
meets a dead pooled connection. A step that fails on the database leaves its lease held, as a crashed task would:
the bench moves the engine clock past the lease instead of waiting for the sweep.

Printed: answers billed, turns journaled, answers asked again, `unjournaled_usage` events, and whether the runs'
counters (what the budgets read) equal what the fake API billed.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from datetime import timedelta

try:
    from bench._setup import configure, reset_database
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import configure, reset_database

DB_NAME = "durable_bench_journal_faults"
CLIENT = "bench-journal-faults"
DB_URL = f"postgres://postgres@127.0.0.1:5432/{DB_NAME}"
configure(
    DB_NAME,
    # No broker: runs are driven in this process; wake-ups that find no broker are left to the sweep.
    "memory://",
    DJANGO_DB_POOL="4",
    DJANGO_DB_APPLICATION_NAME=CLIENT,
    DURABLE_LOG_LEVEL="CRITICAL",
    DJANGO_SECRET_KEY=os.environ.get("DJANGO_SECRET_KEY", "bench-only-not-a-secret"),
    ANTHROPIC_API_KEY="sk-ant-bench",
)
USAGE = ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")
SERVED = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


def _end_this_client() -> int:
    import psycopg

    with psycopg.connect(DB_URL.replace("postgres://", "postgresql://"), autocommit=True) as admin:
        ended = admin.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE application_name = %s", [CLIENT]
        ).fetchall()
    return sum(1 for (ok,) in ended if ok)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--ticks", type=int, default=12, help="model turns per run")
    parser.add_argument("--every", type=int, default=3, help="end the connections before every N-th answer")
    args = parser.parse_args()
    # `manage.py migrate` without the connection pool and without the bench's application_name.
    reset_database(
        DB_NAME, {k: v for k, v in os.environ.items() if k not in ("DJANGO_DB_POOL", "DJANGO_DB_APPLICATION_NAME")}
    )

    import logging

    import django

    django.setup()
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # each broken connection discarded is a warning

    from django.db import InterfaceError, OperationalError, connection

    from bench.agent_ticks import Ticker
    from durable_agents import api, clock
    from durable_agents.conf import settings
    from durable_agents.models import Event, Run, Turn
    from durable_agents.testing import drive
    from durable_agents.testing.fake_anthropic import FakeAnthropic, RecordedRequest

    ticker = Ticker()
    answered = Counter[str]()

    def answer(request: RecordedRequest):  # type: ignore[no-untyped-def]
        answered["all"] += 1
        if answered["all"] % args.every == 0:
            answered["ended"] += _end_this_client()
        return ticker(request)

    fake = FakeAnthropic(responder=answer).start()
    os.environ["ANTHROPIC_BASE_URL"] = fake.url
    ids = []
    stalls = 0
    try:
        for _ in range(args.runs):
            run_id = api.start("bench_ticks", {"ticks": args.ticks}).id
            ids.append(run_id)
            while True:
                try:
                    if drive(run_id).is_finished:
                        break
                except (OperationalError, InterfaceError, AssertionError):
                    # The step failed on the database and kept its lease (or left it to the sweep): take it over.
                    stalls += 1
                    connection.close()
                    clock.advance(timedelta(seconds=float(settings.LEASE_SECONDS) + 1))
    finally:
        fake.stop()

    runs = list(Run.objects.filter(id__in=ids))
    asked = Counter((r.conversation, r.turn) for r in fake.requests if r.path == "/v1/messages")
    billed = tuple(sum(int(u.get(name) or 0) for u in fake.billed) for name in SERVED)
    counted = tuple(sum(getattr(run, name) for run in runs) for name in USAGE)
    events = Event.objects.filter(run_id__in=ids, kind="unjournaled_usage").count()
    print(
        f"journal faults: {len(runs)} runs x {args.ticks} ticks on a pool of 4, this client's connections ended before "
        f"every {args.every}rd answer ({answered['ended']} connections ended)"
    )
    print(f"  runs completed          {sum(1 for r in runs if r.status == 'completed')} of {len(runs)}")
    print(f"  answers billed          {len(fake.billed)}")
    print(f"  turns journaled         {Turn.objects.filter(run_id__in=ids).count()}")
    print(f"  answers asked again     {sum(n - 1 for n in asked.values())}")
    print(f"  unjournaled_usage       {events}")
    print(f"  steps stalled on the db {stalls}")
    print(f"  counted == billed       {counted == billed}  (counted {sum(counted)}, billed {sum(billed)} tokens)")


if __name__ == "__main__":
    main()
