"""Growth: table and index sizes per 1,000,000 runs of the example project's refund agent, extrapolated.

    python bench/growth.py [--runs 20000]

Drives the example project's refund_agent once per demo customer (the scripted participant, in this process,
approvals approved), so every row is a real one: steps, turns, effects, reliances, waits, events. Then copies
those runs in SQL (bench/records.py: new ids, new effect keys) until --runs runs exist, VACUUM ANALYZEs,
and prints each durable_agents table's heap, TOAST and index sizes, and each index's, scaled linearly from
--runs to 1,000,000 runs. Linear is an assumption: btree indexes on random UUIDs grow a little faster than
linearly with page splits; the figure is a floor. BENCH_DATABASE names the database (dropped and created).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

try:
    from bench._setup import prepare
except ModuleNotFoundError:  # run as `python bench/x.py`: the repository root is not on sys.path yet
    from _setup import prepare

DB_NAME = os.environ.get("BENCH_DATABASE", "durable_growth")
PER = 1_000_000
# A fresh database when run; imported, the bench's database as it is.
prepare(DB_NAME, os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/13"), reset=__name__ == "__main__")

from django.db import connection  # noqa: E402

from bench.records import copy_runs, real_runs  # noqa: E402
from durable_agents.models import Effect, Event, Reliance, Run, Step, Turn, Wait  # noqa: E402

TABLES = (Run, Step, Turn, Effect, Reliance, Wait, Event)


def clone(templates: list[uuid.UUID], total: int, chunk: int = 500) -> None:
    """Copies of the template runs, with all their rows, until about `total` runs exist."""
    while Run.objects.count() < total:
        copy_runs(templates, min(chunk, max(1, (total - Run.objects.count()) // len(templates))))


def sizes(runs: int) -> None:
    scale = PER / runs
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")
        print(f"\nper {PER:,} runs (measured on {runs:,} runs, scaled x{scale:,.1f}; linear: a floor for the indexes)")
        print(f"{'table':<28}{'rows':>14}{'heap MB':>10}{'toast MB':>10}{'index MB':>10}{'total MB':>10}")
        totals = [0, 0, 0, 0]
        for model in TABLES:
            table = model._meta.db_table
            cursor.execute(
                "SELECT (SELECT count(*) FROM " + connection.ops.quote_name(table) + "), pg_relation_size(%s), "
                "pg_total_relation_size(%s) - pg_relation_size(%s) - pg_indexes_size(%s), pg_indexes_size(%s)",
                [table] * 5,
            )
            count, heap, toast, index = cursor.fetchone()
            figures = [heap * scale / 2**20, toast * scale / 2**20, index * scale / 2**20]
            total = sum(figures)
            totals = [a + b for a, b in zip(totals, [*figures, total], strict=True)]
            print(f"{table:<28}{count * scale:>14,.0f}" + "".join(f"{v:>10,.0f}" for v in [*figures, total]))
        print(f"{'all':<28}{'':>14}" + "".join(f"{v:>10,.0f}" for v in totals))
        print(f"\n{'index':<44}{'MB':>10}")
        cursor.execute(
            "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes "
            "WHERE relname LIKE 'durable_agents_%%' AND relname <> 'durable_agents_payload' ORDER BY 2 DESC"
        )
        for name, size in cursor.fetchall():
            print(f"{name:<44}{size * scale / 2**20:>10,.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20_000)
    args = parser.parse_args()
    began = time.monotonic()
    templates = real_runs()
    shapes = {
        model.__name__.lower(): model.objects.filter(run_id__in=templates).count() for model in TABLES if model != Run
    }
    print(f"{len(templates)} real refund_agent runs; rows per run on average:")
    print("  " + ", ".join(f"{name} {count / len(templates):.1f}" for name, count in shapes.items()))
    clone(templates, args.runs)
    print(f"{args.runs:,} runs written in {time.monotonic() - began:.0f} s")
    sizes(Run.objects.count())


if __name__ == "__main__":
    main()
