"""The tables bench/steps.py prints: wall time against raw Celery and DBOS, then CPU per step and per run."""

from __future__ import annotations

from typing import Any

STEP_GOAL, STEP_STRETCH, THROUGHPUT_GOAL = 1.0, 0.8, 2.5


def print_table(figures: dict[str, dict[str, Any]], dbos: dict[str, Any] | str, statements: int) -> None:
    """One table for both durable modes, each ratio durable ÷ the other side, DBOS's beside its goal."""
    measured = isinstance(dbos, dict)
    print(f"{'durable workers':<20} {'measure':<36} {'raw celery':>10} {'DBOS':>7} {'durable':>8}", end="")
    print(f" {'÷ raw':>6} {'÷ DBOS':>7}  goal ÷ DBOS")
    for name, f in figures.items():
        rows = (
            ("sequential no-op step latency (ms)", f["raw_hop"] * 1000, "step", 1000, ".2f"),
            ("one-step runs per second", f["raw_tps"], "tps", 1, ".0f"),
            (f"runs/s, one per txn from {f['threads']} threads", f["raw_threaded_tps"], "threaded_tps", 1, ".0f"),
        )
        for measure, raw, key, scale, spec in rows:
            ours = f[key] * scale
            theirs = f"{dbos[key] * scale:>7{spec}}" if measured else f"{'—':>7}"
            versus = f"{ours / (dbos[key] * scale):>7.2f}" if measured else f"{'—':>7}"
            goal = f"≤ {STEP_GOAL:.2f} (stretch {STEP_STRETCH:.2f})" if key == "step" else f"≥ {THROUGHPUT_GOAL:.2f}"
            print(
                f"{name:<20} {measure:<36} {raw:>10{spec}} {theirs} {ours:>8{spec}} {ours / raw:>6.2f} {versus}  {goal}"
            )
        print(
            f"{name:<20} postgres per durable step: {f['xacts']:.2f} transactions (net of the idle workers'), "
            f"{f['sessions']:.3f} new connections; api.start() {f['starts']:.0f}/s from one process"
        )
    print(f"{statements} SQL statements in one advance (in-process)")
    if measured:
        print(
            f"DBOS {dbos['version']}: {dbos['workers']} executor processes, queue polled every {dbos['poll']:g} s, "
            f"step timed inside its workflow; {dbos['xacts']:.2f} transactions in its database per step "
            f"(net of its idle queue polls); {dbos['enqueues']:.0f} enqueues/s in one transaction"
        )
    else:
        print(f"DBOS {dbos}")


# (part, key, label, number format, ratio to raw Celery): the rows of the CPU table, for each durable mode.
CPU_ROWS = (
    ("step", "wall_ms", "sequential no-op step: wall ms", ".2f", True),
    ("step", "workers_ms", "  workers' CPU ms", ".2f", True),
    ("step", "database_ms", "  postgres CPU ms: its database's backends", ".2f", False),
    ("step", "postgres_ms", "  postgres CPU ms: whole server", ".2f", False),
    ("step", "total_ms", "  CPU ms: workers + its database", ".2f", True),
    ("step", "xacts", "  postgres transactions (net of idle)", ".2f", False),
    ("step", "machine_ms", "  machine CPU ms: every process", ".2f", False),
    ("each", "tps", "one-step runs, one per transaction: runs/s", ".0f", True),
    ("each", "starter_ms", "  starter CPU ms (the calling thread)", ".2f", True),
    ("each", "workers_ms", "  workers' CPU ms", ".2f", True),
    ("each", "database_ms", "  postgres CPU ms: its database's backends", ".2f", False),
    ("each", "postgres_ms", "  postgres CPU ms: whole server", ".2f", False),
    ("each", "total_ms", "  CPU ms: starter + workers + its database", ".2f", True),
    ("each", "xacts", "  postgres transactions (net of idle)", ".2f", False),
    ("each", "machine_ms", "  machine CPU ms: every process", ".2f", False),
    ("threads", "tps", "the same from several threads at once: runs/s", ".0f", True),
    ("threads", "starter_ms", "  starters' CPU ms (the calling threads)", ".2f", True),
    ("threads", "workers_ms", "  workers' CPU ms", ".2f", True),
    ("threads", "database_ms", "  postgres CPU ms: its database's backends", ".2f", False),
    ("threads", "total_ms", "  CPU ms: starters + workers + its database", ".2f", True),
    ("threads", "xacts", "  postgres transactions (net of idle)", ".2f", False),
    ("threads", "machine_ms", "  machine CPU ms: every process", ".2f", False),
    ("batch", "tps", "one-step runs, all in one transaction: runs/s", ".0f", False),
    ("batch", "starter_ms", "  starter CPU ms (the calling thread)", ".2f", False),
    ("batch", "workers_ms", "  workers' CPU ms", ".2f", False),
    ("batch", "database_ms", "  postgres CPU ms: its database's backends", ".2f", False),
    ("batch", "total_ms", "  CPU ms: starter + workers + its database", ".2f", False),
)


