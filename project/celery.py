"""The Celery app: configured from Django settings (CELERY_*), tasks autodiscovered from installed apps; each process
that runs tasks configures its OpenTelemetry SDK from OTEL_* (project/tracing.py) after any fork."""

import os
from typing import Any

from celery import Celery
from celery.concurrency import get_implementation
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutdown

from project import tracing

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

app = Celery("project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_process_init.connect(weak=False)
def _trace_pool_process(**_: Any) -> None:
    # A prefork pool child, just forked (or the solo pool's one process): its own SDK, its own exporter threads.
    tracing.configure(tracing.WORKER, celery=True)


@worker_process_shutdown.connect(weak=False)
def _flush_pool_process(**_: Any) -> None:
    tracing.flush()


@worker_init.connect(weak=False)
def _trace_worker(sender: Any = None, **_: Any) -> None:
    # The threads and gevent pools run tasks in the main process, which sends no worker_process_init.
    pool = get_implementation(getattr(sender, "pool_cls", None) or "prefork")
    if not issubclass(pool, PreforkPool | SoloPool):
        tracing.configure(tracing.WORKER, celery=True)


@worker_shutdown.connect(weak=False)
def _flush_worker(**_: Any) -> None:
    tracing.flush()
