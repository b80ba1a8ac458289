"""The engine's hot statements on Postgres: SQL written once per process, sent with psycopg, prepared on the server
where the connection allows it.

Each statement of a start, of the step loop and of a model turn (startpath.py, hotpath.py, the agents' journal, the
effect path) is built once (`functools.cache`) and sent through `cursor()`: Django's cursor wrapper (its execute
wrappers, query logging and error translation hold) over a psycopg cursor that binds its parameters on the server.
No ORM query compilation, and where the connection allows it no parsing or planning either: psycopg prepares a
statement on the server the second time it is sent on a connection and then sends only its name and parameters
(psycopg's docs, "Prepared statements"); not the first, as a connection closed while a step waits on the network
would prepare each statement for one use.

Prepared where the connection keeps a server session, sent plain otherwise. PgBouncer in transaction mode hands a
client a server connection for one transaction only, and before 1.21 (or without `max_prepared_statements`) loses
a prepared statement between transactions (docs/howto/poolers.md): a project behind it says so with Django's
`DISABLE_SERVER_SIDE_CURSORS` or psycopg's `OPTIONS["prepare_threshold"] = None`, and then nothing is prepared.
`DURABLE_AGENTS["PREPARED_STATEMENTS"]` True or False decides it outright.

Django's own queries are untouched: its cursors bind on the client (psycopg's ClientCursor), which never prepares,
or on the server (OPTIONS["server_side_binding"]) at the project's own `prepare_threshold`; the engine's ask to be
prepared, statement by statement.

A migration run beside live workers (a rolling deploy) may change the type of a column a prepared statement returns
(a varchar widened, a numeric's scale): Postgres then refuses that statement on every session that prepared it
before — "cached plan must not change result type" (SQLSTATE 0A000), each time, before executing anything — and
psycopg keeps sending it by name. Such a statement, sent outside a transaction, is prepared anew and sent once more;
inside one the error stands, and the rollback makes psycopg forget what it prepared. A session that lost a statement
prepared on it (or holds another client's of the same name) has a transaction-mode pooler in front of it that
DATABASES does not declare: the statement is sent plain, a WARNING says what to set, and this process prepares
nothing more.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.utils import CursorDebugWrapper

from durable_agents.conf import settings

logger = logging.getLogger("durable_agents.engine")

# psycopg prepares a statement sent through a server-binding cursor once it was sent this many times. A count no
# statement reaches: psycopg then prepares only what asks for it (`execute(..., prepare=True)`).
ONLY_WHEN_ASKED = 2**62


def prepares(db: Any = None) -> bool:
    """Whether the hot statements are prepared on `db`'s server (default: this thread's default connection)."""
    db = db if db is not None else connections[DEFAULT_DB_ALIAS]
    chosen = settings.PREPARED_STATEMENTS
    if _pooler_seen:
        return False
    if chosen is not None:
        return bool(chosen)
    declared = db.settings_dict
    options = declared.get("OPTIONS") or {}
    if declared.get("DISABLE_SERVER_SIDE_CURSORS"):
        return False
    # Only a None the project wrote says "no prepared statements" (Django's own default None says nothing).
    return "prepare_threshold" not in options or options["prepare_threshold"] is not None


def cursor(db: Any = None) -> Any:
    """A cursor for one of the engine's statements on `db` (default: the default connection), as Django's
    `connection.cursor()` gives, but binding on the server and prepared there where `prepares()` says so.

    Example::

        with statements.cursor() as cursor:
            cursor.execute(_claim_sql(), {"id": run_id, ...})
            row = cursor.fetchone()
    """
    # The connection itself, not django.db.connection: each attribute of that proxy is a lookup in a thread-local.
    db = db if db is not None else connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql" or not prepares(db):
        return db.cursor()  # Django's: bound on the client, never prepared
    # As Django's own cursor(): with CONN_HEALTH_CHECKS, a persistent connection is tested before the first statement
    # of a request or task, and one the server ended (a restart, a failover) replaced rather than failing the step.
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.connection
    if not hasattr(raw, "prepare_threshold"):
        return db.cursor()  # psycopg2: no server-side binding
    import psycopg  # psycopg 3, as the connection is

    if raw.prepare_threshold is None:
        # Django connects with None unless OPTIONS names a number (a number the project chose stays): then none of
        # its queries is prepared, not even through the server-binding cursors of OPTIONS["server_side_binding"].
        # psycopg ignores `prepare=True` under None; a threshold no query reaches keeps Django's queries unprepared.
        raw.prepare_threshold = ONLY_WHEN_ASKED
    bound = _replanning_cursor(psycopg)(raw)
    return _Logged(bound, db) if db.queries_logged else db.make_cursor(bound)


@cache
def _replanning_cursor(psycopg: Any) -> Any:
    """psycopg's server-binding Cursor, preparing each statement at its first use (and anew when a migration changed
    its result's type)."""
    from psycopg import errors, pq

    class Replanning(psycopg.Cursor):  # type: ignore[misc,name-defined]
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            kwargs.setdefault("prepare", _seen_before(self.connection, query))
            try:
                return super().execute(query, params, **kwargs)
            except errors.FeatureNotSupported:
                # Postgres checks a prepared plan before it runs it: refused, nothing was executed. In autocommit
                # the statement can go again; in a transaction it is aborted, and its rollback clears psycopg's cache.
                if self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise
            except (errors.InvalidSqlStatementName, errors.DuplicatePreparedStatement):
                # Refused before it ran, as above: a session that lost (or shares) what psycopg prepared on it.
                _lost_to_a_pooler()
                if self.connection.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise
                return super().execute(query, params, prepare=False)
            # Drop this session's prepared statements; psycopg, seeing the command, forgets its names for them.
            self.connection.execute("DEALLOCATE ALL", prepare=False)
            return super().execute(query, params, **kwargs)

    return Replanning


def _seen_before(raw: Any, query: str) -> bool:
    """Whether `query` was sent on this connection before: prepared at its second use, not its first. A connection
    closed while a step waits on the network (a worker without a pool) would prepare every statement anew, a round
    trip more than sending it plain."""
    seen = raw.__dict__.setdefault("_durable_statements_sent", set())
    if query in seen:
        return True
    seen.add(query)
    return False


# Set when a session lost a statement prepared on it, or held another's of the same name: a transaction-mode pooler
# stands between, though DATABASES does not say so. From then on this process prepares nothing.
_pooler_seen = False


def _lost_to_a_pooler() -> None:
    global _pooler_seen
    if not _pooler_seen:
        logger.warning(
            "a statement prepared on a database connection was lost to another session: a pooler in transaction mode "
            "(PgBouncer) stands between this process and Postgres, but DATABASES does not say so. The engine sends "
            "its statements plain from now on; set DISABLE_SERVER_SIDE_CURSORS and OPTIONS['prepare_threshold'] = "
            "None for this database (docs/howto/poolers.md)"
        )
    _pooler_seen = True


class _Logged(CursorDebugWrapper):
    """Logged as Django logs a query (DEBUG, CaptureQueriesContext), its parameters merged into the text for the
    log only: a server-binding cursor keeps no text of what it sent."""

    def execute(self, sql: str, params: Any = None) -> Any:
        with self.debug_sql(self.db.ops.compose_sql(sql, params), params):
            return super(CursorDebugWrapper, self).execute(sql, params)
