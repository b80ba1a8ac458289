# Rolling-safe: the delivery column has a database default (the previous release's inserts do not name it; a constant
# default is stored in the catalog, no rewrite). Not atomic; run again after an interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0028_message_batches"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="replay",
            name="delivery",
            field=models.CharField(blank=True, db_default="", default="", max_length=8),
        ),
    ]
