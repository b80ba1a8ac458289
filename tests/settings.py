"""Settings for the test suite and the worker subprocesses it starts: real Postgres and Redis, short leases."""

import json
import os
import tempfile

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/durable_agents")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DURABLE_SWEEP_SECONDS", "0.5")
os.environ.setdefault("DURABLE_VAR_DIR", tempfile.mkdtemp(prefix="durable-tests-"))
# No DJANGO_SECRET_KEY in tests: a random key kept in the var dir, shared by the worker subprocesses.
os.environ.setdefault("DJANGO_LOCAL_SECRET_KEY", "1")

from project.settings import *  # noqa: E402,F403
from project.settings import INSTALLED_APPS, STATIC_ROOT, VAR_DIR  # noqa: E402

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]
MEDIA_ROOT = VAR_DIR / "media"
# The live server serves static files from the apps themselves; an empty STATIC_ROOT keeps WhiteNoise from
# warning, on every test's first request, that collectstatic never ran.
STATIC_ROOT.mkdir(exist_ok=True)
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

DURABLE_AGENTS = {
    # Short leases so a killed worker's run is recovered within seconds; the heartbeat keeps slow steps alive.
    "LEASE_SECONDS": float(os.environ.get("DURABLE_LEASE_SECONDS", "2")),
    "IDLE_RESWEEP_SECONDS": 1.0,
    "RETRY_BACKOFF_SECONDS": 0.05,
    "RETRY_BACKOFF_MAX_SECONDS": 0.5,
    "STUCK_AFTER_SECONDS": 60.0,
    "NOTIFY_RETRY_SECONDS": 1.0,
}

# Per-test settings for worker subprocesses, which cannot see a test's override_settings: a JSON object
# merged into DURABLE_AGENTS, and a queue of their own for notification deliveries (as the README advises).
DURABLE_AGENTS.update(json.loads(os.environ.get("DURABLE_TEST_SETTINGS", "{}")))
if os.environ.get("DURABLE_NOTIFY_QUEUE"):
    CELERY_TASK_ROUTES = {"durable_agents.deliver_notification": {"queue": os.environ["DURABLE_NOTIFY_QUEUE"]}}
