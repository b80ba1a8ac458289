"""Settings of the library's tests and the worker subprocesses they start: real Postgres and Redis, short leases.

Standalone: the example project (project/) is not needed to test the library. Its own tests run on
tests/example_settings.py (see tests/conftest.py). From the environment:

DATABASE_URL           default: postgres://postgres@127.0.0.1:5432/durable_agents (SQLite URLs work for workers)
CELERY_BROKER_URL      default: redis://127.0.0.1:6379/15 (amqp://...: a quorum queue on a direct exchange)
DURABLE_TEST_EXCHANGE_TYPE  on RabbitMQ, the queue's exchange type instead (e.g. "topic")
DJANGO_DB_POOL         N: a psycopg pool of at most N connections per process (the model worker's tests)
DJANGO_DB_POOL_TIMEOUT seconds a task waits for a pooled connection (default 60, as in production)
DJANGO_DB_TRANSACTION_POOLER  1: DATABASE_URL is a pooler in transaction mode (PgBouncer): the settings
                       docs/howto/poolers.md gives (tests/integration/test_poolers.py)
DURABLE_TEST_SETTINGS  a JSON object merged into DURABLE_AGENTS: per-test settings for worker subprocesses
DURABLE_NOTIFY_QUEUE   a queue of their own for notification deliveries
"""

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import dj_database_url

os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/durable_agents")
os.environ.setdefault("CELERY_BROKER_URL", "redis://127.0.0.1:6379/15")
# One var dir for this process and the workers it starts (they inherit the environment): media, beat schedules.
os.environ.setdefault("DURABLE_VAR_DIR", tempfile.mkdtemp(prefix="durable-tests-"))
VAR_DIR = Path(os.environ["DURABLE_VAR_DIR"])

# Not a secret: it signs the decision links of test runs only, and every worker of the suite must share it.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or "durable-agents-tests-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "durable_agents",
    "tests.testapp",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "tests.urls"
LOGIN_URL = "admin:login"  # decision links send people who are not signed in to the admin's login, then back

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": dj_database_url.config(conn_max_age=600, conn_health_checks=True)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Workers of the SQLite tests share one file: wait for the write lock instead of failing.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DB_POOL_SIZE = int(os.environ.get("DJANGO_DB_POOL", "0"))
if DB_POOL_SIZE and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # As in production (project/settings.py): the pool keeps the connections, Django gives them back.
    DATABASES["default"].update(CONN_MAX_AGE=0, CONN_HEALTH_CHECKS=False)
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": DB_POOL_SIZE,
        "timeout": float(os.environ.get("DJANGO_DB_POOL_TIMEOUT", "60")),
        "max_idle": 60,
    }
if os.environ.get("DJANGO_DB_APPLICATION_NAME") and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = os.environ["DJANGO_DB_APPLICATION_NAME"]
if os.environ.get("DJANGO_DB_TRANSACTION_POOLER") and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # A server connection is this connection's for one transaction only: no cursor may outlive it (Django declares
    # an iterator's cursor WITH HOLD in autocommit) and no statement may be prepared on it (psycopg prepares a
    # query on the server after prepare_threshold runs; None never does, as Django's default).
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = None

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
MEDIA_ROOT = VAR_DIR / "media"
EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
DEFAULT_FROM_EMAIL = "durable-agents@localhost"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# One handler, on the root logger: Celery adds its own to the root when it has none, and a second one on
# `durable_agents` would print every line twice.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"durable_agents": {"level": os.environ.get("DURABLE_LOG_LEVEL", "WARNING")}},
}

# Celery as docs/howto/install.md configures it: no global task setting (the durable tasks carry their own options: late
# acks, requeued when a worker is lost, JSON, no results); one message at a time per worker process.
CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]
if CELERY_BROKER_URL.startswith("amqp"):
    # RabbitMQ as the README first configured it: a quorum queue on Celery's default direct exchange, publisher
    # confirms. Celery cannot delay a message natively there (no topic exchange): the worst case for countdowns.
    CELERY_TASK_DEFAULT_QUEUE_TYPE = "quorum"
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
    if os.environ.get("DURABLE_TEST_EXCHANGE_TYPE"):
        # As the example project now: a topic exchange, where RabbitMQ delays countdowns itself.
        CELERY_TASK_DEFAULT_EXCHANGE = "durable_agents"
        CELERY_TASK_DEFAULT_EXCHANGE_TYPE = os.environ["DURABLE_TEST_EXCHANGE_TYPE"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_DB_REUSE_MAX = 0 if DB_POOL_SIZE else 1_000_000
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "durable-agents-sweep": {
        "task": "durable_agents.sweep",
        "schedule": timedelta(seconds=float(os.environ.get("DURABLE_SWEEP_SECONDS", "0.5"))),
        "options": {"expires": 30},
    },
}

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
# merged into DURABLE_AGENTS, and a queue of their own for notification deliveries (as
# docs/howto/notifications.md advises).
DURABLE_AGENTS.update(json.loads(os.environ.get("DURABLE_TEST_SETTINGS", "{}")))
if os.environ.get("DURABLE_NOTIFY_QUEUE"):
    CELERY_TASK_ROUTES = {"durable_agents.deliver_notification": {"queue": os.environ["DURABLE_NOTIFY_QUEUE"]}}
