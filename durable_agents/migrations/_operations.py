"""Schema operations that keep an install writable while they run, and that finish what an interrupted run left.

A rolling deploy migrates while the previous release still starts and advances runs. On Postgres, each operation
here holds a lock that blocks writes only for a change of the catalog (milliseconds, once the lock is granted), never
for a scan of a big table; the scans (index builds, constraint validation) run under locks that let inserts and
updates go on:

    AddFieldWithoutBlockingWrites       ADD COLUMN (a NOT NULL column needs a constant `db_default`, which Postgres
                                        11+ stores in the catalog); its CHECK and FOREIGN KEY added NOT VALID, then
                                        validated; its index built CONCURRENTLY
    AddIndexWithoutBlockingWrites       CREATE INDEX CONCURRENTLY
    AddConstraintWithoutBlockingWrites  a unique constraint Postgres keeps as an index: CREATE UNIQUE INDEX CONCURRENTLY
    RemoveIndexWithoutBlockingWrites    DROP INDEX CONCURRENTLY (once the code no longer needs it: a query planned with
                                        it is planned again without it)
    SetDatabaseDefault                  ALTER COLUMN ... SET DEFAULT (catalog only), for installs that applied a
                                        migration before it had its `db_default`

CONCURRENTLY cannot run in a transaction, so a migration using them sets `atomic = False` — and a crash, a kill or a
lock_timeout can stop it between two statements (or leave an index Postgres marks invalid). Running `migrate` again
finishes it: each operation skips what is already done and rebuilds an invalid index. On other databases (SQLite)
each is the plain Django operation, in a transaction of its own, skipped when already done.

Usage (in a migration with `atomic = False`)::

    from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="run", name="retries", field=models.PositiveIntegerField(db_default=0, default=0)
        ),
    ]
"""

from __future__ import annotations

from django.db import NotSupportedError, migrations, transaction
from django.db.models import Index, UniqueConstraint

# Postgres' identifiers are at most 63 bytes (NAMEDATALEN - 1).
MAX_NAME = 63


def is_postgres(schema_editor) -> bool:
    return schema_editor.connection.vendor == "postgresql"


def ensure_not_in_transaction(operation, schema_editor) -> None:
    if schema_editor.connection.in_atomic_block and not is_checking(schema_editor):
        raise NotSupportedError(
            f"{type(operation).__name__} cannot run in a transaction: set atomic = False on the migration"
        )


def is_checking(schema_editor) -> bool:
    """True when `sqlmigrate` only collects the SQL: it shows every statement, whatever the database holds."""
    return schema_editor.collect_sql


def index_validity(schema_editor, quoted_name: str) -> bool | None:
    """True: the index exists and is valid; False: an interrupted CONCURRENTLY build left it invalid; None: absent."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", [quoted_name])
        row = cursor.fetchone()
    return None if row is None else row[0]


def constraint_validity(schema_editor, table: str, name: str) -> bool | None:
    """True: the constraint exists and is validated; False: it exists NOT VALID; None: absent."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT convalidated FROM pg_constraint WHERE conrelid = to_regclass(%s) AND conname = %s",
            [schema_editor.quote_name(table), name],
        )
        row = cursor.fetchone()
    return None if row is None else row[0]


def concurrently(statement):
    """The same CREATE [UNIQUE] INDEX statement, built CONCURRENTLY."""
    for plain in ("CREATE INDEX ", "CREATE UNIQUE INDEX "):
        if statement.template.startswith(plain):
            statement.template = statement.template.replace(plain, f"{plain}CONCURRENTLY ", 1)
            return statement
    raise NotSupportedError(f"not an index build, cannot make it concurrent: {statement}")


def build_index(schema_editor, statement) -> None:
    """Run a CREATE [UNIQUE] INDEX CONCURRENTLY statement unless its index is there and valid; an invalid one (a
    build that was interrupted, or failed on duplicates) is dropped first, since Postgres would keep it as it is."""
    quoted_name = str(statement.parts["name"])
    if not is_checking(schema_editor):
        valid = index_validity(schema_editor, quoted_name)
        if valid:
            return
        if valid is False:
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {quoted_name}")
    schema_editor.execute(statement)


