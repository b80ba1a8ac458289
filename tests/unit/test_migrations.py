"""Migrations: models and migrations agree, and every migration is safe while the previous release still runs.

A rolling deploy runs `migrate` while the previous release's processes go on starting and advancing runs
(docs/howto/upgrade.md). From the first migration after the first release onwards, no migration may:

  not-null-without-db-default  add a NOT NULL column without a database default to an existing table: the previous
                               release's inserts do not name the column and fail (Django drops the default it adds the
                               column with, unless the field has `db_default`)
  blocks-writes                scan an existing table under a lock that stops inserts and updates: CREATE INDEX without
                               CONCURRENTLY, a unique constraint not built that way, a CHECK (inline in ADD COLUMN
                               too) or FOREIGN KEY not added NOT VALID, SET NOT NULL, a change of a column's type
  contracts-in-use             drop or rename a column or table the previous release's code still uses (Django selects
                               every column of a model): take the field out of the models in one release (a state-only
                               SeparateDatabaseAndState), drop the column in a later one
  not-rerunnable               change the schema, in a non-atomic migration, with an operation that fails when
                               `migrate` runs again after an interruption

The rules read each operation's SQL on Postgres, as `sqlmigrate` prints it. A migration that follows them uses the
operations of durable_agents/migrations/_operations.py. PREDATE_THE_RULES names what earlier migrations do anyway.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlparse
from django.core.management import call_command
from django.db import connection, migrations, models
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.state import ProjectState

from durable_agents.migrations import _operations

APP = "durable_agents"
CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"

# The last migration of each release. The code of the release before a migration's is what runs while it applies;
# the first release's migrations ran on no earlier code. Cutting a release adds its line.
RELEASES = {"0.1.0": "0007_plans_forks"}

# Findings of migrations written before these rules, and why each stays. A new migration never comes here.
PREDATE_THE_RULES = {
    ("0019_conversation_fidelity", "blocks-writes", "durable_agents_turn.content"): (
        "jsonb to text rewrites the turn table under an exclusive lock; the previous release reads and writes the "
        "text column (models.OrderedJSONField); docs/howto/upgrade.md names the pause"
    ),
    ("0019_conversation_fidelity", "blocks-writes", "durable_agents_turn.tool_results"): (
        "the same rewrite as content's, in the same statement's table"
    ),
}

IDENT = r'"([^"]+)"'
CREATE_TABLE = re.compile(rf"^CREATE TABLE {IDENT}", re.I)
CREATE_INDEX = re.compile(rf"^CREATE (?:UNIQUE )?INDEX (CONCURRENTLY )?(?:IF NOT EXISTS )?{IDENT} ON {IDENT}", re.I)
DROP_TABLE = re.compile(rf"^DROP TABLE (?:IF EXISTS )?{IDENT}", re.I)
ALTER_TABLE = re.compile(rf"^ALTER TABLE (?:ONLY )?(?:IF EXISTS )?{IDENT} (.*)$", re.I | re.S)
ADD_COLUMN = re.compile(rf"ADD COLUMN (?:IF NOT EXISTS )?{IDENT} (.*)$", re.I | re.S)
ADD_CONSTRAINT = re.compile(rf"ADD CONSTRAINT {IDENT} (.*)$", re.I | re.S)
ALTER_TYPE = re.compile(rf"ALTER COLUMN {IDENT} TYPE ([^,;]+?)(?: USING [^,;]+)?(?:,|$)", re.I)
SET_NOT_NULL = re.compile(rf"ALTER COLUMN {IDENT} SET NOT NULL", re.I)
DROP_COLUMN = re.compile(rf"DROP COLUMN (?:IF EXISTS )?{IDENT}", re.I)
RENAME_COLUMN = re.compile(rf"RENAME COLUMN {IDENT}", re.I)
RENAME_TABLE = re.compile(r"^RENAME TO ", re.I)
VARCHAR = re.compile(r"^varchar\((\d+)\)$", re.I)

HOW = {
    "not-null-without-db-default": "give the field db_default= (a constant), as well as default=",
    "blocks-writes": "use _operations' AddFieldWithoutBlockingWrites / AddIndexWithoutBlockingWrites / "
    "AddConstraintWithoutBlockingWrites in a migration with atomic = False; for a new type, a new column",
    "contracts-in-use": "take it out of the models in one release (SeparateDatabaseAndState, state only), drop it "
    "in the next",
    "not-rerunnable": "use _operations' operations: they finish what an interrupted run left",
}


@dataclass(frozen=True)
class Finding:
    migration: str
    rule: str
    target: str
    why: str = field(compare=False)

    def __str__(self) -> str:
        return f"{self.migration}: {self.rule} on {self.target} — {self.why}; fix: {HOW[self.rule]}"


def columns_of(state: ProjectState) -> set[str]:
    """The tables and "table.column"s the code of this migration state reads and writes (Django names them all)."""
    used = set()
    for (app, model_name), model in state.models.items():
        if app != APP:
            continue
        table = model.options.get("db_table") or f"{app}_{model_name}"
        used.add(table)
        for name, model_field in model.fields.items():
            if model_field.many_to_many:
                continue
            column = model_field.db_column or (f"{name}_id" if model_field.is_relation else name)
            used.add(f"{table}.{column}")
    return used


def column_type(state: ProjectState, table: str, column: str) -> str | None:
    for model in state.apps.get_models():
        if model._meta.db_table == table:
            for model_field in model._meta.local_concrete_fields:
                if model_field.column == column:
                    return model_field.db_type(connection)
    return None


def is_widening(old: str | None, new: str) -> bool:
    """varchar(n) to varchar(m >= n) or to text: binary coercible, Postgres changes the catalog only."""
    old_length = VARCHAR.match(old or "")
    new_length = VARCHAR.match(new.strip())
    return bool(old_length) and (new.strip().lower() == "text" or bool(new_length and new_length[1] >= old_length[1]))


def is_rerunnable(operation) -> bool:
    return isinstance(
        operation,
        (
            _operations.AddFieldWithoutBlockingWrites,
            _operations.AddIndexWithoutBlockingWrites,
            _operations.AddConstraintWithoutBlockingWrites,
            _operations.RemoveIndexWithoutBlockingWrites,
            _operations.AlterFieldIndexWithoutBlockingWrites,
            _operations.SetDatabaseDefault,
            # The migration's author makes it idempotent: it may run again after an interruption.
            migrations.RunPython,
        ),
    )


def statement_findings(name: str, sql: str, created: set[str], used: set[str], before: ProjectState) -> list[Finding]:
    """What one SQL statement of migration `name` does to a table that exists and that the previous code uses."""
    found: list[Finding] = []

    def finding(rule: str, target: str, why: str) -> None:
        found.append(Finding(name, rule, target, why))

    if match := CREATE_INDEX.match(sql):
        concurrent, index, table = match.groups()
        if table not in created and not concurrent:
            finding("blocks-writes", index, f"CREATE INDEX on {table} holds a SHARE lock (no writes) while it builds")
        return found
    if (match := DROP_TABLE.match(sql)) and match[1] in used:
        finding("contracts-in-use", match[1], "DROP TABLE of a table the previous code uses")
    if not (match := ALTER_TABLE.match(sql)) or match[1] in created:
        return found
    table, action = match.groups()
    if RENAME_TABLE.match(action) and table in used:
        finding("contracts-in-use", table, "RENAME of a table the previous code uses")
    if match := ADD_COLUMN.match(action):
        column, definition = match.groups()
        if re.search(r"\bCHECK\b", definition, re.I):
            finding(
                "blocks-writes",
                f"{table}.{column}",
                "a CHECK inline in ADD COLUMN is verified by a scan under ACCESS EXCLUSIVE",
            )
        # Postgres skips verifying a foreign key on a column it adds without a default (parse_utilcmd.c,
        # transformFKConstraints): only a default makes the inline REFERENCES scan.
        if re.search(r"\bREFERENCES\b", definition, re.I) and re.search(r"\bDEFAULT\b", definition, re.I):
            finding("blocks-writes", f"{table}.{column}", "an inline REFERENCES on a column with a default scans")
    if match := ADD_CONSTRAINT.match(action):
        constraint, definition = match.groups()
        if re.match(r"(FOREIGN KEY|CHECK)\b", definition, re.I) and not re.search(r"\bNOT VALID\b", definition, re.I):
            finding("blocks-writes", constraint, "a CHECK or FOREIGN KEY added without NOT VALID scans under lock")
        if re.match(r"(UNIQUE|PRIMARY KEY|EXCLUDE)\b", definition, re.I) and "USING INDEX" not in definition.upper():
            finding("blocks-writes", constraint, "a unique constraint builds its index under a write-blocking lock")
    for column, new_type in ALTER_TYPE.findall(action):
        if not is_widening(column_type(before, table, column), new_type):
            finding("blocks-writes", f"{table}.{column}", f"a change of type to {new_type} rewrites the table")
    for column in SET_NOT_NULL.findall(action):
        finding("blocks-writes", f"{table}.{column}", "SET NOT NULL scans under ACCESS EXCLUSIVE")
    for column in [*DROP_COLUMN.findall(action), *RENAME_COLUMN.findall(action)]:
        if f"{table}.{column}" in used:
            finding("contracts-in-use", f"{table}.{column}", "a drop or rename of a column the previous code uses")
    return found


def lint(migration: migrations.Migration, state: ProjectState, used: set[str]) -> list[Finding]:
    """The findings of one migration applied on `state`, the previous code using `used` (see columns_of)."""
    found: list[Finding] = []
    created: set[str] = set()
    with connection.schema_editor(collect_sql=True, atomic=migration.atomic) as editor:
        for operation in migration.operations:
            before = state.clone()
            operation.state_forwards(APP, state)
            if not operation.reduces_to_sql:
                continue
            start = len(editor.collected_sql)
            operation.database_forwards(APP, editor, before, state)
            # Django defers some statements (a new field's indexes) to the migration's end: they are this one's.
            for deferred in editor.deferred_sql:
                editor.execute(deferred)
            editor.deferred_sql.clear()
            statements = [
                statement.strip().rstrip(";")
                for sql in editor.collected_sql[start:]
                for statement in sqlparse.split(sql)
                if statement.strip()
            ]
            for sql in statements:
                if match := CREATE_TABLE.match(sql):
                    created.add(match[1])
                found += statement_findings(migration.name, sql, created, used, before)
            if isinstance(operation, migrations.AddField) and not operation.field.null:
                table = state.apps.get_model(APP, operation.model_name)._meta.db_table
                if table not in created and not operation.field.has_db_default():
                    found.append(
                        Finding(
                            migration.name,
                            "not-null-without-db-default",
                            f"{table}.{operation.name}",
                            "the previous release's inserts do not name it",
                        )
                    )
            if not migration.atomic and statements and not is_rerunnable(operation):
                found.append(
                    Finding(
                        migration.name,
                        "not-rerunnable",
                        operation.describe(),
                        "in a non-atomic migration it fails when migrate runs again after an interruption",
                    )
                )
    return found


@functools.cache
def lint_all() -> tuple[Finding, ...]:
    """The findings of every migration after the first release (cached: two tests read them)."""
    loader = MigrationLoader(None, ignore_no_migrations=True)
    [leaf] = loader.graph.leaf_nodes(APP)
    names = [name for app, name in loader.graph.forwards_plan(leaf) if app == APP]
    releases = [names.index(last) for last in RELEASES.values()]
    found: list[Finding] = []
    for position in range(min(releases) + 1, len(names)):
        name = names[position]
        previous_release = names[max(last for last in releases if last < position)]
        before = loader.project_state((APP, name), at_end=False)
        used = columns_of(loader.project_state((APP, previous_release))) | columns_of(before)
        found += lint(loader.disk_migrations[APP, name], before, used)
    return tuple(found)


def final_state() -> ProjectState:
    loader = MigrationLoader(None, ignore_no_migrations=True)
    return loader.project_state(loader.graph.leaf_nodes(APP)[0])


def probe(*operations, atomic: bool = True) -> set[tuple[str, str]]:
    """The (rule, target) findings of a migration made of `operations`, next after the newest."""
    migration = type("Migration", (migrations.Migration,), {"operations": list(operations), "atomic": atomic})(
        "9999_probe", APP
    )
    state = final_state()
    return {(found.rule, found.target) for found in lint(migration, state, columns_of(state))}


@pytest.mark.django_db
def test_migrations__no_model_change_lacks_a_migration():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db
def test_migrations__each_is_safe_while_the_previous_release_runs():
    unsafe = [found for found in lint_all() if (found.migration, found.rule, found.target) not in PREDATE_THE_RULES]
    assert not unsafe, "unsafe during a rolling deploy:\n" + "\n".join(map(str, unsafe))


@pytest.mark.django_db
def test_migrations__what_predates_the_rules_is_still_found():
    found = {(found.migration, found.rule, found.target) for found in lint_all()}
    stale = set(PREDATE_THE_RULES) - found
    assert not stale, f"PREDATE_THE_RULES names findings the linter no longer makes, remove them: {sorted(stale)}"


def test_migrations__every_release_names_its_last_migration():
    released = re.findall(r"^## (\d+\.\d+\.\d+)\b", CHANGELOG.read_text(), re.M)
    missing = set(released) - set(RELEASES)
    assert not missing, f"CHANGELOG.md releases {sorted(missing)}: add each one's last migration to RELEASES"
    on_disk = {path.stem for path in (Path(_operations.__file__).parent).glob("0*.py")}
    assert set(RELEASES.values()) <= on_disk, f"RELEASES names migrations that do not exist: {RELEASES}"


RUN = "durable_agents_run"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("operations", "atomic", "expected"),
    [
        pytest.param(
            [migrations.AddField("run", "retries", models.IntegerField(default=0))],
            True,
            {("not-null-without-db-default", f"{RUN}.retries")},
            id="not-null-with-a-python-default-only",
        ),
        pytest.param(
            [migrations.AddIndex("run", models.Index(fields=["finished_at"], name="probe_finished"))],
            True,
            {("blocks-writes", "probe_finished")},
            id="plain-index",
        ),
        pytest.param(
            [migrations.AddConstraint("run", models.UniqueConstraint(fields=["workflow", "input_hash"], name="probe"))],
            True,
            {("blocks-writes", "probe")},
            id="plain-unique-constraint",
        ),
        pytest.param(
            [migrations.AddField("run", "retries", models.PositiveIntegerField(null=True))],
            True,
            {("blocks-writes", f"{RUN}.retries")},
            id="inline-check",
        ),
        pytest.param(
            [migrations.AddField("run", "probe", models.ForeignKey("durable_agents.run", models.SET_NULL, null=True))],
            True,
            {("blocks-writes", "durable_agents_run_probe_id_cdb84c65")},
            id="foreign-key-index",
        ),
        pytest.param(
            [migrations.AlterField("run", "cursor", models.BigIntegerField(default=0))],
            True,
            {("blocks-writes", f"{RUN}.cursor")},
            id="type-change",
        ),
        pytest.param(
            [migrations.AlterField("run", "wake_at", models.DateTimeField())],
            True,
            {("blocks-writes", f"{RUN}.wake_at")},
            id="set-not-null",
        ),
        pytest.param(
            [migrations.RemoveField("run", "cancel_reason")],
            True,
            {("contracts-in-use", f"{RUN}.cancel_reason")},
            id="drop-a-used-column",
        ),
        pytest.param(
            [migrations.RenameField("run", "cancel_reason", "why_cancelled")],
            True,
            {("contracts-in-use", f"{RUN}.cancel_reason")},
            id="rename-a-used-column",
        ),
        pytest.param(
            [migrations.RunSQL(f'ALTER TABLE "{RUN}" DROP COLUMN "cancel_reason"', migrations.RunSQL.noop)],
            True,
            {("contracts-in-use", f"{RUN}.cancel_reason")},
            id="drop-a-used-column-in-sql",
        ),
        pytest.param(
            [migrations.DeleteModel("Schedule")],
            True,
            {("contracts-in-use", "durable_agents_schedule")},
            id="drop-a-used-table",
        ),
        pytest.param(
            [migrations.RenameModel("Schedule", "Timetable")],
            True,
            {("contracts-in-use", "durable_agents_schedule")},
            id="rename-a-used-table",
        ),
        pytest.param(
            [migrations.AddField("run", "note", models.TextField(null=True))],
            False,
            {("not-rerunnable", "Add field note to run")},
            id="plain-operation-in-a-non-atomic-migration",
        ),
    ],
)
def test_lint__refuses_what_breaks_a_rolling_deploy(operations, atomic, expected):
    assert probe(*operations, atomic=atomic) == expected


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("operations", "atomic"),
    [
        pytest.param([migrations.AddField("run", "note", models.TextField(null=True))], True, id="nullable-column"),
        pytest.param(
            [migrations.AlterField("run", "workflow", models.CharField(max_length=300))], True, id="widen-varchar"
        ),
        pytest.param(
            [
                _operations.AddFieldWithoutBlockingWrites(
                    "run", "retries", models.PositiveIntegerField(db_default=0, default=0)
                ),
                _operations.AddFieldWithoutBlockingWrites(
                    "run", "probe", models.ForeignKey("durable_agents.run", models.SET_NULL, null=True)
                ),
                _operations.AddIndexWithoutBlockingWrites("run", models.Index(fields=["retries"], name="probe_r")),
                _operations.RemoveIndexWithoutBlockingWrites("run", "probe_r"),
                _operations.AlterFieldIndexWithoutBlockingWrites(
                    "run", "probe", models.ForeignKey("durable_agents.run", models.SET_NULL, null=True, db_index=False)
                ),
                _operations.AddConstraintWithoutBlockingWrites(
                    "run",
                    models.UniqueConstraint(
                        fields=["probe", "retries"], condition=models.Q(probe__isnull=False), name="probe_u"
                    ),
                ),
            ],
            False,
            id="the-operations-that-do-not-block",
        ),
        pytest.param(
            [
                migrations.SeparateDatabaseAndState(state_operations=[migrations.RemoveField("run", "cancel_reason")]),
            ],
            True,
            id="models-let-go-of-a-column-first",
        ),
        pytest.param(
            [
                migrations.CreateModel(
                    "Probe",
                    [
                        ("id", models.BigAutoField(primary_key=True)),
                        ("run", models.ForeignKey("durable_agents.run", models.CASCADE)),
                        ("n", models.PositiveIntegerField()),
                    ],
                ),
                migrations.AddIndex("probe", models.Index(fields=["n"], name="probe_n")),
            ],
            True,
            id="a-new-table",
        ),
    ],
)
def test_lint__allows_what_the_previous_release_runs_beside(operations, atomic):
    assert probe(*operations, atomic=atomic) == set()


@pytest.mark.django_db
def test_lint__allows_dropping_a_column_the_previous_release_no_longer_uses():
    state = final_state()
    used = columns_of(state) - {f"{RUN}.cancel_reason"}
    migration = type(
        "Migration",
        (migrations.Migration,),
        {"operations": [migrations.RunSQL(f'ALTER TABLE "{RUN}" DROP COLUMN "cancel_reason"', migrations.RunSQL.noop)]},
    )("9999_probe", APP)
    assert lint(migration, state, used) == []
