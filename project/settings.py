"""Django settings, twelve-factor: everything that differs between machines comes from the environment.

DATABASE_URL             default: a SQLite file under var/ (the embedded default)
CELERY_BROKER_URL        default: redis://127.0.0.1:6379/0
DJANGO_SECRET_KEY        required, unless DJANGO_DEBUG or DJANGO_LOCAL_SECRET_KEY is "1"
DJANGO_LOCAL_SECRET_KEY  "1": without DJANGO_SECRET_KEY, use a random key made once for this machine and kept
                         in var/secret_key (the demo and the tests set it; every process sharing the var dir
                         shares the key)
DJANGO_DEBUG             "1" turns debug on (and allows the local key)
DJANGO_BEHIND_HTTPS_PROXY "1": a proxy ends HTTPS and sets X-Forwarded-Proto (Heroku, a load balancer)
DURABLE_*                the app's knobs (DURABLE_AGENTS below); docs/howto/production.md lists them all
OTEL_TRACES_EXPORTER     "console" or "otlp" turns tracing on (DURABLE_AGENTS["TRACING"]); the other OTEL_* variables
                         configure the OpenTelemetry SDK (project/tracing.py)
"""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from django.core.management.utils import get_random_secret_key

from project import tracing

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DURABLE_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = os.environ.get("DJANGO_DEBUG", "0") == "1"


# The longest duration a setting may hold (about 31 years): beyond it no timestamp or timedelta can hold it.
LONGEST_SECONDS = 1e9


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment variable `name`: a number of seconds above 0, else `default` if unset.

    A bad value stops the process with a message naming the variable; float()'s own ValueError names neither
    the variable nor the setting, and a deployment would crash on it far from the cause.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= LONGEST_SECONDS):
        raise ImproperlyConfigured(
            f"{name} must be a number of seconds above 0 and at most {LONGEST_SECONDS:g}, e.g. {name}={default:g}; "
            f"it is {raw!r}"
        )
    return seconds


def env_json(name: str) -> object:
    """A JSON value from the environment variable `name`, or None if unset (a malformed one stops start-up)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(
            f'{name} must be JSON, e.g. \'{{"*": {{"requests_per_minute": 50}}}}\': {exc}'
        ) from None


def env_count(name: str, default: int) -> int:
    """A whole number of at least 0 from the environment variable `name`, else `default` if unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()):  # "-4" and "1.5" too: a pool or an age of that size is no value
        raise ImproperlyConfigured(f"{name} must be a whole number of at least 0, e.g. {name}={default}; it is {raw!r}")
    return int(raw)


def env_base_url(name: str, default: str) -> str:
    """The address people open the web process at, from `name`: scheme and host, as in https://agents.example.com."""
    url = os.environ.get(name, "").strip() or default
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. "http://[::1": an unclosed IPv6 address
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ImproperlyConfigured(
            f"{name} must be the address approvers open the web process at, with its scheme, "
            f"e.g. {name}=https://agents.example.com; it is {url!r}"
        )
    return url


def local_secret_key(var_dir: Path) -> str:
    """This machine's key: random, made once and kept in `var_dir`/secret_key (mode 0600), never a constant.

    Processes starting together (the demo's workers) must agree on it: the file is written aside and linked
    into place, so the first one wins and the others read its key.
    """
    path = var_dir / "secret_key"
    if not path.exists():
        draft = var_dir / f".secret_key.{os.getpid()}"
        descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(get_random_secret_key())
        try:
            os.link(draft, path)
        except FileExistsError:
            pass
        finally:
            draft.unlink()
    return path.read_text().strip()


# The key signs sessions and the approval links a decision goes by: a key anyone can read in this repository
# would let anyone forge them. So there is no fallback constant; without a key of its own, only a local
# (debug, demo, test) run starts, with a random key kept under the var dir.
if os.environ.get("DJANGO_SECRET_KEY"):
    SECRET_KEY = os.environ["DJANGO_SECRET_KEY"]
elif DEBUG or os.environ.get("DJANGO_LOCAL_SECRET_KEY") == "1":
    SECRET_KEY = local_secret_key(VAR_DIR)
