"""Concurrency keys: at most `concurrency_limit` runs with one key hold it at a time; the rest wait in order.

A run started with a key is inserted pending and *not admitted* (`admitted_at` NULL): no claim takes it
(hotpath's claimable rule), the sweep does not wake it, it holds no worker and no lease. It holds the key from
its admission to its terminal status (completed, failed, cancelled) — waits for a human or a timer included:
"at most one running run per customer" means one run in flight, not one step at a time.

Admission (`admit`) is one short transaction per key, serialised across workers by a transaction-scoped advisory
lock on the key (Postgres): it counts the key's holders (admitted, not finished) in a statement that starts after
the lock is taken — so it sees every admission committed before it — and admits the oldest queued runs
(created_at, id) up to the limit of the queue's head, waking them on commit. Two holders finishing at once, a start
racing a finish, a duplicate hand-off: each admits under the lock, the second sees the first's admissions.

Hand-offs run after the transition that frees a slot has committed (`admit_on_commit`), never inside it: the
admission updates queued rows, and a transaction that holds a run's row lock must not then wait for the key's lock
(a deadlock with an admission waiting for that row). A crash between the commit and the hand-off loses nothing:
the sweep admits every key with a queued run (`admit_waiting`). A run taken back from a terminal status (resume,
rerun) queues again for its key (transitions clear `admitted_at`), at its original place in the order.

Families hold one slot. A child run takes its workflow's key (computed from its input), else its parent's; a child
whose ancestor holds the child's key runs in that ancestor's slot (`slot_of`): admitted at once, before the queue (a
parent waiting on children queued behind itself would wait for ever), and not counted as a slot of its own while the
ancestor holds it. A child that outlives that ancestor (a cancel that has not reached it yet) holds the key in its
own right until it ends: the key is never free while any run of the family works under it. Two families that each
hold the key the other's children wait for wait for each other: the engine does not break that
(docs/howto/concurrency-keys.md).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from django.db import connection, transaction
from django.db.models import Count, F, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce

from durable_agents.clock import DbNow
from durable_agents.engine.events import record_event
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import InvalidInputError
from durable_agents.models import ACTIVE_RUN_STATUSES, QUEUED, QUEUED_KEYED, Run
from durable_agents.storable import check_text
from durable_agents.workflows import MAX_CONCURRENCY_LIMIT, Workflow

logger = logging.getLogger("durable_agents.engine")

# The advisory lock's first key: concurrency keys share a namespace of their own (hashtext of the key is the second).
LOCK_SPACE = "durable_agents.concurrency_key"


def holding(key: str) -> Q:
    """The runs that hold a slot of `key`: admitted and not finished (children in their parent's slot included)."""
    return Q(concurrency_key=key, admitted_at__isnull=False, status__in=ACTIVE_RUN_STATUSES)


# A run whose family holds a slot of the run's own key runs in that slot (`slot_of`: the ancestor holding it, set when
# the run is started): a family holds one slot, however many of its runs are live, at any depth (a parent waiting on
# children, or grandchildren, queued behind itself would wait for ever).
IN_FAMILY_SLOT = Q(
    slot_of__concurrency_key=F("concurrency_key"),
    slot_of__admitted_at__isnull=False,
    slot_of__status__in=ACTIVE_RUN_STATUSES,
)


def slots_held(key: str) -> int:
    """How many slots of `key` are taken: its holders, less those in a slot their family holds."""
    return Run.objects.filter(holding(key)).exclude(IN_FAMILY_SLOT).count()


def _lock_key_txn(key: str) -> None:
    """Serialise admissions of one key until this transaction ends."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s), hashtext(%s))", [LOCK_SPACE, key])
        else:
            # SQLite serialises writers: a write first takes the database's write lock for the whole transaction.
            cursor.execute(f"UPDATE {Run._meta.db_table} SET admitted_at = admitted_at WHERE 1 = 0")


def admit(key: str) -> list[uuid.UUID]:
    """Admit the oldest runs queued on `key` while the key has free slots; their ids (woken on commit).

    Safe to call any number of times, concurrently, from any process: a call with nothing to admit writes
    nothing. Call it outside any transaction that holds a run's row lock (see the module docstring).
    """
    with transaction.atomic():
        _lock_key_txn(key)
        # Statements after the lock: their snapshots include every admission and finish committed before it.
        queue = Run.objects.filter(QUEUED, concurrency_key=key, cancel_requested_at__isnull=True)
        admitted = _admit_in_family_slots(queue, key)
        held = slots_held(key)
        queue = queue.order_by("created_at", "id")
        head = queue.values_list("concurrency_limit", flat=True).first()
        if head is None or held >= head:
            return admitted
        for run_id in list(queue.values_list("id", flat=True)[: head - held]):
            # Re-checked row by row: a run cancelled since the queue was read is not admitted (its slot waits for
            # the cancel's own hand-off, which runs after the cancel commits).
            if Run.objects.filter(QUEUED_KEYED, pk=run_id, cancel_requested_at__isnull=True).update(
                admitted_at=DbNow(),
                updated_at=DbNow(),  # its wake-up goes now: the sweep and health count from here
            ):
                admitted.append(run_id)
                held += 1
                record_event(run_id, "admitted", concurrency_key=key, holders=held, limit=head)
                wake_on_commit(run_id)
        # A family admitted just now (a resumed parent) takes its queued children into its slot at once.
        admitted += _admit_in_family_slots(queue, key)
    return admitted


def _admit_in_family_slots(queue: Any, key: str) -> list[uuid.UUID]:
    admitted: list[uuid.UUID] = []
    if not queue.filter(slot_of__isnull=False).exists():
        # No queued run of the key belongs to a family (a replay's runs, most keys): no join to make. The join
        # below is planned for a key the statistics have not seen yet (a new replay's) as a nested loop over queue
        # × holders: half a second a call with 1,600 queued behind 100, under the key's lock.
        return admitted
    for run_id in list(queue.filter(IN_FAMILY_SLOT).values_list("id", flat=True)):
        if Run.objects.filter(QUEUED_KEYED, pk=run_id, cancel_requested_at__isnull=True).update(
            admitted_at=DbNow(),
            updated_at=DbNow(),  # its wake-up goes now: the sweep and health count from here
        ):
            admitted.append(run_id)
            record_event(run_id, "admitted", concurrency_key=key, in_family_slot=True)
            wake_on_commit(run_id)
    return admitted


def admit_on_commit(key: str | None) -> None:
    """After the current transaction commits (now, outside one): hand a freed slot of `key` on. None: no key."""
    if key is not None:
        transaction.on_commit(lambda: _hand_on(key))


def _hand_on(key: str) -> None:
    # The transition that freed the slot has committed: a failing hand-off must not be mistaken for the
    # transition's failure (the caller would try to fail a finished run). The sweep admits the key later.
    try:
        admit(key)
    except Exception:  # noqa: BLE001 - the database has the queue; the sweep is the fallback
        logger.warning("could not admit the next run of concurrency key %r now; the sweep will", key, exc_info=True)


def key_of(run_id: Any) -> str | None:
    """The run's concurrency key (one query), for a hand-off whose caller did not load it."""
    return Run.objects.filter(pk=run_id).values_list("concurrency_key", flat=True).first()


def admit_waiting(limit: int) -> int:
    """The sweep's pass: admit on every key with a queued run (a hand-off lost to a crash); how many admitted."""
    # Only keys with a free slot: a key whose queue is full is not locked again on every pass.
    held = (
        Run.objects.filter(concurrency_key=OuterRef("concurrency_key"), admitted_at__isnull=False)
        .filter(status__in=ACTIVE_RUN_STATUSES)
        .exclude(IN_FAMILY_SLOT)
        .order_by()
        .values("concurrency_key")
        .annotate(n=Count("*"))
        .values("n")
    )
    keys = (
        Run.objects.filter(QUEUED, cancel_requested_at__isnull=True)
        .alias(held=Coalesce(Subquery(held), 0))
        .filter(Q(held__lt=F("concurrency_limit")) | IN_FAMILY_SLOT)
        .order_by()
        .values_list("concurrency_key", flat=True)
        .distinct()[:limit]
    )
    return sum(len(admit(key)) for key in list(keys) if key is not None)


def queue_position(run: Run) -> int | None:
    """1 for the next run of its key to be admitted, 2 for the one after...; None if the run is not queued."""
    if not run.is_queued:
        return None
    ahead = (
        Run.objects.filter(QUEUED, concurrency_key=run.concurrency_key)
        .filter(Q(created_at__lt=run.created_at) | Q(created_at=run.created_at, id__lt=run.id))
        .exclude(pk=run.pk)  # SQLite compares its stored times as text: never count the run itself
    )
    return ahead.count() + 1


def holders(key: str) -> list[uuid.UUID]:
    """The runs that hold a slot of `key` now, oldest admission first."""
    return list(Run.objects.filter(holding(key)).order_by("admitted_at", "id").values_list("id", flat=True))


KEY_MAX_CHARS = 255  # Run.concurrency_key


def concurrency_of(definition: Workflow, run_input: Any, key: str | None, limit: int | None) -> tuple[str | None, int]:
    """The run's concurrency key and limit: the caller's, else the workflow's (its key computed from the input)."""
    if limit is not None and (
        not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_CONCURRENCY_LIMIT
    ):
        raise InvalidInputError(
            f"the concurrency limit must be an integer from 1 to {MAX_CONCURRENCY_LIMIT}, got {limit!r}"
        )
    if key is None and definition.concurrency_key is not None:
        try:
            key = definition.concurrency_key(run_input)
        except Exception as exc:  # noqa: BLE001 - the user's function on the user's input: a clear input error
            raise InvalidInputError(
                f"workflow {definition.name!r}: its concurrency_key could not be computed from this input "
                f"({type(exc).__name__}: {exc}); fix the input or the function"
            ) from exc
        if isinstance(key, int) and not isinstance(key, bool):
            key = str(key)
    if key is not None:
        check_text(key, "the concurrency key", max_chars=KEY_MAX_CHARS)
        if not key.strip():
            raise InvalidInputError("the concurrency key must not be blank; give none for a run without one")
    return key, limit if limit is not None else definition.concurrency_limit
