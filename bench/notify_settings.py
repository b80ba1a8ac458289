"""Settings for bench/notifications.py: the project's, the test workflows, and knobs from the environment."""

import json
import os

from project.settings import *  # noqa: F403
from project.settings import DURABLE_AGENTS, INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # approve_charge: an approval that notifies
DURABLE_AGENTS = {**DURABLE_AGENTS, **json.loads(os.environ.get("BENCH_DURABLE_AGENTS", "{}"))}
if os.environ.get("BENCH_NOTIFY_QUEUE"):
    CELERY_TASK_ROUTES = {"durable_agents.deliver_notification": {"queue": os.environ["BENCH_NOTIFY_QUEUE"]}}
