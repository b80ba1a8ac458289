"""Upgrades on real Postgres: migrations applied while the previous release runs, interrupted, and compared.

Each test migrates a database of its own (a scratch database beside the test database), one migration at a time
from the end of the first release (tests/unit/test_migrations.py: RELEASES), as an install upgrading from it does.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from io import BytesIO
from pathlib import Path

import psycopg
import pytest
from django.db import DatabaseError, connections, migrations
from django.db.migrations.executor import MigrationExecutor
from django.db.migrations.state import ProjectState
from django.test import override_settings
from django.utils import timezone

from durable_agents import api
from durable_agents.models import Run
from durable_agents.testing import wait_for_run
from tests.unit.test_migrations import APP, RELEASES

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = "upgrade_scratch"
# An insert that waits longer than this for a lock is taken as blocked. An insert that is not blocked waits for
# no lock at all, so a busy machine cannot make it fail (Postgres: lock_timeout counts lock waits only).
BLOCKED_AFTER = "5s"
WAIT_SECONDS = 120.0


class Scratch:
    """Empty databases beside the test database, each under a connection alias of its own, dropped after the test."""

    def __init__(self) -> None:
        self.base = dict(connections["default"].settings_dict)
        self.aliases: list[str] = []
        self.names: list[str] = []

    def server(self) -> psycopg.Connection:
        return psycopg.connect(
            dbname="postgres",
            host=self.base["HOST"] or None,
            port=self.base["PORT"] or None,
            user=self.base["USER"] or None,
            password=self.base["PASSWORD"] or None,
            autocommit=True,
        )

    def database(self) -> str:
        alias = f"{SCRATCH}_{len(self.names)}"
        name = f"{self.base['NAME']}_{alias}_{uuid.uuid4().hex[:6]}"[:63]
        with self.server() as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.names.append(name)
        return self.register(alias, name)

    def another(self, alias: str, role: str) -> str:
        """A second connection (alias) to the database of `alias`: a transaction of its own in this thread."""
        return self.register(f"{alias}_{role}", connections.settings[alias]["NAME"])

    def register(self, alias: str, name: str) -> str:
        connections.settings[alias] = {**self.base, "NAME": name}
        self.aliases.append(alias)
        return alias

    def drop(self) -> None:
        for alias in self.aliases:
            connections[alias].close()
            del connections[alias]
            del connections.settings[alias]
        with self.server() as admin:
            for name in self.names:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def scratch(django_db_blocker) -> Iterator[Scratch]:
    with django_db_blocker.unblock():
        made = Scratch()
        try:
            yield made
        finally:
            made.drop()


def migration_names() -> list[str]:
    executor = MigrationExecutor(None)
    [leaf] = executor.loader.graph.leaf_nodes(APP)
    return [name for app, name in executor.loader.graph.forwards_plan(leaf) if app == APP]


def first_release() -> str:
    names = migration_names()
    return min(RELEASES.values(), key=names.index)


def migrate(alias: str, name: str) -> None:
    """Migrate the database of `alias` to `name` as `manage.py migrate durable_agents NAME` does (its executor)."""
    executor = MigrationExecutor(connections[alias])
    executor.migrate([(APP, name)])
    connections[alias].close()


def state_before(name: str) -> ProjectState:
    return MigrationExecutor(None).loader.project_state((APP, name), at_end=False)


def state_after(name: str) -> ProjectState:
    return MigrationExecutor(None).loader.project_state((APP, name))


SAMPLES = {
    "CharField": lambda n: f"{n}",
    "TextField": lambda n: f"{n}",
    "JSONField": lambda n: {"n": n},
    "OrderedJSONField": lambda n: {"n": n},
    "BooleanField": lambda n: False,
    "DateTimeField": lambda n: timezone.now(),
    "UUIDField": lambda n: uuid.uuid4(),
    "DecimalField": lambda n: Decimal(0),
    "BinaryField": lambda n: b"x",
    "DurationField": lambda n: timedelta(0),
    "FloatField": lambda n: 0.0,
}


def insert_as(state: ProjectState, alias: str, model_names: list[str], counter: list[int]) -> list[str]:
    """A raw INSERT into each table, naming the columns the code of `state` knows — as its Django inserts do, with
    a value for every one of them — and no other. Returns what failed, with Postgres' error."""
    failures = []
    rows: dict[str, object] = {}
    connection = connections[alias]
    for model_name in model_names:
        if (APP, model_name) not in state.models:
            continue
        model = state.apps.get_model(APP, model_name)
        columns, values = [], []
        for model_field in model._meta.local_concrete_fields:
            counter[0] += 1
            if model_field.primary_key and model_field.get_internal_type() != "UUIDField":
                continue  # an identity column
            if model_field.is_relation:
                value = rows[model_field.related_model._meta.model_name] if not model_field.null else None
            elif model_field.has_default():
                value = model_field.get_default()
            elif model_field.null:
                value = None
            else:
                kind = model_field.get_internal_type()
                value = counter[0] if "Integer" in kind else SAMPLES[kind](counter[0])
            columns.append(connection.ops.quote_name(model_field.column))
            values.append(model_field.get_db_prep_save(value, connection))
        pk = model._meta.pk
        sql = (
            f"INSERT INTO {connection.ops.quote_name(model._meta.db_table)} ({', '.join(columns)}) "
            f"VALUES ({', '.join(['%s'] * len(values))}) RETURNING {connection.ops.quote_name(pk.column)}"
        )
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, values)
                rows[model_name] = cursor.fetchone()[0]
        except DatabaseError as error:
            failures.append(f"{model_name}: {str(error).splitlines()[0]}")
            break
    return failures


