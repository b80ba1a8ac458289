"""The lease: one conditional UPDATE claims a run with a fresh fencing token; a heartbeat renews it.

The token fences zombie workers: every commit is `... WHERE lease_token = <token>`, so a worker that
lost its lease (paused, partitioned, too slow) commits nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection, connections

from durable_agents import clock
from durable_agents.conf import settings
from durable_agents.models import Run, RunStatus

logger = logging.getLogger("durable_agents.engine")


def worker_id() -> str:
    # Forked pool children inherit the module: take the pid at call time.
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Claim:
    """A held lease: the token every commit must present, and where the run stands."""

    run_id: uuid.UUID
    token: int
    owner: str
    cursor: int
    step_count: int
    attempt: int
    previous_owner: str
    # Non-empty while a saga compensates: the run ends with this status instead of `completed`.
    finish_as: str = ""


def lease_seconds() -> float:
    return float(settings.LEASE_SECONDS)


def _claim_sql() -> str:
    table = connection.ops.quote_name(Run._meta.db_table)
    return f"""
        UPDATE {table}
           SET status = %s,
               previous_lease_owner = lease_owner,
               lease_owner = %s,
               lease_token = lease_token + 1,
               lease_expires_at = %s,
               attempt = attempt + 1,
               started_at = COALESCE(started_at, %s),
               wake_at = NULL
         WHERE id = %s
           AND status IN (%s, %s)
           AND cancel_requested_at IS NULL
           AND (lease_expires_at IS NULL OR lease_expires_at < %s)
           AND (wake_at IS NULL OR wake_at <= %s)
     RETURNING lease_token, cursor, step_count, attempt, previous_lease_owner, finish_as
    """


def as_uuid(run_id: uuid.UUID | str) -> uuid.UUID:
    return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))


def claim_run(run_id: uuid.UUID | str) -> Claim | None:
    """Take the run's lease iff it is runnable and its lease is free or expired; None otherwise.

    One statement, no transaction: a duplicate delivery of the same message matches 0 rows.
    """
    run_uuid = as_uuid(run_id)
    now = clock.now()
    owner = worker_id()
    adapt = connection.ops.adapt_datetimefield_value
    params = [
        RunStatus.RUNNING.value,
        owner,
        adapt(now + timedelta(seconds=lease_seconds())),
        adapt(now),
        Run._meta.pk.get_db_prep_value(run_uuid, connection),
        RunStatus.PENDING.value,
        RunStatus.RUNNING.value,
        adapt(now),
        adapt(now),
    ]
    with connection.cursor() as cursor:
        cursor.execute(_claim_sql(), params)
        row = cursor.fetchone()
    if row is None:
        return None
    token, position, step_count, attempt, previous_owner, finish_as = row
    return Claim(
        run_id=run_uuid,
        token=token,
        owner=owner,
        cursor=position,
        step_count=step_count,
        attempt=attempt,
        previous_owner=previous_owner or "",
        finish_as=finish_as or "",
    )


def renew_lease(claim: Claim) -> bool:
    """Push the lease expiry forward; False if the lease was lost (another worker took the run)."""
    expires = clock.now() + timedelta(seconds=lease_seconds())
    # Owner and a held lease too: a renewal racing the commit must not re-arm a lease just released.
    return (
        Run.objects.filter(
            pk=claim.run_id, lease_token=claim.token, lease_owner=claim.owner, lease_expires_at__isnull=False
        ).update(lease_expires_at=expires)
        == 1
    )


class Heartbeat:
    """Keeps a claim's lease alive while its step runs; `lost` turns True if another worker took the run.

    Usage::

        with Heartbeat(claim) as beat:
            run_the_step()
        if beat.lost: ...

    One renewer thread per process serves every heartbeat: entering and leaving costs a dict operation,
    not a thread start, and the thread opens a database connection only when a step outlives a third
    of its lease.
    """

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.lost = False
        self.renewed_at = time.monotonic()

    def __enter__(self) -> Heartbeat:
        _renewer().add(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _renewer().discard(self)


class _Renewer:
    """The process's lease-renewal thread (started lazily, and again in a forked child)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._beats: set[Heartbeat] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="durable-lease-renewer", daemon=True)
        self._thread.start()

    def add(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.add(beat)

    def discard(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.discard(beat)

    def _run(self) -> None:
        while True:
            interval = lease_seconds() / 3
            time.sleep(interval / 4)
            with self._lock:
                due = [b for b in self._beats if time.monotonic() - b.renewed_at >= interval]
            for beat in due:
                self._renew(beat)
            if due:
                # The thread's own connection: closed between rounds so an idle worker holds none.
                connections.close_all()

    def _renew(self, beat: Heartbeat) -> None:
        try:
            renewed = renew_lease(beat.claim)
        except Exception:
            # A failed renewal (a database blip) is tried again next round; the commit is fenced anyway.
            logger.exception("lease renewal failed run=%s", beat.claim.run_id)
            return
        if renewed:
            beat.renewed_at = time.monotonic()
            return
        beat.lost = True
        logger.warning("lease lost run=%s token=%s", beat.claim.run_id, beat.claim.token)
        with self._lock:
            self._beats.discard(beat)


_the_renewer: _Renewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> _Renewer:
    global _the_renewer
    if _the_renewer is None or _the_renewer.pid != os.getpid():
        with _renewer_lock:
            if _the_renewer is None or _the_renewer.pid != os.getpid():
                _the_renewer = _Renewer()
    return _the_renewer
