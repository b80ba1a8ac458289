# Rolling-safe: the declared column has a database default (the previous release's inserts do not name it, and its
# schedules are all `api.schedule`'s, blank; on Postgres 11+ a constant default is stored in the catalog, no rewrite).
# Not atomic; run again after an interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0031_run_trace_context"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="schedule",
            name="declared",
            field=models.CharField(
                blank=True,
                choices=[("setting", "Setting"), ("workflow", "Workflow")],
                db_default="",
                default="",
                max_length=16,
            ),
        ),
    ]
