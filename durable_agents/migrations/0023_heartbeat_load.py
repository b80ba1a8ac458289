"""ProcessHeartbeat.load: what the sweep measured of the broker's queues, and how busy each worker is.

Safe while the previous release still runs: a new column with a constant database default ('{}', which Postgres 11+
keeps in the catalog: no rewrite, no scan), so that release's heartbeats, which do not name it, still insert; its
rows read as "nothing measured" (unknown) until the new release beats.
"""

from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0022_database_defaults"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="processheartbeat",
            name="load",
            field=models.JSONField(
                blank=True, db_default=models.Value({}, output_field=models.JSONField()), default=dict
            ),
        ),
    ]
