# Rolling-safe: the trace_context column has a database default (the previous release's inserts do not name it; on
# Postgres 11+ a constant default is stored in the catalog, no rewrite). Not atomic; run again after an
# interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0030_batch_turn_indexes"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="run",
            name="trace_context",
            field=models.CharField(blank=True, db_default="", default="", editable=False, max_length=64),
        ),
    ]