INSERTED = ["run", "step", "wait", "effect", "event", "turn", "payload", "schedule", "batchturn"]


def test_upgrade__the_previous_releases_inserts_succeed_after_each_migration(scratch):
    """While `migrate` runs, processes of the previous release go on inserting rows without the columns added since
    (Django names every column of its models, and only those). After each migration, an INSERT as the first
    release's code writes it, and one as the code just before the migration writes it, succeed."""
    alias = scratch.database()
    names = migration_names()
    released = first_release()
    migrate(alias, released)
    counter = [0]
    failures = []
    for name in names[names.index(released) + 1 :]:
        previous_code = state_before(name)
        migrate(alias, name)
        for who, state in (("the first release", state_after(released)), ("the code before it", previous_code)):
            failures += [f"after {name}, {who}: {failure}" for failure in insert_as(state, alias, INSERTED, counter)]
    assert not failures, "inserts of the previous code failed during the upgrade:\n" + "\n".join(failures)


def is_index_build(operation: migrations.operations.base.Operation) -> bool:
    return isinstance(operation, (migrations.AddIndex, migrations.AddConstraint))


class Migrating(threading.Thread):
    """`migrate durable_agents NAME` on the database of `alias`, in a thread (so a connection) of its own. With
    `pause`, each index build first reports ("build", operation) on `reports` and waits for a word on `resume`."""

    def __init__(self, alias: str, name: str, *, pause: bool = False) -> None:
        super().__init__(daemon=True)
        self.alias, self.name, self.pause = alias, name, pause
        self.pid: queue.Queue[int] = queue.Queue()
        self.reports: queue.Queue[tuple[str, object]] = queue.Queue()
        self.resume: queue.Queue[str] = queue.Queue()
        self.error: BaseException | None = None

    def run(self) -> None:
        connection = connections[self.alias]
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid.put(cursor.fetchone()[0])
            executor = MigrationExecutor(connection)
            # Operations are shared by every load of a migration (class attributes): the pauses go after this run.
            paused = [
                operation
                for operation in executor.loader.get_migration(APP, self.name).operations
                if self.pause and is_index_build(operation)
            ]
            for operation in paused:
                operation.database_forwards = self.paused(operation, operation.database_forwards)
            try:
                executor.migrate([(APP, self.name)])
            finally:
                for operation in paused:
                    del operation.database_forwards
        except Exception as error:  # noqa: BLE001 - the test reads it
            self.error = error
        finally:
            connection.close()
            self.reports.put(("done", None))

    def paused(self, operation, forwards):  # type: ignore[no-untyped-def]
        def run_when_told(*args):  # type: ignore[no-untyped-def]
            self.reports.put(("build", operation))
            self.resume.get(timeout=WAIT_SECONDS)
            return forwards(*args)

        return run_when_told


def waits_for_a_lock(alias: str, pid: int) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row) and row[0] == "Lock"


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.02)


def with_lock_timeout(alias: str) -> str:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SET lock_timeout = '{BLOCKED_AFTER}'")
    return alias


def rows_up_to(model_name: str) -> list[str]:
    """The tables to insert into for a row of `model_name`: it and those its foreign keys need."""
    return INSERTED[: INSERTED.index(model_name) + 1] if model_name in INSERTED else ["run"]


