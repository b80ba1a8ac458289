"""Helpers of the interleaving tests (sagas, claims, forks): a ledger's entries and their net, an action run on a
connection of its own in another thread, joined before the test's next act, and waits on Postgres' own lock table
(no sleeps for timing)."""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

from django.db import connection, connections

from tests.testapp.models import LedgerEntry


def ledger(order_id: str) -> list[tuple[str, Decimal]]:
    return list(LedgerEntry.objects.filter(order_id=order_id).order_by("id").values_list("kind", "amount"))


def net(order_id: str) -> Decimal:
    """What the order was charged, net of refunds (the ledger's entries summed)."""
    return sum((amount for _, amount in ledger(order_id)), Decimal(0))


# Only this test's database: another session on the same server (the example project's, run beside this one) has
# lock waits of its own. A row lock is waited for as a `transactionid` lock, whose `database` is null: the waiting
# backend's database is read from pg_stat_activity.
WAITING_HERE = (
    "FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE NOT l.granted AND a.datname = current_database()"
)


def someone_waits_for_a_lock() -> bool:
    """True while a transaction waits for a row lock another holds (read in the caller's own connection)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) {WAITING_HERE}")
        return cursor.fetchone()[0] > 0


def until_blocked_on_a_lock(thread: threading.Thread, statement: str = "") -> None:
    """Wait until another backend waits for a lock (pg_locks is read live) while running `statement`."""
    for _ in range(20_000):
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(f"SELECT a.query {WAITING_HERE}")
            if any(statement in query for (query,) in cursor.fetchall()):
                return
        assert thread.is_alive(), "the other connection finished without waiting for the lock"
        threading.Event().wait(0.001)
    raise AssertionError("the other connection never blocked on the lock")


def in_another_connection(action) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = action()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the caller
            out["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict[str, Any]) -> Any:
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
