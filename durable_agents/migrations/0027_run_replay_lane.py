# Rolling-safe: the replay_lane column has a database default (the previous release's inserts do not name it; on
# Postgres 11+ a constant default is stored in the catalog, no rewrite), and the index of replay runs (empty until the
# first replay) is built CONCURRENTLY. Not atomic; run again after an interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites, AddIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0026_replays"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="run",
            name="replay_lane",
            field=models.CharField(blank=True, db_default="", default="", max_length=16),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="run",
            index=models.Index(
                fields=["workflow", "status"], condition=~models.Q(replay_lane=""), name="durable_run_replays"
            ),
        ),
    ]