def test_upgrade__starts_go_on_while_each_index_builds(scratch):
    """An index built on a live table lets the previous release's starts through. A start whose transaction is
    still open when the build begins makes any build wait for it; meanwhile the next start must not wait for the
    build. CREATE INDEX CONCURRENTLY holds SHARE UPDATE EXCLUSIVE, which inserts (ROW EXCLUSIVE) do not conflict
    with; a plain CREATE INDEX asks for SHARE, and every insert after it queues behind that request (Postgres docs,
    "Explicit Locking: Table-Level Locks"; CREATE INDEX, "Building Indexes Concurrently")."""
    alias = scratch.database()
    open_start = with_lock_timeout(scratch.another(alias, "open_start"))
    next_start = with_lock_timeout(scratch.another(alias, "next_start"))
    names = migration_names()
    released = first_release()
    migrate(alias, released)
    counter = [0]
    failures: list[str] = []
    builds = 0
    for name in names[names.index(released) + 1 :]:
        previous_code = state_before(name)
        migrating = Migrating(alias, name, pause=True)
        migrating.start()
        pid = migrating.pid.get(timeout=WAIT_SECONDS)
        while (report := migrating.reports.get(timeout=WAIT_SECONDS))[0] != "done":
            operation = report[1]
            builds += 1
            tables = rows_up_to(operation.model_name_lower)
            connections[open_start].set_autocommit(False)
            blocked = insert_as(previous_code, open_start, tables, counter)
            if blocked:
                failures.append(f"{name}, before {operation.describe()}: a start waits already: {blocked[0]}")
                connections[open_start].rollback()
                connections[open_start].set_autocommit(True)
                migrating.resume.put("go")
                continue
            migrating.resume.put("go")
            wait_until(
                lambda pid=pid: waits_for_a_lock(alias, pid), f"{operation.describe()} to wait for the open start"
            )
            failures += [
                f"{name}, {operation.describe()}: {failure}"
                for failure in insert_as(previous_code, next_start, tables, counter)
            ]
            connections[open_start].commit()
            connections[open_start].set_autocommit(True)
        migrating.join(timeout=WAIT_SECONDS)
        assert migrating.error is None, f"{name} failed: {migrating.error!r}"
    assert builds, "no migration builds an index: nothing was tried"
    assert not failures, "starts waited for an index build:\n" + "\n".join(failures)


def test_upgrade__a_migration_interrupted_while_it_builds_an_index_finishes_when_run_again(scratch):
    """A non-atomic migration (the kind that builds an index CONCURRENTLY) commits statement by statement: a deploy
    killed mid-build — or a lock_timeout, or a cancel — leaves it half applied, with an index Postgres marks invalid.
    `migrate` run again must finish it. Any transaction with an older snapshot makes CREATE INDEX CONCURRENTLY wait
    before it marks the index valid (Postgres, CREATE INDEX: "Building Indexes Concurrently"); the build is
    cancelled there."""
    alias = scratch.database()
    holder = scratch.another(alias, "snapshot")
    names = migration_names()
    released = first_release()
    migrate(alias, released)
    interrupted = []
    for name in names[names.index(released) + 1 :]:
        connections[holder].set_autocommit(False)
        with connections[holder].cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            cursor.execute("SELECT 1")
        migrating = Migrating(alias, name)
        migrating.start()
        pid = migrating.pid.get(timeout=WAIT_SECONDS)
        wait_until(
            lambda pid=pid, migrating=migrating: waits_for_a_lock(alias, pid) or not migrating.is_alive(),
            f"{name} to end or wait",
        )
        if migrating.is_alive():
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT pg_cancel_backend(%s)", [pid])
            migrating.join(timeout=WAIT_SECONDS)
            assert migrating.error is not None, f"{name} was not interrupted"
            interrupted.append(name)
        connections[holder].rollback()
        connections[holder].set_autocommit(True)
        if name in interrupted:
            migrate(alias, name)
        else:
            assert migrating.error is None, f"{name} failed: {migrating.error!r}"
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid")
            invalid = [row[0] for row in cursor.fetchall()]
        assert not invalid, f"after {name} ran again, indexes are left invalid: {invalid}"
    assert interrupted, "no migration builds an index concurrently: nothing was interrupted"


# The code before the newest migration: what a rolling deploy of this version replaces.
NEWEST_MIGRATION = "durable_agents/migrations/0*.py"