else:
    raise ImproperlyConfigured(
        "DJANGO_SECRET_KEY is not set. Set it to a long random value shared by every web and worker process, "
        "e.g. DJANGO_SECRET_KEY=$(python -c 'import secrets; print(secrets.token_urlsafe(50))'); "
        "for a local run on this machine only, set DJANGO_LOCAL_SECRET_KEY=1 (or DJANGO_DEBUG=1) instead"
    )
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "durable_agents",
    "project.refunds",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # The admin's CSS and scripts, served by the web process itself from STATIC_ROOT (DEBUG off, no other server).
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
# Decision links send people who are not signed in to the admin's login page, then back.
LOGIN_URL = "admin:login"
WSGI_APPLICATION = "project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # project/templates: the site's own pages, e.g. 403.html in the admin's look.
        "DIRS": [BASE_DIR / "project" / "templates"],
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

# Workers keep their connection between steps: a fresh Postgres connection costs more than a step.
DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{VAR_DIR / 'durable_agents.sqlite3'}",
        conn_max_age=env_count("DJANGO_CONN_MAX_AGE", 600),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several worker processes share the embedded SQLite file: wait for the write lock instead of failing.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0 if os.environ.get("DJANGO_SQLITE_CLOSE") else 600

# DJANGO_DB_POOL=N: a pool of at most N connections per process (Django's psycopg pool). The model worker's
# threads take a connection for each short transaction and give it back (while Claude thinks they hold
# none), so a thousand conversations in flight share N connections.
DB_POOL_SIZE = env_count("DJANGO_DB_POOL", 0)
if DB_POOL_SIZE and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["CONN_MAX_AGE"] = 0  # the pool keeps the connections; Django gives them back
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False  # else every checkout costs a round trip; psycopg's pool
    # drops connections that broke while checked in, and a broken one in use fails its task, after which the
    # worker tests the pool's idle ones (durable_agents.connections.drop_connections); the sweep wakes the run
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1,
        "max_size": DB_POOL_SIZE,
        "timeout": 60,  # a thread waits this long for a free connection; then its step is retried
        "max_idle": 60,
    }
