"""Deleting finished runs in small batches, each archived first if asked; never a live run, never one relied on.

A batch is chosen without locks — a page of old-enough runs in id order (the run table alone), then checked by
id against what keeps a run (below) — archived (outside any transaction: a storage write may take seconds), then
deleted in ONE short transaction that locks its runs with `FOR UPDATE SKIP LOCKED` and checks each is still
prunable and unchanged since it was archived. Children go first, table by table, in explicit `DELETE ... WHERE
run_id IN (...)` statements (no ORM cascade collecting rows in Python, no one huge cascade): the lock is held
for a few statements over a few hundred runs. A run the engine or an operator holds is skipped, not waited for;
a run that changed after it was archived (resumed, an event added) is kept for the next pass.

Kept, whatever its age:
* a run that is not finished (pending, running, waiting) — only completed, failed and cancelled runs go;
* a run some fork still points at (`forked_from`): the fork shares its effect keys (effect_scope), and those
  keys live in the source's Effect rows — deleting them would let the fork apply the effect again;
* a run one of whose effects another run relies on (Reliance) or another run's effect compensates;
* a run with an effect pending or waiting for an operator (`needs_attention`): nothing fails silently;
* a parent with child runs left (they point at it), and a child whose parent is not finished and due itself
  (its join reads the children's rows; a rerun of its fan-out step finds its children by their key).
The source becomes prunable once its forks are gone, a parent once its children are (the next pass takes it).
A parent held by someone else while its children go is passed by, and may be rerun from its fan-out step before
the next pass: that step then fails, saying its children were pruned, rather than start them again.

Crash between archive and delete: the runs stay, and the next pass archives them again (maybe in another batch
file); an archive is named by its batch's run ids (range, count and a digest of them all) and rewritten whole,
so readers dedupe by run id.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Exists, Max, OuterRef, Q, QuerySet, Subquery

from durable_agents.display import when_text
from durable_agents.engine.archive import write_archive
from durable_agents.engine.job_lease import JobLeaseHeld
from durable_agents.models import Effect, EffectStatus, Event, Payload, Reliance, Run, Step, Turn, Wait
from durable_agents.states import FINISHED_RUN_STATUSES

logger = logging.getLogger("durable_agents.engine")

# One pass at a time across every machine (beat may start a pass while the last one still runs, cron another): the
# pass holds the job lease "prune" (engine/job_lease.py), renewed while it runs. A pass that died leaves it to lapse:
# the next pass takes over at most this long after. The lease spares the database a second pass; it does not guard
# the deletes: two passes side by side (one held up past its lease) lock their batches SKIP LOCKED and re-check them.
PRUNE_JOB = "prune"
PRUNE_LEASE_SECONDS = 60.0

# What a run looked like when it was archived: its updated_at and its newest event, effect and wait.
Fingerprint = tuple[Any, ...]


@dataclass
class PruneReport:
    """What one pass did (or, with dry_run, would do): counts, and the archives it wrote."""

    dry_run: bool = False
    selected: int = 0
    deleted: int = 0
    skipped: int = 0  # locked by someone else, or changed after it was archived: kept for the next pass
    batches: int = 0
    archives: list[str] = field(default_factory=list)
    busy: bool = False  # another pass held the prune's lease: this pass did nothing
    held_by: str = ""  # busy: the pass that held it ("<worker or host>:<pid>")
    held_until: datetime | None = None  # busy: when its lease runs out unless renewed (the database's clock)
    lost: bool = False  # another pass took the lease over (this one was held up past its expiry): stopped
    rested: float = 0.0  # seconds rested between batches (the pace: RETENTION_PAUSE_SECONDS, RETENTION_DUTY_CYCLE)
    stopped: bool = False  # the pass reached its time limit (stop_after) with runs perhaps left to prune
    counts: dict[str, int] = field(default_factory=dict)  # dry run: "workflow/status" -> runs that would go

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "selected": self.selected,
            "deleted": self.deleted,
            "skipped": self.skipped,
            "batches": self.batches,
            "archives": list(self.archives),
            "busy": self.busy,
            "held_by": self.held_by,
            "held_until": None if self.held_until is None else self.held_until.isoformat(),
            "lost": self.lost,
            "rested": round(self.rested, 3),
            "stopped": self.stopped,
            "counts": dict(self.counts),
        }


def old_enough(eligible: Q) -> QuerySet[Run]:
    """Finished runs matching `eligible`: the candidates, read cheaply (the run table alone) before `prunable`."""
    return Run.objects.filter(status__in=FINISHED_RUN_STATUSES).filter(eligible)


def prunable(eligible: Q) -> QuerySet[Run]:
    """Finished runs matching `eligible` (the retention policy's ages) that nothing else needs (see above)."""
    others_relying = Reliance.objects.filter(effect__run=OuterRef("pk")).exclude(run=OuterRef("pk"))
    others_compensating = Effect.objects.filter(compensates__run=OuterRef("pk")).exclude(run=OuterRef("pk"))
    unsettled = Effect.objects.filter(run=OuterRef("pk")).filter(
        Q(status=EffectStatus.PENDING) | ~Q(needs_attention="")
    )
    parent_due = old_enough(eligible).filter(pk=OuterRef("parent"))
    return (
        old_enough(eligible)
        .exclude(Exists(Run.objects.filter(forked_from=OuterRef("pk"))))
        .exclude(Exists(Run.objects.filter(parent=OuterRef("pk"))))
        # A family goes together: a child only once its parent is finished and due itself.
        .exclude(Q(parent__isnull=False) & ~Exists(parent_due))
        .exclude(Exists(others_relying))
        .exclude(Exists(others_compensating))
        .exclude(Exists(unsettled))
    )


def _with_fingerprint(runs: QuerySet[Run]) -> QuerySet[Run]:
    """The run's last change, and its children's: a run whose fingerprint moved after it was archived is kept."""

    def newest(model: Any, column: str) -> Subquery:
        return Subquery(
            model.objects.filter(run=OuterRef("pk")).order_by().values("run").annotate(m=Max(column)).values("m")[:1]
        )

    return runs.annotate(
        last_event=newest(Event, "id"), last_effect=newest(Effect, "updated_at"), last_wait=newest(Wait, "updated_at")
    )


def _fingerprints(runs: QuerySet[Run]) -> dict[uuid.UUID, Fingerprint]:
    rows = _with_fingerprint(runs).values_list("id", "updated_at", "last_event", "last_effect", "last_wait")
    return {row[0]: tuple(row[1:]) for row in rows}


def prune(
    eligible: Q,
    *,
    batch_size: int,
    archive: str | None = None,
    dry_run: bool = False,
    pause_seconds: float = 0.0,
    duty_cycle: float = 1.0,
    stop_after: float | None = None,
    start_at: uuid.UUID | None = None,
    name_archive: Callable[[list[uuid.UUID]], str] | None = None,
) -> PruneReport:
    """Delete every prunable run matching `eligible`, `batch_size` runs per transaction, archiving each batch to
    the storage alias `archive` first (if given). `dry_run` counts what would go and changes nothing.

    After each page (a batch, or a page of runs it must keep) the pass rests `rest_after(...)`: at least
    `pause_seconds`, and long enough that its work takes at most `duty_cycle` of the wall clock (see `rest_after`).
    With `stop_after` (seconds) the pass starts no batch once that long has passed, nor rests into that time, and
    says so (`report.stopped`). `start_at` (a run id) begins the pass there and goes round to it (retention
    passes a random one to a windowed pass: see `window_start`)."""
    report = PruneReport(dry_run=dry_run)
    if dry_run:
        # One query, counted by workflow and status (the whole table at once: a dry run is read-only and rare).
        rows = prunable(eligible).values("workflow", "status").annotate(n=Count("id")).order_by()
        report.counts = {f"{row['workflow']}/{row['status']}": row["n"] for row in rows}
        report.selected = sum(report.counts.values())
        return report
    with JobLeaseHeld(PRUNE_JOB, seconds=PRUNE_LEASE_SECONDS) as lease:
        if lease.holder is not None:
            report.busy, report.held_by, report.held_until = True, lease.holder.holder, lease.holder.until
            logger.warning(
                "prune: another pass holds the lease: %s, until %s; this pass did nothing",
                report.held_by,
                when_text(report.held_until) or "now",
            )
            return report
        # Keyset order by id, from `start_at` round to it: a run skipped in this pass is behind the next batch,
        # never chosen again in it. A windowed pass starts at a point of its own (`window_start`): passes that
        # all began at the smallest id would each stop in the same stretch of runs it must keep, and never reach
        # the runs behind it.
        after, wrapped = start_at, start_at is None
        started = time.monotonic()
        while True:
            if not lease.renew():
                # Held up past the lease's expiry, and another pass took it over: that pass goes on from here.
                report.lost = report.stopped = True
                logger.warning("prune: this pass lost its lease to another pass; it stopped, the other goes on")
                return report
            if stop_after is not None and time.monotonic() - started >= stop_after:
                report.stopped = True
                return report
            candidates = old_enough(eligible).order_by("id")
            if after is not None:
                candidates = candidates.filter(id__gt=after)
            if wrapped and start_at is not None:
                candidates = candidates.filter(id__lte=start_at)
            began = time.monotonic()
            page = list(candidates.values_list("id", flat=True)[:batch_size])
            if not page:
                if wrapped:
                    return report
                after, wrapped = None, True  # round from the smallest id to where this pass began
                continue
            after = page[-1]
            # Checked by id: the planner probes each run's forks, children, reliances and effects by index. Asked
            # of the whole table with a LIMIT, it anti-joined the effect table (13 s a batch at 1 M runs).
            chosen = _fingerprints(prunable(eligible).filter(id__in=page))
            # An empty `chosen` is a page of runs that must be kept (relied on, a fork's source...): the next page.
            if chosen:
                _delete_chosen(chosen, eligible, report, archive, name_archive)
            # A page read and checked is work on the database even if nothing went: it is rested after too, or a
            # table of old runs that must be kept (children of a parent kept for ever) is scanned flat out.
            rest = rest_after(time.monotonic() - began, pause_seconds, duty_cycle)
            if stop_after is not None and time.monotonic() - started + rest >= stop_after:
                # The rest would carry the pass past its window (at a duty cycle of 0.01 it is 99x the batch), and
                # no batch starts after it: stop now, not once the window is over, still holding the lease.
                report.stopped = True
                return report
            report.rested += rest
            if rest:
                _sleep(rest)


def _delete_chosen(
    chosen: dict[uuid.UUID, Fingerprint],
    eligible: Q,
    report: PruneReport,
    archive: str | None,
    name_archive: Callable[[list[uuid.UUID]], str] | None,
) -> None:
    """One batch: archived (if asked), then deleted in one transaction; counted in `report`."""
    ids = sorted(chosen)
    report.selected += len(ids)
    report.batches += 1
    if archive:
        report.archives.append(write_archive(archive, (name_archive or archive_name)(ids), ids))
    try:
        deleted = delete_batch(chosen, eligible)
    except IntegrityError:
        # A product table points at one of these runs with a foreign key of its own: the whole batch is kept
        # (rolled back), this pass goes on with the next one; the log and `skipped` say so.
        logger.warning("prune: a batch of %d runs is referenced by other rows and was kept", len(ids))
        deleted = []
    report.deleted += len(deleted)
    report.skipped += len(ids) - len(deleted)


def window_start() -> uuid.UUID:
    """Where a windowed pass begins in the id order: anywhere, so the windows of many passes cover the table."""
    return uuid.uuid4()


def rest_after(worked: float, pause_seconds: float, duty_cycle: float) -> float:
    """The rest after a batch that took `worked` seconds: `pause_seconds`, or more if the pass's share of the
    wall clock would otherwise exceed `duty_cycle` (1.0: no such limit).

    The batch's own time is the measure: on a busy database a batch takes longer and the pass rests longer, so
    its share of the database stays near `duty_cycle` on any machine, however slow. E.g. a batch of 0.3 s at a
    duty cycle of 0.1 rests 2.7 s.
    """
    return max(pause_seconds, worked * (1 - duty_cycle) / duty_cycle)


_sleep = time.sleep  # the rest between batches (a test replaces it to see the rests without taking them)


def archive_name(ids: list[uuid.UUID]) -> str:
    """A batch's archive: named by its first and last run id and a digest of every id in it, so writing the same
    batch again replaces it, and a later batch with the same ends and size (a run between them deleted, another
    come due) never replaces the archive of a run already deleted."""
    first, last = str(ids[0]), str(ids[-1])
    digest = hashlib.sha256(b"".join(run_id.bytes for run_id in sorted(ids))).hexdigest()[:16]
    return f"durable_agents/archive/{first[:2]}/{first}--{last}--{len(ids)}--{digest}.jsonl.gz"


def delete_batch(chosen: dict[uuid.UUID, Fingerprint], eligible: Q) -> list[uuid.UUID]:
    """Delete those of `chosen` that are still prunable and unchanged; returns their ids. One short transaction."""
    with transaction.atomic():
        locked = (
            Run.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(id__in=list(chosen))
            .order_by()
            .values_list("id", flat=True)
        )
        # Locked first (a plain SELECT ... FOR UPDATE cannot carry the aggregates), then checked under the lock.
        held = list(locked)
        still = _fingerprints(prunable(eligible).filter(id__in=held))
        ids = sorted(run_id for run_id, fingerprint in still.items() if fingerprint == chosen[run_id])
        if ids:
            _delete_rows_txn(ids)
        return ids


def _delete_rows_txn(ids: list[uuid.UUID]) -> None:
    """Children table by table, then the runs: each statement touches only these runs' rows."""
    assert connection.in_atomic_block, "_delete_rows_txn must run inside the batch's transaction"
    quote = connection.ops.quote_name
    values = [Run._meta.pk.get_db_prep_value(run_id, connection) for run_id in ids]
    marks = ", ".join(["%s"] * len(values))
    effect = quote(Effect._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"DELETE FROM {quote(Reliance._meta.db_table)} WHERE run_id IN ({marks}) "
            f"OR effect_id IN (SELECT id FROM {effect} WHERE run_id IN ({marks}))",
            values + values,
        )
        for model in (Turn, Effect, Wait, Event, Payload, Step, Run):
            column = "id" if model is Run else "run_id"
            cursor.execute(f"DELETE FROM {quote(model._meta.db_table)} WHERE {column} IN ({marks})", values)
