# Rolling-safe: a plain run (no fork source, no parent, no search attributes) stops writing an entry in the indexes of
# relations it does not have, at its start and at every claim and commit (none of them is a HOT update). The
# new partial indexes are built first (CONCURRENTLY), then the ones they replace are dropped (CONCURRENTLY): the
# forks' by the fork source where set; the parent's foreign key index, whose look-ups durable_run_child_uniq (parent,
# parent_step, child_index, where set) already serves; the search GIN, for runs with search attributes (GIN keeps an
# entry for an empty document). Not atomic; run again after an interruption, it finishes.

import django.db.models.deletion
from django.db import migrations, models

import durable_agents.models
from durable_agents.migrations._operations import (
    AddIndexWithoutBlockingWrites,
    AlterFieldIndexWithoutBlockingWrites,
    RemoveIndexWithoutBlockingWrites,
)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0035_step_run_position_index"),
    ]

    operations = [
        AddIndexWithoutBlockingWrites(
            model_name="run",
            index=models.Index(
                condition=models.Q(("forked_from__isnull", False)), fields=["forked_from"], name="durable_run_forks"
            ),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="run",
            index=durable_agents.models.JsonContainsIndex(
                condition=models.Q(("search", {}), _negated=True),
                fields=["search"],
                name="durable_run_searched",
                opclasses=["jsonb_path_ops"],
            ),
        ),
        AlterFieldIndexWithoutBlockingWrites(
            model_name="run",
            name="forked_from",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="forks",
                to="durable_agents.run",
            ),
        ),
        AlterFieldIndexWithoutBlockingWrites(
            model_name="run",
            name="parent",
            field=models.ForeignKey(
                blank=True,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="children",
                to="durable_agents.run",
            ),
        ),
        RemoveIndexWithoutBlockingWrites(model_name="run", name="durable_run_search"),
    ]
