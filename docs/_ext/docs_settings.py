"""Django settings for building the documentation: the app installed, no database opened, no broker reached.

autodoc imports durable_agents.api, which imports the models, so Django must be set up; nothing here connects.
"""

SECRET_KEY = "durable-agents-docs-not-a-secret"  # noqa: S105  (signs nothing: the docs build serves no request)
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_celery_results",
    "durable_agents",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
CELERY_BROKER_URL = "memory://"
