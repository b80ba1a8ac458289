"""The lease: a claim (transitions.claim_run) takes a run with a fresh fencing token; heartbeats renew it.

The token fences zombie workers: every commit is `... WHERE lease_token = <token>`, so a worker that
lost its lease (paused, partitioned, too slow) commits nothing. Expiries are on the database's clock.
One renewer thread per process renews every lease the process holds in one statement per tick.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from functools import cache
from typing import Any, NamedTuple

from django.db import connections
from django.db.utils import load_backend

from durable_agents import clock
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.engine import statements
from durable_agents.models import Run

logger = logging.getLogger("durable_agents.engine")


# The Celery worker's node name ("celery@web-1"), set as the worker starts, before its pool forks: a lease then
# names the worker its heartbeat names, and the console can tell a dead pool process from a dead worker.
_node = ""


def name_this_worker(node: str) -> None:
    """Leases taken in this process (and the pool processes it forks) name the worker `node`."""
    global _node
    _node = node


def worker_id() -> str:
    """`<node>:<pid>` — the Celery worker's name (else the host's) and the process holding the lease. Forked
    pool children inherit the module: the pid is taken at call time."""
    return f"{_node or socket.gethostname()}:{os.getpid()}"[:200]


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
    # When the claim took the lease, on the database's clock: the step's start.
    claimed_at: datetime | None = None
    # The holder this claim took over from (previous_owner): when it had claimed, and when its lease ran out.
    previous_claimed_at: datetime | None = None
    previous_expires_at: datetime | None = None
    # When this process got the claim (time.monotonic()): a claim made ahead of its step — by the commit before it,
    # for the slice's next step or the batch's next run — is as old as that commit, not as the step's start.
    taken: float = field(default_factory=time.monotonic, compare=False)


def as_uuid(run_id: uuid.UUID | str) -> uuid.UUID:
    return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))


def lease_seconds() -> float:
    return float(settings.LEASE_SECONDS)


def renew_lease(claim: Claim, lease: float | None = None) -> bool:
    """Push the lease expiry forward on the database's clock (by `lease` seconds, else LEASE_SECONDS); False if the
    lease was lost (another worker took the run, or it was released)."""
    if connections["default"].vendor == "postgresql" and lease is None:
        return prove_lease(claim) is not None
    # The ORM's UPDATE: on SQLite, or with `lease` given (only renew_leases' SQLite branch passes one; on Postgres the
    # renewer renews every lease in one statement of its own). Owner and a held lease too: a renewal racing the commit
    # must not re-arm a lease just released.
    return (
        Run.objects.filter(
            pk=claim.run_id, lease_token=claim.token, lease_owner=claim.owner, lease_expires_at__isnull=False
        ).update(lease_expires_at=DbNow(timedelta(seconds=lease if lease is not None else lease_seconds())))
        == 1
    )


class Spent(NamedTuple):
    """A run's spend and its own budgets (None: the workflow's), as its row had them when its lease was proven."""

    tokens: int
    cost_usd: Decimal
    token_budget: int | None
    cost_budget_usd: Decimal | None


def prove_lease(claim: Claim) -> Spent | None:
    """renew_lease, and the run's spend as its row has it then, in one statement; None if the lease was lost."""
    if connections["default"].vendor != "postgresql":
        if not renew_lease(claim):
            return None
        row = (
            Run.objects.filter(pk=claim.run_id)
            .values_list(*SPEND_COLUMNS, "cost_usd", "token_budget", "cost_budget_usd")
            .get()
        )
        return Spent(sum(row[: len(SPEND_COLUMNS)]), Decimal(row[-3]), row[-2], row[-1])
    with statements.cursor() as cursor:
        cursor.execute(_prove_sql(), proof_params(claim))
        row = cursor.fetchone()
    return None if row is None else spent(row)


def proof_params(claim: Claim) -> dict[str, Any]:
    """The parameters of proving_update(): the claim's fence and the lease's new length."""
    return {
        "run_id": claim.run_id,
        "token": claim.token,
        "owner": claim.owner,
        "lease": clock.offset(timedelta(seconds=lease_seconds())),
    }


