# Rolling-safe: two partial indexes of batch turns (the batcher's scans: turns in flight by run, answers not journaled
# yet), built CONCURRENTLY. Not atomic; run again after an interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0029_replay_delivery"),
    ]

    operations = [
        AddIndexWithoutBlockingWrites(
            model_name="batchturn",
            index=models.Index(
                condition=models.Q(("status__in", ["queued", "submitted"])),
                fields=["run"],
                name="durable_batch_turn_in_flight",
            ),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="batchturn",
            index=models.Index(
                condition=models.Q(("status", "succeeded"), ("used", False)),
                fields=["step"],
                name="durable_batch_turn_unused",
            ),
        ),
    ]
