"""Giving a database connection back before a wait on the network (no models: importable before the apps)."""

from __future__ import annotations

from django.db import connection


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
