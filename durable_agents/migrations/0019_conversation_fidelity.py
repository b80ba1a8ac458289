# Conversation fidelity: a frozen head per model step, refusal details, and turns kept as returned (text, keys in order).

import durable_agents.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('durable_agents', '0018_run_schedule'),
    ]

    operations = [
        migrations.AddField(
            model_name='step',
            name='frozen_request',
            field=durable_agents.models.OrderedJSONField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='turn',
            name='stop_details',
            field=models.JSONField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name='turn',
            name='content',
            field=durable_agents.models.OrderedJSONField(default=list, help_text="the response's content blocks, as the API returned them"),
        ),
        migrations.AlterField(
            model_name='turn',
            name='tool_results',
            field=durable_agents.models.OrderedJSONField(blank=True, null=True),
        ),
    ]
