"""Database defaults for installs that applied 0008, 0014, 0015 and 0017 before those had them.

Those migrations added NOT NULL columns with a default Django drops once the column is filled, so the previous
release's inserts, which do not name the columns, failed while a rolling deploy migrated. They now declare `db_default`;
an install that ran them before gets the same defaults here (on Postgres ALTER COLUMN ... SET DEFAULT changes the
catalog only), and ends with the schema of a fresh install. On a fresh install this repeats what is already there.
"""

from django.db import migrations

from durable_agents.migrations._operations import SetDatabaseDefault


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0021_job_lease"),
    ]

    operations = [
        SetDatabaseDefault(model_name="wait", name="args_hash"),
        SetDatabaseDefault(model_name="wait", name="retired"),
        SetDatabaseDefault(model_name="run", name="parent_step"),
        SetDatabaseDefault(model_name="run", name="concurrency_limit"),
        SetDatabaseDefault(model_name="schedule", name="overlap"),
        SetDatabaseDefault(model_name="schedule", name="overlap_skipped"),
    ]
