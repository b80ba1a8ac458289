"""One pass at a time of a named background job (the prune) across every machine: a lease row on the database's clock.

Not a session advisory lock: a session lock lives on the server connection that took it, and behind a pooler in
transaction mode (PgBouncer's `pool_mode = transaction`) that connection goes back to the pool as soon as the
statement's transaction ends. The unlock then runs on another server connection and releases nothing, the lock
stays on an idle one, and every later pass finds it taken — or, on that same connection, takes it again beside a
live pass. PgBouncer's feature map lists session-level advisory locks as "Never" supported in transaction pooling
(https://www.pgbouncer.org/features.html). A row reads the same through any connection.

The row (`JobLease`, one per job name) names its holder ("<worker or host>:<pid>") and its expiry:

* `take_job_lease` is one conditional UPDATE: it takes the row iff it is free (released) or its expiry has passed on
  the database's clock, with a fresh token; otherwise it says who holds it and until when;
* a renewal and the release match that token: a holder that lost its lease (held up past its expiry while another
  took over) renews nothing and releases nothing of its successor's;
* a holder that died (SIGKILL, OOM, a lost machine) releases nothing: its row lapses at its expiry, and the next
  pass takes it over.

`JobLeaseHeld` holds a lease for a `with` block: a thread renews it every third of its length, on a connection of
its own that it gives back after each renewal; the job calls `renew()` between its steps to learn at once whether
it still holds it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import DatabaseError, connections
from django.db.models import Q

from durable_agents.clock import DbNow
from durable_agents.engine.lease import worker_id
from durable_agents.models import JobLease

logger = logging.getLogger("durable_agents.engine")

# Between reading who holds a lease and reading it again, its holder may release it: take again this many times.
TAKE_ATTEMPTS = 3


@dataclass(frozen=True)
class Holder:
    """Who holds a job's lease: "<worker or host>:<pid>", since when and until when (the database's clock)."""

    holder: str
    since: datetime | None
    until: datetime | None


def take_job_lease(name: str, *, seconds: float, holder: str | None = None) -> uuid.UUID | Holder:
    """Take the lease of job `name` for `seconds` if it is free or lapsed: its token; else who holds it.

    Example::

        taken = take_job_lease("prune", seconds=60)
        if isinstance(taken, Holder):
            print(f"held by {taken.holder} until {taken.until}")
    """
    holder = holder or worker_id()
    JobLease.objects.bulk_create([JobLease(name=name)], ignore_conflicts=True)  # the job's first pass ever
    free = Q(expires_at__isnull=True) | Q(expires_at__lte=DbNow())
    held: Holder | None = None
    for _ in range(TAKE_ATTEMPTS):
        token = uuid.uuid4()
        # Racing takers line up on the row lock; the second re-reads the row and finds it held: one wins.
        taken = JobLease.objects.filter(free, name=name).update(
            holder=holder, token=token, taken_at=DbNow(), expires_at=DbNow(timedelta(seconds=seconds))
        )
        if taken:
            return token
        row = JobLease.objects.filter(~free, name=name).values_list("holder", "taken_at", "expires_at").first()
        if row is not None:
            held = Holder(*row)
            break
    # Taken and released again each time this pass looked (passes of a few milliseconds, back to back).
    return held or Holder("another pass, just ended", None, None)


def renew_job_lease(name: str, token: uuid.UUID, *, seconds: float) -> bool:
    """Push the lease's expiry `seconds` past the database's now; False if it is no longer this token's."""
    return JobLease.objects.filter(name=name, token=token).update(expires_at=DbNow(timedelta(seconds=seconds))) == 1


def release_job_lease(name: str, token: uuid.UUID) -> None:
    """Free the lease now (the next pass need not wait for its expiry); nothing if it is no longer this token's."""
    JobLease.objects.filter(name=name, token=token).update(token=None, expires_at=None)


class JobLeaseHeld:
    """The lease of job `name` for a `with` block, renewed by a thread while the block runs, released at its end.

    Usage::

        with JobLeaseHeld("prune", seconds=60) as lease:
            if lease.holder is not None:
                return f"busy: {lease.holder.holder} holds it until {lease.holder.until}"
            for batch in batches:
                if not lease.renew():
                    return "lost: another pass took over"
                work(batch)
    """

    def __init__(self, name: str, *, seconds: float) -> None:
        self.name = name
        self.seconds = seconds
        self.token: uuid.UUID | None = None
        self.holder: Holder | None = None  # who held it, when this block could not take it
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def lost(self) -> bool:
        """True once a renewal found the lease another's (it lapsed and was taken over)."""
        return self._lost.is_set()

    def renew(self) -> bool:
        """Renew the lease now; False (and `lost`) if it is no longer this block's."""
        if self.token is None or self.lost:
            return False
        if not renew_job_lease(self.name, self.token, seconds=self.seconds):
            self._lose()
        return not self.lost

    def __enter__(self) -> JobLeaseHeld:
        taken = take_job_lease(self.name, seconds=self.seconds)
        if isinstance(taken, Holder):
            self.holder = taken
            return self
        self.token = taken
        self._thread = threading.Thread(
            target=self._renew_until_stopped, name=f"durable-{self.name}-lease", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.token is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # Released even after an error: the next pass need not wait out the expiry.
        try:
            release_job_lease(self.name, self.token)
        except DatabaseError:
            # The database is away (perhaps why the block failed): the row lapses at its expiry instead. The
            # block's own error, if any, goes on.
            logger.warning("job lease %s not released (the database is away); it lapses at its expiry", self.name)

    def _lose(self) -> None:
        if not self.lost:
            self._lost.set()
            logger.warning("job lease %s lost: it lapsed and another holder took it over", self.name)

    def _renew_until_stopped(self) -> None:
        interval = self.seconds / 3
        while not self._stop.wait(interval) and not self.lost:
            try:
                self.renew()
            except Exception:  # noqa: BLE001 - a database blip: tried again next round, the lease lasts three
                logger.exception("job lease %s: renewal failed; trying again in %.1f s", self.name, interval)
            finally:
                # A connection of this thread's own, given back between renewals: a pass resting for an hour holds
                # none (and a pooled one goes back to its pool).
                connections["default"].close()