def add_constraint_not_valid(schema_editor, table: str, name: str, definition: str) -> None:
    """ADD CONSTRAINT ... NOT VALID (catalog only), then VALIDATE CONSTRAINT: the scan holds SHARE UPDATE EXCLUSIVE,
    which lets inserts and updates go on (Postgres, ALTER TABLE: "VALIDATE CONSTRAINT")."""
    quoted_table, quoted_name = schema_editor.quote_name(table), schema_editor.quote_name(name)
    validity = None if is_checking(schema_editor) else constraint_validity(schema_editor, table, name)
    if validity is None:
        schema_editor.execute(f"ALTER TABLE {quoted_table} ADD CONSTRAINT {quoted_name} {definition} NOT VALID")
    if not validity:
        schema_editor.execute(f"ALTER TABLE {quoted_table} VALIDATE CONSTRAINT {quoted_name}")


def column_exists(schema_editor, table: str, column: str) -> bool:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        return column in {info.name for info in connection.introspection.get_table_description(cursor, table)}


def constraint_exists(schema_editor, table: str, name: str) -> bool:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        return name in connection.introspection.get_constraints(cursor, table)


class AddFieldWithoutBlockingWrites(migrations.AddField):
    """AddField for a live table: the column (nullable, or NOT NULL with a constant `db_default`), then its CHECK and
    FOREIGN KEY NOT VALID and validated, then its index CONCURRENTLY — the names and definitions Django gives them.
    Not for unique or primary-key fields."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        field = model._meta.get_field(self.name)
        if not field.null and not field.has_db_default():
            raise NotSupportedError(
                f"{self.model_name}.{self.name} is NOT NULL without a db_default: the previous release's inserts, "
                "which do not name it, would fail; give it db_default="
            )
        if field.unique or field.primary_key or field.many_to_many:
            raise NotSupportedError(f"{type(self).__name__} does not add unique, primary-key or many-to-many fields")
        if not is_postgres(schema_editor):
            if is_checking(schema_editor) or not column_exists(schema_editor, model._meta.db_table, field.column):
                with transaction.atomic(using=schema_editor.connection.alias):
                    super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        ensure_not_in_transaction(self, schema_editor)
        table = model._meta.db_table
        # The column with its db_default (never the Python default, which Django writes into existing rows and then
        # drops), and without the CHECK and REFERENCES Django writes inline: Postgres verifies an inline CHECK (and a
        # REFERENCES on a column with a default) by scanning the table under ADD COLUMN's ACCESS EXCLUSIVE lock.
        definition, params = schema_editor.column_sql(model, field)
        schema_editor.execute(
            f"ALTER TABLE {schema_editor.quote_name(table)} "
            f"ADD COLUMN IF NOT EXISTS {schema_editor.quote_name(field.column)} {definition}",
            params or None,
        )
        check = field.db_parameters(connection=schema_editor.connection)["check"]
        if check:
            # The name Postgres gives a CHECK written inline, so both ways of adding the field end alike.
            name = f"{table}_{field.column}_check"
            if len(name.encode()) > MAX_NAME:
                raise NotSupportedError(f"{name} is longer than Postgres' {MAX_NAME} bytes; name the check yourself")
            add_constraint_not_valid(schema_editor, table, name, f"CHECK ({check})")
        if field.remote_field and field.db_constraint:
            # Django's name and definition (DEFERRABLE INITIALLY DEFERRED) of the key it would add inline.
            parts = schema_editor._create_fk_sql(model, field, "_fk_%(to_table)s_%(to_column)s").parts
            definition = (
                f"FOREIGN KEY ({parts['column']}) REFERENCES {parts['to_table']} ({parts['to_column']})"
                f"{parts['deferrable']}"
            )
            add_constraint_not_valid(schema_editor, table, str(parts["name"]).strip('"'), definition)
        for statement in schema_editor._field_indexes_sql(model, field):
            build_index(schema_editor, concurrently(statement))


class AddIndexWithoutBlockingWrites(migrations.AddIndex):
    """CREATE INDEX CONCURRENTLY on Postgres (rebuilt if an interrupted build left it invalid); elsewhere (SQLite) a
    plain AddIndex, skipped when the index is there already. Backwards, as RemoveIndexWithoutBlockingWrites."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            plain = super().database_forwards
            _add_index(
                self, schema_editor, model, self.index, lambda: plain(app_label, schema_editor, from_state, to_state)
            )

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            plain = super().database_backwards
            _remove_index(
                self,
                schema_editor,
                model,
                self.index.name,
                lambda: plain(app_label, schema_editor, from_state, to_state),
            )


