"""Process heartbeats: the sweep and every worker record when they last showed life (ProcessHeartbeat).

What is written when, and its cost:

* the sweep: one UPSERT of the row "sweep" at the end of each pass, with the broker's queue depths it measured as the
  pass began (and the pass before's, to tell a growing backlog): the console reads them there, never the broker;
* a worker: one UPSERT of its own row every WORKER_HEARTBEAT_SECONDS, from a thread of the worker's main process
  started when the worker is ready (tasks.py), on a connection outside any pool, never on a step's path, with how busy
  it is (slots busy of its concurrency; its database pool's waits, read from the pool, not a query); the row goes on a
  warm shutdown;
* the sweep also deletes rows not seen for HEARTBEAT_KEEP_SECONDS (killed workers): one DELETE of a tiny table.

Times are the database's (DbNow): a worker's clock says nothing about whether the sweep is late.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
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
    name: str,
    kind: str,
    *,
    hostname: str = "",
    pid: int | None = None,
    queues: list[str] | None = None,
    load: dict[str, Any] | None = None,
    keep_previous: bool = False,
    db: Any = None,
) -> None:
    """Upsert the row `name` with last_seen = the database's now and `load` (what the process measured): one statement
    (on Postgres). `keep_previous` keeps the row's former load under load["previous"] (one pass back, not a chain).
    `db` is a connection to use instead of the default one (a worker's own, outside the pool).

    Example::

        record_beat("sweep", ProcessHeartbeat.Kind.SWEEP, load={"queued": {"celery": 3}}, keep_previous=True)
    """
    fields = {"hostname": hostname, "pid": pid, "queues": sorted(queues or []), "load": load or {}}
    connection = db if db is not None else connections["default"]
    if connection.vendor == "postgresql":
        table = connection.ops.quote_name(ProcessHeartbeat._meta.db_table)
        # The former load is read in the same statement that replaces it: two sweeps overlapping cannot lose a pass.
        new_load = (
            f"EXCLUDED.load || jsonb_build_object('previous', {table}.load - 'previous')"
            if keep_previous
            else ("EXCLUDED.load")
        )
        with connection.cursor() as cursor:
            cursor.execute(
                f"""
                INSERT INTO {table} (name, kind, hostname, pid, queues, load, started_at, last_seen)
                VALUES (%(name)s, %(kind)s, %(hostname)s, %(pid)s, %(queues)s::jsonb, %(load)s::jsonb,
                        STATEMENT_TIMESTAMP() + %(shift)s, STATEMENT_TIMESTAMP() + %(shift)s)
                ON CONFLICT (name) DO UPDATE SET last_seen = EXCLUDED.last_seen, hostname = EXCLUDED.hostname,
                       pid = EXCLUDED.pid, queues = EXCLUDED.queues, load = {new_load}
                """,
                {
                    **fields,
                    "name": name,
                    "kind": kind,
                    "queues": json.dumps(fields["queues"]),
                    "load": json.dumps(fields["load"]),
                    "shift": clock.offset(),
                },
            )
        return
    # Elsewhere (the embedded SQLite default): an UPDATE, and the first time an INSERT.
    if keep_previous:
        former = ProcessHeartbeat.objects.filter(name=name).values_list("load", flat=True).first()
        if former:
            fields["load"] = {**fields["load"], "previous": {k: v for k, v in former.items() if k != "previous"}}
    if ProcessHeartbeat.objects.filter(name=name).update(last_seen=DbNow(), **fields):
        return
    try:
        with transaction.atomic():
            ProcessHeartbeat.objects.create(name=name, kind=kind, started_at=DbNow(), last_seen=DbNow(), **fields)
    except IntegrityError:
        # Another process created it between the UPDATE and the INSERT: it exists now.
        ProcessHeartbeat.objects.filter(name=name).update(last_seen=DbNow(), **fields)


def record_sweep(queued: Mapping[str, int] | None = None, measured_at: datetime | None = None) -> None:
    """The sweep finished a pass; `queued`: the broker's depth of each run queue, as measured at `measured_at` (the
    database's time the pass began); None: the broker was not asked, or did not answer — unknown, never 0."""
    load = {
        "queued": None if queued is None else dict(queued),
        "measured_at": None if measured_at is None else measured_at.isoformat(),
    }
    record_beat(SWEEP, ProcessHeartbeat.Kind.SWEEP, load=load, keep_previous=True)


def prune_heartbeats(now: datetime) -> int:
    """Forget workers not seen for HEARTBEAT_KEEP_SECONDS (killed ones never said goodbye)."""
    keep = timedelta(seconds=float(settings.HEARTBEAT_KEEP_SECONDS))
    deleted, _ = ProcessHeartbeat.objects.filter(kind=ProcessHeartbeat.Kind.WORKER, last_seen__lt=now - keep).delete()
    return deleted


def worker_beat_name(hostname: str, pid: int) -> str:
    return f"worker:{hostname}:{pid}"


def pool_load(alias: str = "default") -> dict[str, int] | None:
    """This process's database pool (Django's, psycopg_pool's `get_stats()`) as the heartbeat records it: connections
    open (`size`) of at most `max`, idle (`available`), requests waiting for one now (`waiting`), and requests that
    failed or timed out waiting since the pool opened (`errors`). None without a pool in this process — a prefork
    worker's pools are in its children — or before its first task opened it.

    Example: pool_load() → {"size": 1, "max": 1, "available": 0, "waiting": 40, "errors": 3}
    """
    # Read, never created: `connection.pool` would open a pool in a prefork parent, shared with the children it forks.
    opened = getattr(type(connections[alias]), "_connection_pools", {}).get(alias)
    if opened is None:
        return None
    stats = opened.get_stats()
    return {
        "size": stats.get("pool_size", 0),
        "max": stats.get("pool_max", 0),
        "available": stats.get("pool_available", 0),
        "waiting": stats.get("requests_waiting", 0),
        "errors": stats.get("requests_errors", 0),
    }


class WorkerHeartbeat:
    """A worker's heartbeat thread: writes the worker's row now and every WORKER_HEARTBEAT_SECONDS, with how busy the
    worker is: `slots` (a callable giving (busy, concurrency), Celery's side, from tasks.py) and its pool's waits.

    Usage (tasks.py does this on Celery's worker_ready and worker_shutdown)::

        beat = WorkerHeartbeat("celery@web-1", pid=os.getpid(), queues=["celery"], slots=lambda: (3, 8)).start()
        ...
        beat.stop()  # and the row is deleted: a worker that left is not "gone", it is not there
    """

    def __init__(
        self, hostname: str, *, pid: int, queues: list[str], slots: Callable[[], tuple[int, int]] | None = None
    ) -> None:
        self.name = worker_beat_name(hostname, pid)
        self.fields: dict[str, Any] = {"hostname": hostname, "pid": pid, "queues": queues}
        self.slots = slots
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
                record_beat(self.name, ProcessHeartbeat.Kind.WORKER, **self.fields, load=self.load(), db=own)
            except Exception:  # noqa: BLE001 - a database blip: the next beat tries again
                logger.warning("worker heartbeat of %s failed", self.name, exc_info=True)
            finally:
                # Closed between beats: this thread lives in the worker's main process, which forks pool
                # children; a connection open across a fork would be shared with them.
                connections.close_all()
                if own is not None:
                    own.close()
            self._stopped.wait(float(settings.WORKER_HEARTBEAT_SECONDS))

    def load(self) -> dict[str, Any]:
        """How busy the worker is now; {} for what it cannot tell (unknown, never 0)."""
        load: dict[str, Any] = {}
        try:
            if self.slots is not None:
                load["slots_busy"], load["slots"] = self.slots()
            load["pool"] = pool_load()
        except Exception:  # noqa: BLE001 - a figure it cannot read must not silence the heartbeat
            logger.warning("could not measure the load of %s", self.name, exc_info=True)
        return load
