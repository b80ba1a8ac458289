# Rolling-safe: new tables only (the previous release never reads them), and a new choice of Wait.kind ("batch"),
# which changes no column. A previous release's worker that meets a batch wait leaves it to the batcher.

import django.db.models.deletion
import django.db.models.functions.datetime
import durable_agents.models
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0027_run_replay_lane"),
    ]

    operations = [
        migrations.AlterField(
            model_name="wait",
            name="kind",
            field=models.CharField(
                choices=[
                    ("approval", "Approval"),
                    ("signal", "Signal"),
                    ("timer", "Timer"),
                    ("children", "Children"),
                    ("batch", "Batch"),
                ],
                max_length=16,
            ),
        ),
        migrations.CreateModel(
            name="MessageBatch",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                (
                    "provider_id",
                    models.CharField(blank=True, default="", help_text="the API's msgbatch_ id", max_length=100),
                ),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("submitting", "Submitting"),
                            ("in_progress", "In Progress"),
                            ("canceling", "Canceling"),
                            ("ended", "Ended"),
                            ("failed", "Failed"),
                        ],
                        default="submitting",
                        max_length=16,
                    ),
                ),
                ("request_count", models.PositiveIntegerField(default=0)),
                ("request_bytes", models.BigIntegerField(default=0)),
                ("counts", models.JSONField(blank=True, default=dict)),
                ("error", models.TextField(blank=True, default="")),
                ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ("submitted_at", models.DateTimeField(blank=True, null=True)),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                ("polled_at", models.DateTimeField(blank=True, null=True)),
                ("next_poll_at", models.DateTimeField(blank=True, null=True)),
                ("polls", models.PositiveIntegerField(default=0)),
            ],
            options={
                "ordering": ["-created_at"],
                "verbose_name_plural": "message batches",
                "indexes": [
                    models.Index(
                        condition=models.Q(("status__in", ["submitting", "in_progress", "canceling"])),
                        fields=["next_poll_at"],
                        name="durable_batch_in_flight",
                    )
                ],
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("provider_id", ""), _negated=True),
                        fields=("provider_id",),
                        name="durable_message_batch_provider_id",
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="BatchTurn",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("index", models.PositiveIntegerField()),
                ("purpose", models.CharField(default="turn", max_length=20)),
                ("custom_id", models.CharField(max_length=64, unique=True)),
                ("model", models.CharField(blank=True, default="", max_length=100)),
                ("request_digest", models.CharField(max_length=64)),
                (
                    "params",
                    durable_agents.models.OrderedJSONField(help_text="the Messages request, as it goes in the batch"),
                ),
                (
                    "status",
                    models.CharField(
                        choices=[
                            ("queued", "Queued"),
                            ("submitted", "Submitted"),
                            ("succeeded", "Succeeded"),
                            ("errored", "Errored"),
                            ("expired", "Expired"),
                            ("canceled", "Canceled"),
                            ("abandoned", "Abandoned"),
                        ],
                        default="queued",
                        max_length=16,
                    ),
                ),
                ("result", durable_agents.models.OrderedJSONField(blank=True, null=True)),
                ("deadline", models.DateTimeField(blank=True, null=True)),
                ("used", models.BooleanField(default=False)),
                ("cost_usd", models.DecimalField(decimal_places=6, default=0, max_digits=14)),
                ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ("submitted_at", models.DateTimeField(blank=True, null=True)),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="batch_turns", to="durable_agents.run"
                    ),
                ),
                (
                    "step",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="batch_turns",
                        to="durable_agents.step",
                    ),
                ),
                (
                    "batch",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="turns",
                        to="durable_agents.messagebatch",
                    ),
                ),
            ],
            options={
                "ordering": ["created_at"],
                "indexes": [
                    models.Index(fields=["step", "index"], name="durable_batch_turn_step"),
                    models.Index(
                        condition=models.Q(("status", "queued")),
                        fields=["created_at"],
                        name="durable_batch_turn_queued",
                    ),
                ],
            },
        ),
    ]