def spent(row: tuple[Any, ...]) -> Spent:
    """The Spent that proving_update()'s RETURNING gives."""
    return Spent(int(row[0]), Decimal(row[1]), row[2], row[3])


# What a run has spent, in tokens: everything billed.
SPEND_COLUMNS = ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")


def proving_update(also: str = "") -> str:
    """The statement that proves a lease and extends it on the database's clock, returning the run's spend (see
    spent()); `also` adds conditions. Its parameters are proof_params()'s. Owner and a held lease too: a renewal
    racing the commit must not re-arm a lease just released."""
    return f"""
        UPDATE {connections["default"].ops.quote_name(Run._meta.db_table)}
           SET lease_expires_at = STATEMENT_TIMESTAMP() + %(lease)s
         WHERE id = %(run_id)s AND lease_token = %(token)s AND lease_owner = %(owner)s AND lease_expires_at IS NOT NULL
               {also}
     RETURNING {" + ".join(SPEND_COLUMNS)}, cost_usd, token_budget, cost_budget_usd
    """


@cache
def _prove_sql() -> str:
    return proving_update()


def renew_leases(claims: list[Claim], db: Any = None, lease: float | None = None) -> tuple[set[Claim], set[Claim]]:
    """Renew many leases (by `lease` seconds, else LEASE_SECONDS) in one fenced statement (and, for any it skipped,
    one plain read): (renewed, lost). Claims in neither were skipped this time because another transaction held
    their row lock: one locked row must not delay every other heartbeat."""
    if not claims:
        return set(), set()
    lease = lease if lease is not None else lease_seconds()
    connection = db if db is not None else connections["default"]
    if connection.vendor != "postgresql":
        renewed = {c for c in claims if renew_lease(c, lease)}
        return renewed, set(claims) - renewed
    table = connection.ops.quote_name(Run._meta.db_table)
    held = [(c.run_id, c.token, c.owner) for c in claims]
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            WITH held AS (
                SELECT r.id FROM {table} r
                  JOIN unnest(%(ids)s::uuid[], %(tokens)s::bigint[], %(owners)s::text[]) AS h(id, token, owner)
                    ON r.id = h.id AND r.lease_token = h.token AND r.lease_owner = h.owner
                 WHERE r.lease_expires_at IS NOT NULL
                   FOR UPDATE OF r SKIP LOCKED
            )
            UPDATE {table} r SET lease_expires_at = STATEMENT_TIMESTAMP() + %(lease)s
              FROM held WHERE r.id = held.id
            RETURNING r.id
            """,
            {
                "ids": [h[0] for h in held],
                "tokens": [h[1] for h in held],
                "owners": [h[2] for h in held],
                "lease": clock.offset(timedelta(seconds=lease)),
            },
        )
        renewed_ids = {row[0] for row in cursor.fetchall()}
        rest = [c for c in claims if c.run_id not in renewed_ids]
        if not rest:
            return set(claims), set()
        # A plain read does not wait for row locks: it tells a lost lease from a locked row.
        cursor.execute(
            f"SELECT id, lease_token, lease_owner, lease_expires_at IS NOT NULL FROM {table} WHERE id = ANY(%s)",
            [[c.run_id for c in rest]],
        )
        current = {row[0]: row[1:] for row in cursor.fetchall()}
    renewed = {c for c in claims if c.run_id in renewed_ids}
    lost = {c for c in rest if current.get(c.run_id) != (c.token, c.owner, True)}
    return renewed, lost


def outside_the_pool(alias: str, label: str) -> Any | None:
    """A new connection like the default one but outside its pool, for a background thread; None if the default
    connection has no pool (use it). Its application_name gets `:label`, told apart in pg_stat_activity.

    Example::

        own = outside_the_pool("durable_renewer", "lease-renewer")
        db = own or connections["default"]
    """
    default = connections["default"]
    if not (default.settings_dict.get("OPTIONS") or {}).get("pool"):
        return None
    settings_dict = {**default.settings_dict, "OPTIONS": dict(default.settings_dict["OPTIONS"])}
    settings_dict["OPTIONS"].pop("pool")
    if settings_dict["OPTIONS"].get("application_name"):
        settings_dict["OPTIONS"]["application_name"] += f":{label}"
    return load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, alias=alias)


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

    def __init__(self, dead: _Renewer | None = None) -> None:
        """`dead`: the renewer of this process whose thread died; its heartbeats (and their lock) are taken over."""
        self.pid = os.getpid()
        self._beats: set[Heartbeat] = dead._beats if dead is not None else set()
        self._lock = dead._lock if dead is not None else threading.Lock()
        self._thread = threading.Thread(target=self._run, name="durable-lease-renewer", daemon=True)
        self._thread.start()

    def add(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.add(beat)

    def discard(self, beat: Heartbeat) -> None:
        with self._lock:
            self._beats.discard(beat)

    def _run(self) -> None:
        # Until LEASE_SECONDS is first read (always at once, unless the settings are broken from the start): short
        # leases renewed often, as renewing early costs a statement and renewing late a run.
        lease = 3.0
        while True:
            try:
                lease = self._readable_lease(lease)
                interval = lease / 3
                time.sleep(interval / 4)
                with self._lock:
                    due = [b for b in self._beats if time.monotonic() - b.renewed_at >= interval]
                if due:
                    try:
                        self._renew(due, lease)
                    finally:
                        self._close()
            except BaseException:  # noqa: BLE001 - a gevent Timeout, a sys.exit(): the leases must not lapse with it
                logger.exception("a round of the lease renewer failed; it goes on")
                time.sleep(0.25)

    _unreadable = False

    def _readable_lease(self, last: float) -> float:
        """LEASE_SECONDS; the last one read while the settings cannot be read or hold no positive number (replaced
        by a test's, a reload half done): a renewer that stopped would let every lease of this process lapse."""
        try:
            lease = lease_seconds()
            problem = "" if math.isfinite(lease) and lease > 0 else f"LEASE_SECONDS is {lease!r}"
        except Exception as exc:  # noqa: BLE001 - see the docstring
            problem = f"cannot read LEASE_SECONDS ({type(exc).__name__}: {exc})"
        if problem and not self._unreadable:
            logger.warning("%s; renewing leases of %.1f s meanwhile", problem, last)
        self._unreadable = bool(problem)
        return last if problem else lease

    def _close(self) -> None:
        """The thread's own connections, closed between rounds so an idle worker holds none."""
        try:
            connections.close_all()
            if self._own is not None:
                self._own.close()
        except Exception:  # noqa: BLE001 - a connection that will not close is dropped next round
            logger.warning("could not close the lease renewer's connection", exc_info=True)

    _own: Any = None

    def _connection(self) -> Any:
        """The default connection; or, when it comes from a pool (the model worker), one of the renewer's own
        outside the pool: steps that hold every pooled connection (tools waiting on HTTP) must not stop the
        heartbeat of every other conversation."""
        if self._own is None:
            self._own = outside_the_pool("durable_renewer", "lease-renewer")
        return self._own or connections["default"]

    def _renew(self, due: list[Heartbeat], lease: float) -> None:
        try:
            renewed, lost = renew_leases([b.claim for b in due], self._connection(), lease)
        except Exception:
            # A failed renewal (a database blip) is tried again next round; the commit is fenced anyway.
            logger.exception("lease renewal failed for %d runs", len(due))
            return
        now = time.monotonic()
        for beat in due:
            if beat.claim in renewed:
                beat.renewed_at = now
            elif beat.claim in lost:
                beat.lost = True
                logger.warning("lease lost run=%s token=%s", beat.claim.run_id, beat.claim.token)
                with self._lock:
                    self._beats.discard(beat)


_the_renewer: _Renewer | None = None
_renewer_lock = threading.Lock()


def _renewer() -> _Renewer:
    """The process's renewer: a new one in a forked child, and in place of one whose thread died (its leases kept)."""
    global _the_renewer
    if not _serving(_the_renewer):
        with _renewer_lock:
            if not _serving(_the_renewer):
                dead = _the_renewer if _the_renewer is not None and _the_renewer.pid == os.getpid() else None
                _the_renewer = _Renewer(dead)
    return _the_renewer


def _serving(renewer: _Renewer | None) -> bool:
    return renewer is not None and renewer.pid == os.getpid() and renewer._thread.is_alive()
