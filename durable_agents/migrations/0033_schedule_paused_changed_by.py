# Rolling-safe: paused_changed_by has a database default (the previous release's inserts and saves do not name it;
# on Postgres 11+ a constant default is stored in the catalog, no rewrite) and paused_changed_at is nullable. Not
# atomic; run again after an interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0032_schedule_declared"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="schedule",
            name="paused_changed_by",
            field=models.CharField(blank=True, db_default="", default="", max_length=200),
        ),
        AddFieldWithoutBlockingWrites(
            model_name="schedule",
            name="paused_changed_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
