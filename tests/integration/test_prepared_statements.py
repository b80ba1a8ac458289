"""The engine's hot statements are prepared on the server where the connection keeps a session, and never where a
transaction-mode pooler stands between (engine/statements.py).

psycopg prepares a statement sent through a server-binding cursor once its connection's `prepare_threshold` is
reached; `pg_prepared_statements` lists what this session prepared (PostgreSQL docs, "pg_prepared_statements": "the
prepared statements available in the current session"). Django connects with `prepare_threshold` None unless
OPTIONS names a number, and its own cursors bind on the client, which never prepares (psycopg's ClientCursor).
"""

from __future__ import annotations

import pytest
from django.db import connection, connections

from durable_agents import api
from durable_agents.engine import statements
from durable_agents.models import Run
from durable_agents.testing import drive, wait_for_run

pytestmark = pytest.mark.django_db(transaction=True)


def prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.fixture(autouse=True)
def fresh_session():
    connection.close()  # a session of its own: nothing prepared yet
    yield
    connection.close()


def test_on_a_direct_connection_the_claim_and_the_commit_are_prepared_once_and_reused():
    for _ in range(3):
        assert drive(api.start("noop", {"steps": 2}).id).status == "completed"
    texts = prepared()
    assert any("RETURNING *" in text and "lease_token" in text for text in texts), texts  # the claim and load
    assert any("held AS" in text for text in texts), texts  # the commit
    # Reused, not prepared again: one prepared statement per statement text.
    assert len(texts) == len(set(texts))
    # Django's own queries are not prepared.
    assert not any('"durable_agents_run"."workflow"' in text for text in texts)


def test_django_own_queries_stay_unprepared_on_a_connection_that_binds_on_the_server(monkeypatch):
    """Django's OPTIONS["server_side_binding"] makes its own cursors bind on the server; with prepare_threshold None
    (Django's default) they never prepare. Preparing the engine's statements must not make every ORM query of the
    project a prepared statement too."""
    options = {**(connection.settings_dict.get("OPTIONS") or {}), "server_side_binding": True}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    for _ in range(2):
        assert drive(api.start("noop", {"steps": 2}).id).status == "completed"
    texts = prepared()
    assert any("held AS" in text for text in texts), texts  # the engine's commit is prepared
    orm = [text for text in texts if '"durable_agents_run"."' in text or '"durable_agents_step"."' in text]
    assert orm == [], f"the ORM's own queries were prepared: {orm}"


@pytest.mark.parametrize("pooler_setting", ["DISABLE_SERVER_SIDE_CURSORS", "prepare_threshold None"])
def test_behind_a_transaction_mode_pooler_nothing_is_prepared(pooler_setting, monkeypatch):
    # Either of the two settings docs/howto/poolers.md gives for PgBouncer in transaction mode.
    if pooler_setting == "DISABLE_SERVER_SIDE_CURSORS":
        monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)
    else:
        options = {**(connection.settings_dict.get("OPTIONS") or {}), "prepare_threshold": None}
        monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    assert not statements.prepares()
    assert drive(api.start("noop", {"steps": 2}).id).status == "completed"
    assert prepared() == []


@pytest.mark.parametrize("chosen", [True, False])
def test_the_setting_decides_outright(chosen, settings, monkeypatch):
    settings.DURABLE_AGENTS = {**getattr(settings, "DURABLE_AGENTS", {}), "PREPARED_STATEMENTS": chosen}
    monkeypatch.setitem(connection.settings_dict, "DISABLE_SERVER_SIDE_CURSORS", True)
    assert statements.prepares() is chosen
    assert drive(api.start("noop", {"steps": 2}).id).status == "completed"
    assert bool(prepared()) is chosen


MIGRATIONS = {
    # A column the claim returns widened (varchar(200) to varchar(255)): its result's type changed.
    "a returned column widened": (
        "ALTER TABLE {table} ALTER COLUMN workflow TYPE varchar(255)",
        "ALTER TABLE {table} ALTER COLUMN workflow TYPE varchar(200)",
    ),
    # A column added to the claimed table, which the claim's UPDATE returns whole (RETURNING *) inside the statement.
    "a column added": (
        "ALTER TABLE {table} ADD COLUMN added_by_a_later_release integer",
        "ALTER TABLE {table} DROP COLUMN added_by_a_later_release",
    ),
}


@pytest.fixture(params=sorted(MIGRATIONS))
def migration(request):
    """A migration run beside live workers, from a connection of its own (as `manage.py migrate` is); undone
    afterwards."""
    forward, backward = (sql.format(table=Run._meta.db_table) for sql in MIGRATIONS[request.param])

    def run(sql: str) -> None:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute(sql)
        finally:
            other.close()

    yield lambda: run(forward)
    run(backward)


def test_a_migration_beside_a_live_worker_does_not_stop_its_claims(start_worker, migration):
    """A rolling deploy migrates while the old workers run. Postgres refuses to run a statement prepared before a
    column its result holds changed type: "cached plan must not change result type", every time, on that session,
    and psycopg keeps sending it (a worker keeps its connection across tasks). The worker must prepare it anew, not
    fail every claim until it is restarted."""
    start_worker()
    for _ in range(3):  # the claim prepared there: a statement is prepared at its second use on a connection
        assert wait_for_run(api.start("noop", {"steps": 2}).id, "completed", timeout=30)
    migration()
    run = api.start("noop", {"steps": 2})
    assert wait_for_run(run.id, "completed", timeout=30), "the worker's claims failed after the migration"


def test_a_statement_is_prepared_at_its_second_use_on_a_connection_not_its_first():
    """A worker without a pool closes its connection while a step waits on the model: a statement prepared at its
    first use would be prepared for one use, a round trip more than sending it plain."""
    run = api.start("noop", {"steps": 1})
    drive(run.id)
    assert prepared() == [], "one claim, one commit: nothing sent twice, nothing prepared"
    drive(api.start("noop", {"steps": 1}).id)
    assert prepared(), "the second run's claim and commit are prepared"


def test_a_session_that_lost_its_prepared_statements_goes_on_plain_and_says_why(caplog, monkeypatch):
    """An undeclared transaction-mode pooler hands the next transaction another server session, without the
    statements psycopg prepared: Postgres refuses the name (SQLSTATE 26000) before running anything, so the statement
    is sent again plain, and the process prepares nothing more (a WARNING names the settings to add)."""
    monkeypatch.setattr(statements, "_pooler_seen", False)
    for _ in range(2):
        drive(api.start("noop", {"steps": 2}).id)
    assert prepared()
    with connection.cursor() as cursor:
        # The server forgets them, psycopg does not see it (as when a pooler switches the session under it).
        cursor.execute("DO $$BEGIN EXECUTE 'DEALLOCATE ALL'; END$$")
    assert drive(api.start("noop", {"steps": 2}).id).status == "completed"
    assert not statements.prepares()
    assert "pooler in transaction mode" in caplog.text and "docs/howto/poolers.md" in caplog.text
    assert prepared() == []