def git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree of the commit before the one that added the newest migration (its library, tests and settings)."""
    try:
        inside = git("rev-parse", "--is-inside-work-tree").stdout.strip() == b"true"
    except FileNotFoundError:
        inside = False
    if not inside:
        pytest.skip("not a git checkout: the previous version's code is read from the history")
    added = git("log", "-1", "--diff-filter=A", "--format=%H", "--", NEWEST_MIGRATION).stdout.decode().strip()
    archive = git("archive", "--format=tar", f"{added}^", "durable_agents", "tests", "manage.py")
    if not added or archive.returncode:
        pytest.fail(
            f"the history lacks the commit before the newest migration ({archive.stderr.decode().strip()}): "
            "fetch it (git fetch --unshallow)",
            pytrace=False,
        )
    tree = tmp_path_factory.mktemp("previous")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


class previous_migrations:  # noqa: N801 - a context manager read as a clause
    """The previous tree's durable_agents migrations in place of this one's (MIGRATION_MODULES)."""

    def __init__(self, tree: Path) -> None:
        self.package = f"previous_migrations_{uuid.uuid4().hex[:8]}"
        self.path = tree.parent / f"{tree.name}-modules"
        self.path.mkdir(exist_ok=True)
        (self.path / self.package).symlink_to(tree / "durable_agents" / "migrations")
        self.settings = override_settings(MIGRATION_MODULES={APP: self.package})

    def __enter__(self) -> None:
        sys.path.insert(0, str(self.path))
        self.settings.enable()

    def __exit__(self, *exc_info: object) -> None:
        self.settings.disable()
        sys.path.remove(str(self.path))
        for module in [name for name in sys.modules if name.startswith(self.package)]:
            del sys.modules[module]


@contextmanager
def the_default_database_is(alias: str) -> Iterator[None]:
    """Point the default connection at the database of `alias` for a while."""
    default = connections["default"]
    name = default.settings_dict["NAME"]
    default.close()
    default.settings_dict["NAME"] = connections.settings[alias]["NAME"]
    try:
        yield
    finally:
        default.close()
        default.settings_dict["NAME"] = name


def schema_of(alias: str) -> dict[str, list[tuple]]:
    """Columns, indexes and constraints of durable_agents' tables, as Postgres' catalog has them."""
    queries = {
        "columns": """
            SELECT table_name, column_name, ordinal_position, data_type, character_maximum_length, is_nullable,
                   column_default
            FROM information_schema.columns WHERE table_name LIKE 'durable\\_agents\\_%%' ORDER BY 1, 3""",
        "indexes": """
            SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisvalid
            FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_class t ON t.oid = i.indrelid
            WHERE t.relname LIKE 'durable\\_agents\\_%%' ORDER BY 1""",
        "constraints": """
            SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid), convalidated, condeferrable,
                   condeferred
            FROM pg_constraint WHERE conrelid::regclass::text LIKE 'durable\\_agents\\_%%' ORDER BY 1, 2""",
    }
    with connections[alias].cursor() as cursor:
        found = {}
        for kind, sql in queries.items():
            cursor.execute(sql)
            found[kind] = cursor.fetchall()
    return found


def test_upgrade__an_install_migrated_by_the_previous_version_ends_with_the_schema_of_a_fresh_one(
    scratch, previous_tree
):
    """Migrations already applied are edited only in ways that leave the end the same: an install that applied the
    previous version's migrations, then this version's, has the schema a fresh install of this version has
    (indexes, constraints, database defaults) — whatever was made safer since."""
    [leaf] = migration_names()[-1:]
    fresh = scratch.database()
    migrate(fresh, leaf)
    upgraded = scratch.database()
    # Data migrations of earlier versions may read the default database (0018 did): migrate through it.
    with previous_migrations(previous_tree), the_default_database_is(upgraded):
        migrate("default", migration_names()[-1])
    migrate(upgraded, leaf)
    before, after = schema_of(upgraded), schema_of(fresh)
    for kind in after:
        only_upgraded = sorted(set(before[kind]) - set(after[kind]))
        only_fresh = sorted(set(after[kind]) - set(before[kind]))
        assert not only_upgraded and not only_fresh, (
            f"{kind} differ: an upgraded install has {only_upgraded}, a fresh one {only_fresh}"
        )


START = """
import django, durable_agents
django.setup()
from durable_agents import api
print(durable_agents.__file__, api.start("record", {"steps": 3}).id)
"""


@pytest.mark.django_db(transaction=True)
def test_upgrade__the_previous_version_runs_beside_this_one_on_the_new_schema(previous_tree, worker_env, start_worker):
    """A rolling deploy: the database is on this version's schema while the previous version's processes still
    start and advance runs, beside this version's. Each advances runs the other started."""
    old_env = {**worker_env, "PYTHONPATH": str(previous_tree)}

    def start_as_before() -> str:
        started = subprocess.run(
            [sys.executable, "-c", START], cwd=previous_tree, env=old_env, capture_output=True, text=True, timeout=180
        )
        assert started.returncode == 0, f"the previous version could not start a run:\n{started.stderr[-3000:]}"
        where, run_id = started.stdout.split()[-2:]
        assert where.startswith(str(previous_tree)), f"not the previous version's code: {where}"
        return run_id

    theirs = start_as_before()
    ours = api.start("record", {"steps": 3})
    old_worker = start_worker(cwd=previous_tree, env={"PYTHONPATH": str(previous_tree)})
    for run_id in (theirs, ours.id):
        assert wait_for_run(run_id, timeout=WAIT_SECONDS).status == "completed"
    assert executed_by(ours.id) <= old_worker.pids(), "the previous version's worker advanced this version's run"
    old_worker.kill()
    later = start_as_before()
    new_worker = start_worker()
    assert wait_for_run(later, timeout=WAIT_SECONDS).status == "completed"
    assert executed_by(later) <= new_worker.pids(), "this version's worker advanced the previous version's run"
    assert Run.objects.get(pk=later).output is not None