if os.environ.get("DJANGO_DB_APPLICATION_NAME") and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Names this process's connections in pg_stat_activity (e.g. "model_worker"), for operators and benchmarks.
    DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = os.environ["DJANGO_DB_APPLICATION_NAME"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"  # filled by `collectstatic` (the Procfile's `release`), served by WhiteNoise
# Compressed copies, under their plain names: a page renders whether or not collectstatic ran (the tests,
# runserver). A manifest of hashed names would fail every admin page until it ran, for a cache gain an
# operators' console does not need.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
MEDIA_ROOT = VAR_DIR / "media"

# Approval requests and reminders go out by email by default (see durable_agents.notify).
EMAIL_BACKEND = os.environ.get("DJANGO_EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = os.environ.get("DJANGO_DEFAULT_FROM_EMAIL", "durable-agents@localhost")

# The one handler is the root logger's: a Celery worker gives the root a handler of its own unless it has one
# already, so a handler on the durable_agents logger printed each of its lines twice in a worker's log.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"durable_agents": {"level": os.environ.get("DURABLE_LOG_LEVEL", "WARNING")}},
}

# Celery: Redis wakes workers; Postgres holds the truth. At-least-once delivery, made safe by the claim.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
if CELERY_BROKER_URL.startswith("filesystem://"):
    # The embedded broker: messages are files under var/, so the demo needs no server.
    _broker_dir = VAR_DIR / "broker"
    for _folder in ("queue", "processed", "control"):
        (_broker_dir / _folder).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
if CELERY_BROKER_URL.startswith("amqp"):
    # RabbitMQ: a quorum queue (replicated, survives a broker restart) and publisher confirms, so a wake-up
    # the broker acknowledged is not lost. Celery turns off global QoS for quorum queues by itself.
    CELERY_TASK_DEFAULT_QUEUE = "celery"
    CELERY_TASK_DEFAULT_QUEUE_TYPE = "quorum"
    # On a topic exchange, Celery delays a short retry's countdown in RabbitMQ (native delayed delivery); on a direct
    # one, a worker would hold it in its only prefetch slot until due (check W010). A new name: RabbitMQ refuses to
    # change the type of the direct `celery` exchange an earlier deploy declared.
    CELERY_TASK_DEFAULT_EXCHANGE = "durable_agents"
    CELERY_TASK_DEFAULT_EXCHANGE_TYPE = "topic"
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
    CELERY_WORKER_DETECT_QUORUM_QUEUES = True
CELERY_RESULT_BACKEND = "django-db"
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes every DB connection around each task unless told to reuse them: prefork
# workers keep theirs; a pooled worker's tasks give theirs back to the pool.
CELERY_DB_REUSE_MAX = 0 if DB_POOL_SIZE else env_count("CELERY_DB_REUSE_MAX", 1000000)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE = {
    "durable-agents-sweep": {
        "task": "durable_agents.sweep",
        "schedule": timedelta(seconds=env_seconds("DURABLE_SWEEP_SECONDS", 5.0)),
        "options": {"expires": 30},
    },
    # Deletes finished runs past DURABLE_AGENTS["RETENTION"] (none set here: nothing is pruned).
    "durable-agents-prune": {
        "task": "durable_agents.prune",
        "schedule": timedelta(hours=1),
        "options": {"expires": 3600},
    },
}

DURABLE_AGENTS = {
    "LEASE_SECONDS": env_seconds("DURABLE_LEASE_SECONDS", 15.0),
    "IDLE_RESWEEP_SECONDS": env_seconds("DURABLE_IDLE_RESWEEP_SECONDS", 10.0),
    "STUCK_AFTER_SECONDS": env_seconds("DURABLE_STUCK_AFTER_SECONDS", 600.0),
    # Approval emails carry links to this address; the default only works on this machine.
    "BASE_URL": env_base_url("DURABLE_BASE_URL", "http://127.0.0.1:8000"),
    # Who is asked when a wait names no one: "lead@example.com,oncall@example.com".
    "APPROVERS": [email.strip() for email in os.environ.get("DURABLE_APPROVERS", "").split(",") if email.strip()],
    # Unset: only staff logins may read /metrics.
    "METRICS_TOKEN": os.environ.get("DURABLE_METRICS_TOKEN", "").strip() or None,
    # "durable-model" (the Procfile sets it for every process): steps that wait on Claude go to the gevent
    # model worker (Procfile `model_worker`). Empty, the default: every step on the default queue.
    "MODEL_QUEUE": os.environ.get("DURABLE_MODEL_QUEUE", ""),
    # "durable-replay" (the Procfile sets it): replay runs (durable_replay) go to the Procfile's `replay_worker`, a
    # smaller gevent worker of their own, never in front of real runs. Empty, the default: where real runs go.
    "REPLAY_QUEUE": os.environ.get("DURABLE_REPLAY_QUEUE", ""),
    # A worker runs a run's next steps itself, without a broker hop, for up to this many ms; 0: one step per task.
    "EAGER_SLICE_MS": float(env_count("DURABLE_EAGER_SLICE_MS", 100)),
    # Runs started one per request have their wake-ups gathered for this many ms by a thread of the web process and
    # sent as one message (durable_agents/engine/gather.py); 0: each start sends its own as it commits.
    "WAKE_GATHER_MS": float(env_count("DURABLE_WAKE_GATHER_MS", 10)),
    # '{"*": {"requests_per_minute": 50, "input_tokens_per_minute": 30000}}': shared by every worker; unset: none.
    "MODEL_RATE_LIMITS": env_json("DURABLE_MODEL_RATE_LIMITS"),
    # "postgres" (the default) or a redis:// URL every worker reaches.
    "RATE_LIMIT_BACKEND": os.environ.get("DURABLE_RATE_LIMIT_BACKEND", "").strip() or "postgres",
    # Turns with delivery="batch" go out every BATCH_WINDOW_SECONDS; a batch is polled from BATCH_POLL_SECONDS on,
    # backing off to BATCH_POLL_MAX_SECONDS (`durable_demo --batch` makes them seconds).
    "BATCH_WINDOW_SECONDS": env_seconds("DURABLE_BATCH_WINDOW_SECONDS", 60.0),
    "BATCH_POLL_SECONDS": env_seconds("DURABLE_BATCH_POLL_SECONDS", 30.0),
    "BATCH_POLL_MAX_SECONDS": env_seconds("DURABLE_BATCH_POLL_MAX_SECONDS", 600.0),
    # Spans of runs, steps, model calls and tools, on when OTEL_TRACES_EXPORTER names an exporter (project/tracing.py).
    "TRACING": tracing.enabled(),
    # "http://127.0.0.1:16686/trace/{trace_id}" (Jaeger): the admin's run page links to the run's trace.
    "TRACE_URL": os.environ.get("DURABLE_TRACE_URL", ""),
}

# Behind a proxy that ends HTTPS (Heroku's router, a load balancer), the admin's and the decision page's forms
# post from the address approvers open: trust it for CSRF, and the proxy's word that the request was HTTPS.
_site = urlsplit(DURABLE_AGENTS["BASE_URL"])
CSRF_TRUSTED_ORIGINS = [f"{_site.scheme}://{_site.netloc}"]
if os.environ.get("DJANGO_BEHIND_HTTPS_PROXY") == "1":
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
