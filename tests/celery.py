"""The test suite's Celery app: configured from Django settings (CELERY_*), tasks autodiscovered from installed apps.

Worker subprocesses start with `celery -A tests` (durable_agents.testing.workers.celery_app_for finds it here, in
the package of tests/settings.py), and the test process publishes its wake-ups through it.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("tests")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