class RemoveIndexWithoutBlockingWrites(migrations.RemoveIndex):
    """DROP INDEX CONCURRENTLY IF EXISTS on Postgres; elsewhere (SQLite) a plain RemoveIndex, skipped when the index
    is gone already. Backwards, as AddIndexWithoutBlockingWrites."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            plain = super().database_forwards
            _remove_index(
                self, schema_editor, model, self.name, lambda: plain(app_label, schema_editor, from_state, to_state)
            )

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            index = to_state.models[app_label, self.model_name_lower].get_index_by_name(self.name)
            plain = super().database_backwards
            _add_index(self, schema_editor, model, index, lambda: plain(app_label, schema_editor, from_state, to_state))


def _add_index(operation, schema_editor, model, index, plain) -> None:
    """Build `index` CONCURRENTLY on Postgres; elsewhere run `plain` (Django's own operation) in a transaction of its
    own, unless the index is there already (a rerun after an interruption)."""
    if not is_postgres(schema_editor):
        if is_checking(schema_editor) or not constraint_exists(schema_editor, model._meta.db_table, index.name):
            with transaction.atomic(using=schema_editor.connection.alias):
                plain()
        return
    ensure_not_in_transaction(operation, schema_editor)
    build_index(schema_editor, index.create_sql(model, schema_editor, concurrently=True))


def _remove_index(operation, schema_editor, model, name: str, plain) -> None:
    """DROP INDEX CONCURRENTLY IF EXISTS on Postgres; elsewhere run `plain` in a transaction of its own, unless the
    index is gone already."""
    if not is_postgres(schema_editor):
        if is_checking(schema_editor) or constraint_exists(schema_editor, model._meta.db_table, name):
            with transaction.atomic(using=schema_editor.connection.alias):
                plain()
        return
    ensure_not_in_transaction(operation, schema_editor)
    schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(name)}")


class AlterFieldIndexWithoutBlockingWrites(migrations.AlterField):
    """AlterField whose one change is the field's own index (`db_index`; a ForeignKey has one unless it says
    db_index=False): the index Django made for it dropped with DROP INDEX CONCURRENTLY, or built CONCURRENTLY. Backwards
    does the opposite. On other databases (SQLite) the same statements, plain: each skips what is done already."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        old = from_state.apps.get_model(app_label, self.model_name)._meta.get_field(self.name)
        new = model._meta.get_field(self.name)
        if _without_index(old) != _without_index(new) or old.unique or new.unique:
            raise NotSupportedError(f"{type(self).__name__} changes only the db_index of a field that is not unique")
        postgres = is_postgres(schema_editor)
        if postgres:
            ensure_not_in_transaction(self, schema_editor)
        if old.db_index and not new.db_index:
            # Django's own way of finding it (BaseDatabaseSchemaEditor._alter_field): the btree index on that column
            # alone, not one that Meta.indexes declares.
            if is_checking(schema_editor):  # sqlmigrate: the name Django gives such an index
                names = [schema_editor._create_index_name(model._meta.db_table, [old.column], suffix="")]
            else:
                names = _field_index_names(schema_editor, model, old.column)
            drop = "DROP INDEX CONCURRENTLY IF EXISTS" if postgres else "DROP INDEX IF EXISTS"
            for name in names:
                schema_editor.execute(f"{drop} {schema_editor.quote_name(name)}")
        elif new.db_index and not old.db_index:
            for statement in schema_editor._field_indexes_sql(model, new):
                if postgres:
                    build_index(schema_editor, concurrently(statement))
                elif is_checking(schema_editor) or not _field_index_names(schema_editor, model, new.column):
                    schema_editor.execute(statement)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        self.database_forwards(app_label, schema_editor, from_state, to_state)


