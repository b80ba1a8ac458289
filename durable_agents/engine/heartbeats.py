"""Process heartbeats: the sweep and every worker record when they last showed life (ProcessHeartbeat).

What is written when, and its cost:

* the sweep: one UPSERT of the row "sweep" at the end of each pass;
* a worker: one UPSERT of its own row every WORKER_HEARTBEAT_SECONDS, from a thread of the worker's main process
  started when the worker is ready (tasks.py), on a connection outside any pool, never on a step's path; the row
  goes on a warm shutdown;
* the sweep also deletes rows not seen for HEARTBEAT_KEEP_SECONDS (killed workers): one DELETE of a tiny table.

Times are the database's (DbNow): a worker's clock says nothing about whether the sweep is late.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction

from durable_agents import clock
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.engine.lease import outside_the_pool
from durable_agents.models import ProcessHeartbeat

logger = logging.getLogger("durable_agents.engine")

SWEEP = "sweep"


def record_beat(
    name: str, kind: str, *, hostname: str = "", pid: int | None = None, queues: list[str] | None = None, db: Any = None
) -> None:
    """Upsert the row `name` with last_seen = the database's now: one statement (on Postgres). `db` is a
    connection to use instead of the default one (a worker's own, outside the pool).

    Example::

        record_beat("sweep", ProcessHeartbeat.Kind.SWEEP)
    """
    fields = {"hostname": hostname, "pid": pid, "queues": sorted(queues or [])}
    connection = db if db is not None else connections["default"]
    if connection.vendor == "postgresql":
        table = connection.ops.quote_name(ProcessHeartbeat._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                INSERT INTO {table} (name, kind, hostname, pid, queues, started_at, last_seen)
                VALUES (%(name)s, %(kind)s, %(hostname)s, %(pid)s, %(queues)s::jsonb,
                        STATEMENT_TIMESTAMP() + %(shift)s, STATEMENT_TIMESTAMP() + %(shift)s)
                ON CONFLICT (name) DO UPDATE SET last_seen = EXCLUDED.last_seen, hostname = EXCLUDED.hostname,
                       pid = EXCLUDED.pid, queues = EXCLUDED.queues
                """,
                {**fields, "name": name, "kind": kind, "queues": json.dumps(fields["queues"]), "shift": clock.offset()},
            )
        return
    # Elsewhere (the embedded SQLite default): an UPDATE, and the first time an INSERT.
    if ProcessHeartbeat.objects.filter(name=name).update(last_seen=DbNow(), **fields):
        return
    try:
        with transaction.atomic():
            ProcessHeartbeat.objects.create(name=name, kind=kind, started_at=DbNow(), last_seen=DbNow(), **fields)
    except IntegrityError:
        # Another process created it between the UPDATE and the INSERT: it exists now.
        ProcessHeartbeat.objects.filter(name=name).update(last_seen=DbNow(), **fields)


def record_sweep() -> None:
    """The sweep finished a pass."""
    record_beat(SWEEP, ProcessHeartbeat.Kind.SWEEP)


def prune_heartbeats(now: datetime) -> int:
    """Forget workers not seen for HEARTBEAT_KEEP_SECONDS (killed ones never said goodbye)."""
    keep = timedelta(seconds=float(settings.HEARTBEAT_KEEP_SECONDS))
    deleted, _ = ProcessHeartbeat.objects.filter(kind=ProcessHeartbeat.Kind.WORKER, last_seen__lt=now - keep).delete()
    return deleted


def worker_beat_name(hostname: str, pid: int) -> str:
    return f"worker:{hostname}:{pid}"


class WorkerHeartbeat:
    """A worker's heartbeat thread: writes the worker's row now and every WORKER_HEARTBEAT_SECONDS.

    Usage (tasks.py does this on Celery's worker_ready and worker_shutdown)::

        beat = WorkerHeartbeat("celery@web-1", pid=os.getpid(), queues=["celery"]).start()
        ...
        beat.stop()  # and the row is deleted: a worker that left is not "gone", it is not there
    """

    def __init__(self, hostname: str, *, pid: int, queues: list[str]) -> None:
        self.name = worker_beat_name(hostname, pid)
        self.fields: dict[str, Any] = {"hostname": hostname, "pid": pid, "queues": queues}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="durable-worker-heartbeat", daemon=True)

    def start(self) -> WorkerHeartbeat:
        self._thread.start()
        return self

    def stop(self, *, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._thread.join(timeout)
        try:
            ProcessHeartbeat.objects.filter(name=self.name).delete()
        except Exception:  # noqa: BLE001 - a worker shutting down with the database away: the sweep prunes it
            logger.warning("could not remove the heartbeat of %s", self.name, exc_info=True)
        finally:
            connections.close_all()

    def _run(self) -> None:
        # Outside the pool (the model worker's): steps holding every pooled connection must not silence the worker.
        own = outside_the_pool("durable_heartbeat", "heartbeat")
        while not self._stopped.is_set():
            try:
                record_beat(self.name, ProcessHeartbeat.Kind.WORKER, **self.fields, db=own)
            except Exception:  # noqa: BLE001 - a database blip: the next beat tries again
                logger.warning("worker heartbeat of %s failed", self.name, exc_info=True)
            finally:
                # Closed between beats: this thread lives in the worker's main process, which forks pool
                # children; a connection open across a fork would be shared with them.
                connections.close_all()
                if own is not None:
                    own.close()
            self._stopped.wait(float(settings.WORKER_HEARTBEAT_SECONDS))
