# Rolling-safe: new tables only (the previous release never reads them) and a new permission, replay_run, granted to
# no one (replaying spends model tokens). Run's replay_lane column comes in 0027, without blocking writes.

import django.db.models.deletion
import django.db.models.functions.datetime
import durable_agents.models
import uuid
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0025_operator_permissions"),
    ]

    operations = [
        migrations.CreateModel(
            name="Cohort",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(max_length=200, unique=True)),
                ("description", models.TextField(blank=True, default="")),
                ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
            ],
            options={
                "ordering": ["-created_at"],
            },
        ),
        migrations.AlterModelOptions(
            name="run",
            options={
                "ordering": ["-created_at"],
                "permissions": [
                    ("resume_run", "Can resume runs"),
                    ("cancel_run", "Can cancel runs"),
                    ("retry_step", "Can retry a failed step"),
                    ("set_budget", "Can set a run's budget"),
                    ("swap_participant", "Can swap a run's participant"),
                    ("decide_wait", "Can approve or reject waits"),
                    ("replan_run", "Can re-plan runs"),
                    ("resolve_effect", "Can record the outcome of an effect"),
                    ("signal_run", "Can deliver a signal to a run"),
                    ("fork_run", "Can fork a run from a step"),
                    ("replay_run", "Can replay runs with a candidate model or prompt"),
                ],
            },
        ),
        migrations.CreateModel(
            name="Recording",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("position", models.PositiveIntegerField()),
                ("source_run_id", models.UUIDField(blank=True, null=True)),
                ("workflow", models.CharField(max_length=200)),
                ("workflow_version", models.PositiveIntegerField()),
                ("data", durable_agents.models.OrderedJSONField()),
                (
                    "cohort",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="recordings",
                        to="durable_agents.cohort",
                    ),
                ),
            ],
            options={
                "ordering": ["cohort", "position"],
                "constraints": [
                    models.UniqueConstraint(fields=("cohort", "position"), name="durable_recording_position")
                ],
            },
        ),
        migrations.CreateModel(
            name="Replay",
            fields=[
                ("id", models.UUIDField(default=uuid.uuid4, editable=False, primary_key=True, serialize=False)),
                ("candidate", models.JSONField(blank=True, default=dict)),
                ("stubs", models.JSONField(blank=True, default=dict)),
                ("budget_usd", models.DecimalField(blank=True, decimal_places=6, max_digits=14, null=True)),
                ("seed", models.BigIntegerField(blank=True, null=True)),
                ("created_by", models.CharField(blank=True, default="", max_length=200)),
                ("created_at", models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                (
                    "cohort",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="replays", to="durable_agents.cohort"
                    ),
                ),
            ],
            options={
                "ordering": ["-created_at"],
            },
        ),
        migrations.CreateModel(
            name="ReplayRun",
            fields=[
                ("run_id", models.UUIDField(primary_key=True, serialize=False)),
                ("lane", models.CharField(max_length=16)),
                (
                    "recording",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="replays",
                        to="durable_agents.recording",
                    ),
                ),
                (
                    "replay",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="runs", to="durable_agents.replay"
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("replay", "recording", "lane"), name="durable_replay_run_lane")
                ],
            },
        ),
    ]
