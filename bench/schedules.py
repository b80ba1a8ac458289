"""What schedules cost the sweep: a pass with no schedules, with many idle ones (none due), and with many due
at once (each slot's run started in the transaction that advances its schedule).

    python bench/schedules.py [--schedules 10000] [--due 1000] [--repeat 20]

Uses a database of its own (BENCH_DATABASE_URL, default postgres://postgres@127.0.0.1:5432/durable_bench_schedules),
recreated each time, and the broker of CELERY_BROKER_URL (the wake-ups it publishes are purged at the end). The
clock is moved with `clock.advance`, as the tests do. Prints figures (ratios against the empty pass measured in
the same run); asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

try:
    from bench._setup import configure, reset_database
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import configure, reset_database

DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/durable_bench_schedules")
DB_NAME = DATABASE_URL.rsplit("/", 1)[-1]
configure(DB_NAME, DATABASE_URL=DATABASE_URL)


def passes(sweep, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        sweep()
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=10_000)
    parser.add_argument("--due", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    reset_database(DB_NAME)
    import django

    django.setup()
    from durable_agents import api, clock
    from durable_agents.engine.schedules import start_due_schedules
    from durable_agents.engine.sweep import sweep
    from durable_agents.models import Run, Schedule

    passes(sweep, 5)  # warm up: connections, the broker's, the first queries' plans
    empty = statistics.median(passes(sweep, args.repeat))
    for i in range(args.schedules):
        api.schedule(f"idle-{i}", "noop", cron="0 3 1 1 *")  # once a year: none due during the bench
    idle = statistics.median(passes(sweep, args.repeat))

    for i in range(args.due):
        api.schedule(f"due-{i}", "noop", cron="*/5 * * * *", input={"steps": 1})
    clock.advance(timedelta(minutes=5))
    started = time.perf_counter()
    count = 0
    while Schedule.objects.filter(paused=False, next_slot__lte=clock.now()).exists():
        count += start_due_schedules(clock.now())
    due_ms = (time.perf_counter() - started) * 1000
    assert count == args.due == Run.objects.count(), "every due slot started once"

    print(f"sweep pass, no schedules:                  {empty:8.2f} ms (median of {args.repeat})")
    print(f"sweep pass, {args.schedules:,} idle schedules:       {idle:8.2f} ms ({idle / empty:.2f}x the empty pass)")
    print(
        f"{args.due:,} due slots started:                 {due_ms:8.0f} ms "
        f"({due_ms / args.due:.2f} ms a slot, {due_ms / args.due / empty:.2f}x an empty pass each)"
    )
    try:
        import redis

        redis.Redis.from_url(os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")).delete("celery")
    except Exception as exc:  # noqa: BLE001 - a bench's clean-up
        print(f"(could not purge the wake-ups: {exc})")


if __name__ == "__main__":
    main()
