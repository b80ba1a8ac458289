from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable_agents", "0012_run_claimed_at"),
    ]

    operations = [
        migrations.CreateModel(
            name="RateBucket",
            fields=[
                ("key", models.CharField(max_length=300, primary_key=True, serialize=False)),
                ("requests_tat", models.FloatField(default=0.0)),
                ("input_tat", models.FloatField(default=0.0)),
                ("output_tat", models.FloatField(default=0.0)),
                ("start_at", models.FloatField(default=0.0)),
                ("reserved", models.BooleanField(default=False)),
            ],
        ),
    ]