def _without_index(field) -> tuple:
    _, path, args, kwargs = field.deconstruct()
    kwargs.pop("db_index", None)
    return path, args, kwargs


def _field_index_names(schema_editor, model, column: str) -> list[str]:
    return schema_editor._constraint_names(
        model,
        [column],
        index=True,
        type_=Index.suffix,
        exclude={index.name for index in model._meta.indexes},
    )


class AddConstraintWithoutBlockingWrites(migrations.AddConstraint):
    """A unique constraint that Postgres keeps as a unique index (one with a condition, expressions, include or
    opclasses), built CONCURRENTLY; elsewhere (SQLite) a plain AddConstraint."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        if not is_postgres(schema_editor):
            table = model._meta.db_table
            if is_checking(schema_editor) or not constraint_exists(schema_editor, table, self.constraint.name):
                with transaction.atomic(using=schema_editor.connection.alias):
                    super().database_forwards(app_label, schema_editor, from_state, to_state)
            return
        ensure_not_in_transaction(self, schema_editor)
        statement = self.constraint.create_sql(model, schema_editor) if self.is_an_index() else None
        if statement is None or statement.template != schema_editor.sql_create_unique_index:
            raise NotSupportedError(
                f"{type(self).__name__} builds unique constraints Postgres keeps as an index (with a condition, "
                f"expressions, include or opclasses); {self.constraint.name} is not one"
            )
        build_index(schema_editor, concurrently(statement))

    def is_an_index(self) -> bool:
        constraint = self.constraint
        return isinstance(constraint, UniqueConstraint) and bool(
            constraint.condition or constraint.expressions or constraint.include or constraint.opclasses
        )

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if not is_postgres(schema_editor):
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            ensure_not_in_transaction(self, schema_editor)
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {schema_editor.quote_name(self.constraint.name)}")


class SetDatabaseDefault(migrations.operations.base.Operation):
    """Give a column the database default its field declares (`db_default`), where an earlier migration added it
    without one. The migration state already has it: this changes the database only.

    On Postgres, ALTER COLUMN ... SET DEFAULT changes the catalog only, whatever the size of the table. Elsewhere
    (SQLite, which rebuilds the table to change a default) only a column without a default is changed.
    """

    reduces_to_sql = True
    reversible = True

    def __init__(self, model_name: str, name: str):
        self.model_name = model_name
        self.name = name

    def deconstruct(self):
        return (type(self).__name__, [], {"model_name": self.model_name, "name": self.name})

    def state_forwards(self, app_label, state):
        pass

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return
        field = model._meta.get_field(self.name)
        if not field.has_db_default():
            raise NotSupportedError(f"{self.model_name}.{self.name} declares no db_default to set")
        table = model._meta.db_table
        if is_postgres(schema_editor):
            default_sql, params = schema_editor.db_default_sql(field)
            schema_editor.execute(
                f"ALTER TABLE {schema_editor.quote_name(table)} "
                f"ALTER COLUMN {schema_editor.quote_name(field.column)} SET DEFAULT {default_sql}",
                params or None,
            )
            return
        if not is_checking(schema_editor) and self.column_default(schema_editor, table, field.column) is not None:
            return
        _, _, args, kwargs = field.deconstruct()
        kwargs.pop("db_default")
        without_default = type(field)(*args, **kwargs)
        without_default.set_attributes_from_name(field.name)
        without_default.model = model
        schema_editor.alter_field(model, without_default, field)

    @staticmethod
    def column_default(schema_editor, table: str, column: str):
        connection = schema_editor.connection
        with connection.cursor() as cursor:
            described = connection.introspection.get_table_description(cursor, table)
        return next(info.default for info in described if info.name == column)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        # The migrations before this one declare the same default: leaving it is what their state says.
        pass

    def describe(self):
        return f"Set the database default of {self.model_name}.{self.name}"

    @property
    def migration_name_fragment(self):
        return f"{self.model_name}_{self.name}_db_default"


__all__ = [
    "AddConstraintWithoutBlockingWrites",
    "AddFieldWithoutBlockingWrites",
    "AddIndexWithoutBlockingWrites",
    "AlterFieldIndexWithoutBlockingWrites",
    "RemoveIndexWithoutBlockingWrites",
    "SetDatabaseDefault",
]
