"""Database connections a step gives back before a wait on the network, or drops after they broke (no models:
importable before the apps)."""

from __future__ import annotations

import contextlib

from django.db import DatabaseError, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper


def release_connection(*, pooled_only: bool = False) -> None:
    """Give this thread's (greenlet's) database connection back before a wait on the network: to the pool
    (Django's psycopg pool, on the model worker), or closed; the next query takes one again. Inside a
    transaction it is kept, as the transaction needs it. `pooled_only`: keep an unpooled connection (a
    reconnect would cost more than the wait, e.g. a short call to an outside system from a prefork worker)."""
    if connection.in_atomic_block:
        return
    if pooled_only and not (connection.settings_dict.get("OPTIONS") or {}).get("pool"):
        return
    connection.close()


def fresh_connection() -> bool:
    """Drop this thread's connection after a database error on it, so the next query works on a fresh one; False
    inside a transaction, which cannot move to another connection.

    Without a pool the next query opens a new connection. With Django's psycopg pool, `close()` gives the
    connection back, and the pool discards one it finds broken on its return and opens another (psycopg_pool
    `ConnectionPool._return_connection`: a connection in state UNKNOWN, i.e. BAD, is not put back). But the pool
    does not test the idle connections it hands out — "The pool doesn't actively check the state of the
    connections held in its state ... the application might be served a connection in broken state" (psycopg 3
    docs, Connection pools > Connection quality) — so after a server restart or a `pg_terminate_backend` every idle
    one may be dead too: `pool.check()` tests each of them now and replaces the broken ones.

    Example::

        except OperationalError:
            if fresh_connection():
                write()  # once more, on a connection that works
    """
    if connection.in_atomic_block:
        return False
    _drop(connection)
    return True


def drop_connections() -> None:
    """After a database error (a task that failed): drop every dead connection of this thread, and test the idle
    ones of their pools as `fresh_connection` does — so that the next task does not meet the next dead one (one
    failure per worker after a restart, not one per pooled connection). A connection that works (the error was a
    statement timeout, a deadlock) is kept, and so is one inside a transaction, which cannot move to another."""
    for each in connections.all(initialized_only=True):
        if not each.in_atomic_block and _is_dead(each):
            _drop(each)


def _is_dead(each: BaseDatabaseWrapper) -> bool:
    raw = each.connection
    if raw is None:
        return False
    broken = getattr(raw, "broken", None)  # psycopg 3: the connection was lost
    if broken is None:
        return True  # a driver that cannot tell: dropped, to be safe
    return bool(broken or raw.closed)


def _drop(each: BaseDatabaseWrapper) -> None:
    with contextlib.suppress(DatabaseError):
        each.close()  # dropped even when closing it fails: Django forgets it either way
    pool = getattr(each, "pool", None)  # Django's PostgreSQL backend: None without OPTIONS["pool"]
    if pool is not None and not pool.closed:
        pool.check()
