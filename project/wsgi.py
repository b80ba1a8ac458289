"""WSGI entry point for gunicorn (see Procfile); traced when OTEL_TRACES_EXPORTER says so (project/tracing.py)."""

import os

from django.core.wsgi import get_wsgi_application

from project import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
# Before the application loads its middleware: the Django instrumentation adds its own in front. Celery's too: a
# wake-up published in a request carries its trace to the worker.
tracing.configure(tracing.WEB, django=True, celery=True)
application = get_wsgi_application()
