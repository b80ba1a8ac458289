# Rolling-safe: the sweep's two partial indexes of open waits are rebuilt with their column in the predicate too
# (`deadline IS NOT NULL`, `next_reminder_at IS NOT NULL`), CONCURRENTLY, and the old ones dropped CONCURRENTLY. With
# the old predicates (`status = 'open'` alone), a run's open wait (`run_id = %s AND status = 'open'`) could be planned
# as a scan of either over every open wait when the statistics said none was open. The console's approvals queue,
# which read its page in order from the old deadline index, gets one of its own (open approvals by deadline). Not
# atomic; run again after an interruption, it finishes.

from django.db import migrations, models

from durable_agents.migrations._operations import AddIndexWithoutBlockingWrites, RemoveIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable_agents", "0033_schedule_paused_changed_by"),
    ]

    operations = [
        AddIndexWithoutBlockingWrites(
            model_name="wait",
            index=models.Index(
                condition=models.Q(("deadline__isnull", False), ("status", "open")),
                fields=["deadline"],
                name="durable_wait_deadline_due",
            ),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="wait",
            index=models.Index(
                condition=models.Q(("next_reminder_at__isnull", False), ("status", "open")),
                fields=["next_reminder_at"],
                name="durable_wait_reminder_due",
            ),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="wait",
            index=models.Index(
                condition=models.Q(("kind", "approval"), ("status", "open")),
                fields=["deadline"],
                name="durable_wait_open_approvals",
            ),
        ),
        RemoveIndexWithoutBlockingWrites(model_name="wait", name="durable_wait_open_deadline"),
        RemoveIndexWithoutBlockingWrites(model_name="wait", name="durable_wait_open_reminder"),
    ]
