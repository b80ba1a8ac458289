# Rolling-safe: the search column has a database default (the previous release's inserts do not name it; on Postgres
# 11+ a constant default is stored in the catalog, no rewrite) and its GIN index is built CONCURRENTLY on Postgres.
# Not atomic; run again after an interruption, it finishes. Runs started before it have no search attributes.

from django.db import migrations, models

import durable_agents.models
from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites, AddIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0023_heartbeat_load"),
    ]

    operations = [
        AddFieldWithoutBlockingWrites(
            model_name="run",
            name="search",
            field=models.JSONField(blank=True, db_default={}, default=dict),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="run",
            index=durable_agents.models.JsonContainsIndex(
                fields=["search"], name="durable_run_search", opclasses=["jsonb_path_ops"]
            ),
        ),
    ]
