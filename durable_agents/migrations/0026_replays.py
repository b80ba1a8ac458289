# Rolling-safe: the replay_lane column has a database default (the previous release's inserts do not name it; on
# Postgres 11+ a constant default is stored in the catalog, no rewrite), and the index of replay runs (empty until the
# first replay) is built CONCURRENTLY. The replay tables are new. Not atomic; run again after an interruption, it
# finishes. The new permission replay_run is granted to no one: replaying spends model tokens.

import django.db.models.deletion
import django.db.models.functions.datetime
import durable_agents.models
import uuid
from django.db import migrations, models

from durable_agents.migrations._operations import AddFieldWithoutBlockingWrites, AddIndexWithoutBlockingWrites


class Migration(migrations.Migration):
    atomic = False

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
        AddFieldWithoutBlockingWrites(
            model_name="run",
            name="replay_lane",
            field=models.CharField(blank=True, db_default="", default="", max_length=16),
        ),
        AddIndexWithoutBlockingWrites(
            model_name="run",
            index=models.Index(
                fields=["workflow", "status"], condition=~models.Q(replay_lane=""), name="durable_run_replays"
            ),
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
                        on_delete=django.db.models.deletion.PROTECT, related_name="replays", to="durable_agents.cohort"
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
        ),
        migrations.AddConstraint(
            model_name="recording",
            constraint=models.UniqueConstraint(fields=("cohort", "position"), name="durable_recording_position"),
        ),
        migrations.AddConstraint(
            model_name="replayrun",
            constraint=models.UniqueConstraint(fields=("replay", "recording", "lane"), name="durable_replay_run_lane"),
        ),
    ]
