"""Settings for bench/delays.py: the example project's, the test workflows, and knobs from the environment."""

import json
import os

from project.settings import *  # noqa: F403
from project.settings import CELERY_BROKER_URL, DURABLE_AGENTS, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # flaky: a step that fails its first attempts
DURABLE_AGENTS = {**DURABLE_AGENTS, **json.loads(os.environ.get("BENCH_DURABLE_AGENTS", "{}"))}
if CELERY_BROKER_URL.startswith("amqp") and os.environ.get("BENCH_EXCHANGE") == "direct":
    # The example project's RabbitMQ configuration before issue 29: its quorum queue on Celery's direct exchange.
    CELERY_TASK_DEFAULT_EXCHANGE = "celery"
    CELERY_TASK_DEFAULT_EXCHANGE_TYPE = "direct"
