"""Families: a saga owed to a run's children (family_undo) and the slot a child runs in (slot_of).

Safe while the previous release still runs: family_undo has a database default (its inserts do not name it),
slot_of is nullable with no constraint to validate, and the partial index is built CONCURRENTLY on Postgres (starts
and commits go on while it builds; the migration is therefore not atomic).
"""

import django.db.models.deletion
from django.db import migrations, models


class AddIndexWithoutBlockingWrites(migrations.AddIndex):
    """CREATE INDEX CONCURRENTLY on Postgres; elsewhere (SQLite) a plain AddIndex."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.add_index(model, self.index, concurrently=True)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor != "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            schema_editor.remove_index(model, self.index, concurrently=True)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0019_conversation_fidelity"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="family_undo",
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddField(
            model_name="run",
            name="slot_of",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="durable_agents.run",
            ),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="run",
            index=models.Index(
                condition=models.Q(("family_undo", True)), fields=["updated_at"], name="durable_run_family_undo"
            ),
        ),
    ]
