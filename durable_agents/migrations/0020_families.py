"""Families: a saga owed to a run's children (family_undo) and the slot a child runs in (slot_of).

Safe while the previous release still runs: family_undo has a database default (its inserts do not name it),
slot_of is nullable with no constraint to validate, and the partial index is built CONCURRENTLY on Postgres (starts
and commits go on while it builds; the migration is therefore not atomic, and run again after an interruption, it
finishes: each operation skips what is done).
"""

import django.db.models.deletion
from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites, AddIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0019_conversation_fidelity"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="run",
            name="family_undo",
            field=models.BooleanField(db_default=False, default=False),
        ),
        AddFieldWithoutBlockingWrites(
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
