"""JobLease: one pass at a time of a background job (the prune), as a row on the database's clock instead of a session
advisory lock, which a pooler in transaction mode (PgBouncer) cannot keep.

Safe while the previous release still runs: a new table, which that release never reads. Until it is gone, its
passes still take the advisory lock and a new pass does not see them: two passes may overlap during the rollout, as
they could before behind a pooler; each batch locks its runs (FOR UPDATE SKIP LOCKED) and re-checks them, so an
overlap deletes nothing twice and nothing it should keep.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0020_families'),
    ]

    operations = [
        migrations.CreateModel(
            name='JobLease',
            fields=[
                ('name', models.CharField(max_length=100, primary_key=True, serialize=False)),
                ('holder', models.CharField(blank=True, default='', max_length=300)),
                ('token', models.UUIDField(blank=True, null=True)),
                ('taken_at', models.DateTimeField(blank=True, null=True)),
                ('expires_at', models.DateTimeField(blank=True, null=True)),
            ],
        ),
    ]