def executed_by(run_id: object) -> set[int]:
    from tests.testapp.models import Execution

    pids = set(Execution.objects.filter(run_id=run_id).values_list("pid", flat=True))
    assert pids, f"no step of {run_id} ran"
    return pids


OWN_PERMISSIONS = "0025_operator_permissions"


def test_upgrade__whoever_held_a_borrowed_permission_holds_the_actions_own_after(scratch):
    """Delivering a signal, forking and triggering a schedule borrowed decide_wait, replan_run and pause_schedule
    until each had its own: an upgrade must not take them from the operators who had them. The new permissions do
    not exist yet when the migration runs (auth's post_migrate creates them after), so it creates them."""
    alias = scratch.database()
    before = migration_names()[migration_names().index(OWN_PERMISSIONS) - 1]
    executor = MigrationExecutor(connections[alias])
    executor.migrate([(APP, before), ("auth", "0012_alter_user_first_name_max_length")])
    apps = executor.loader.project_state([(APP, before), ("auth", "0012_alter_user_first_name_max_length")]).apps
    content_type = apps.get_model("contenttypes", "ContentType").objects.using(alias)
    permission = apps.get_model("auth", "Permission").objects.using(alias)

    def held(model: str, codename: str) -> object:
        kind, _ = content_type.get_or_create(app_label=APP, model=model)
        return permission.create(content_type=kind, codename=codename, name=codename)

    approvers = apps.get_model("auth", "Group").objects.using(alias).create(name="approvers")
    approvers.permissions.add(held("run", "decide_wait"))
    viewers = apps.get_model("auth", "Group").objects.using(alias).create(name="viewers")
    viewers.permissions.add(held("run", "view_run"))
    planner = apps.get_model("auth", "User").objects.using(alias).create(username="planner")
    planner.user_permissions.add(held("run", "replan_run"), held("schedule", "pause_schedule"))
    connections[alias].close()

    migrate(alias, OWN_PERMISSIONS)
    migrate(alias, before)  # reversed, then applied again: nothing is granted twice
    migrate(alias, OWN_PERMISSIONS)

    with connections[alias].cursor() as cursor:
        cursor.execute(
            """SELECT g.name, p.codename FROM auth_group g JOIN auth_group_permissions gp ON gp.group_id = g.id
               JOIN auth_permission p ON p.id = gp.permission_id
               UNION ALL
               SELECT u.username, p.codename FROM auth_user u JOIN auth_user_user_permissions up ON up.user_id = u.id
               JOIN auth_permission p ON p.id = up.permission_id ORDER BY 1, 2"""
        )
        holdings = cursor.fetchall()
        cursor.execute("SELECT name FROM auth_permission WHERE codename = 'signal_run'")
        [(signal_name,)] = cursor.fetchall()
    assert holdings == [
        ("approvers", "decide_wait"),
        ("approvers", "signal_run"),
        ("planner", "fork_run"),
        ("planner", "pause_schedule"),
        ("planner", "replan_run"),
        ("planner", "trigger_schedule"),
        ("viewers", "view_run"),
    ], "each holder of a borrowed permission holds the action's own, and no one else gains anything"
    assert signal_name == "Can deliver a signal to a run", "the permission is created as auth would name it"