def _cell(part: dict[str, Any] | None, key: str) -> float | None:
    if part is None:
        return None
    if key == "total_ms":
        spent = [part.get("starter_ms", 0.0), part["workers_ms"], part["database_ms"]]
        return None if None in spent else sum(spent)
    return part.get(key)


def _show(value: float | None, width: int, spec: str) -> str:
    return f"{value:>{width}{spec}}" if value is not None else f"{'—':>{width}}"


def _ratio(ours: float | None, other: float | None, width: int) -> str:
    return f"{ours / other:>{width}.2f}" if ours is not None and other else f"{'—':>{width}}"


def print_cpu(figures: dict[str, dict[str, Any]], dbos: dict[str, Any] | str, workers: int) -> None:
    """CPU per step and per run: each side's workers, its database's Postgres backends and the whole server."""
    theirs = dbos["cpu"] if isinstance(dbos, dict) else {}
    print(
        f"\nCPU per step and per run (user + system ms from /proc: the {workers} workers' process trees, the Postgres "
        f"backends of each side's database, the whole Postgres server, every process on the machine). The machine is "
        f"shared: the server and machine figures include others' work. Transactions: pg_stat_database commits, net of "
        f"what the idle side commits."
    )
    print(f"{'durable workers':<20} {'measure':<46} {'raw celery':>10} {'DBOS':>8} {'durable':>8}", end="")
    print(f" {'÷ raw':>6} {'÷ DBOS':>7}")
    for name, f in figures.items():
        for part, key, label, spec, versus_raw in CPU_ROWS:
            raw = _cell(f["cpu"]["raw"].get(part), key)
            dbos_value = _cell(theirs.get(part), key)
            ours = _cell(f["cpu"]["durable"][part], key)

            print(
                f"{name:<20} {label:<46} {_show(raw, 10, spec)} {_show(dbos_value, 8, spec)} {_show(ours, 8, spec)} "
                f"{_ratio(ours, raw if versus_raw else None, 6)} {_ratio(ours, dbos_value, 7)}"
            )
        idle = f["cpu"]["durable"]["idle"]
        print(
            f"{name:<20} idle durable workers, per second: {idle['workers_ms']:.1f} ms workers' CPU, "
            f"{idle['database_ms']:.1f} ms its database's backends, {idle['postgres_ms']:.1f} ms whole server, "
            f"{idle['xacts']:.1f} transactions, {idle['machine_ms']:.0f} ms machine"
        )
    if theirs:
        idle = theirs["idle"]
        print(
            f"{'DBOS':<20} idle executors, per second: {idle['workers_ms']:.1f} ms executors' CPU, "
            f"{idle['database_ms']:.1f} ms its database's backends, {idle['postgres_ms']:.1f} ms whole server, "
            f"{idle['xacts']:.1f} transactions, {idle['machine_ms']:.0f} ms machine"
        )
