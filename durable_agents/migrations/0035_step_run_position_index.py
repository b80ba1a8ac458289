# Rolling-safe: a run's steps are indexed by run and position (built CONCURRENTLY), and the foreign key's index of the
# run alone is dropped (CONCURRENTLY) once the new one serves its checks and cascades. Planned for any parameters (a
# prepared statement's generic plan) or on statistics taken while the table was small, a claim or a commit read the
# step under a run's cursor through the index of the run alone: every step of the run, at every step. Not atomic; run
# again after an interruption, it finishes.

import django.db.models.deletion
from django.db import migrations, models

from durable_agents.migrations._operations import AddIndexWithoutBlockingWrites, AlterFieldIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0034_wait_due_indexes"),
    ]

    operations = [
        AddIndexWithoutBlockingWrites(
            model_name="step",
            index=models.Index(fields=["run", "position"], name="durable_step_run_position"),
        ),
        AlterFieldIndexWithoutBlockingWrites(
            model_name="step",
            name="run",
            field=models.ForeignKey(
                db_index=False,
                on_delete=django.db.models.deletion.CASCADE,
                related_name="steps",
                to="durable_agents.run",
            ),
        ),
    ]
