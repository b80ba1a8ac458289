"""Settings of the example project's tests (EXAMPLE_TESTS in tests/conftest.py) and of the workers they start:
the example project's own settings (project/settings.py) with the test suite's knobs from tests/settings.py."""

import os

os.environ.setdefault("DURABLE_SWEEP_SECONDS", "0.5")
# No DJANGO_SECRET_KEY in tests: a random key kept in the var dir, shared by the worker subprocesses.
os.environ.setdefault("DJANGO_LOCAL_SECRET_KEY", "1")

# First: it sets the defaults of DATABASE_URL, CELERY_BROKER_URL and DURABLE_VAR_DIR, which project.settings reads.
from tests import settings as library  # noqa: E402, I001

from project.settings import *  # noqa: E402, F403
from project.settings import DURABLE_AGENTS as EXAMPLE_DURABLE_AGENTS  # noqa: E402
from project.settings import INSTALLED_APPS, VAR_DIR  # noqa: E402

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]
MEDIA_ROOT = VAR_DIR / "media"
EMAIL_BACKEND = library.EMAIL_BACKEND
PASSWORD_HASHERS = library.PASSWORD_HASHERS
# Tracing as the example project turns it on (OTEL_TRACES_EXPORTER); DURABLE_TEST_SETTINGS may still override it.
DURABLE_AGENTS = {"TRACING": EXAMPLE_DURABLE_AGENTS["TRACING"], **library.DURABLE_AGENTS}
if hasattr(library, "CELERY_TASK_ROUTES"):
    CELERY_TASK_ROUTES = library.CELERY_TASK_ROUTES
