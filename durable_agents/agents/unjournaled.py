"""Billed usage no Turn row holds: a model answer that was not journaled still counts against its run.

A zombie's answer (its lease lost, or the turn journaled by another worker) and an answer the database would not
take (the journaling write failed, and so did its one retry on a fresh connection) were billed all the same. Their
tokens and cost are added to the run's and the step's counters — what `Run.cost_usd` and the budgets read — with an
`unjournaled_usage` event, in one short transaction of their own.

What is guaranteed, exactly:

* recorded in the database once, if it takes that transaction on this thread's connection, or on a fresh one;
* otherwise an ERROR line on the `durable_agents.engine` logger gives the run, step, turn, the four token counts and
  the cost, and this process keeps the figure (`owed()`) and records it after its next journal write or count that
  succeeds. Lost from the database only if the process ends before that (the ERROR line stays);
* never twice: a journaling write whose COMMIT failed may have committed, so before it is counted (or written
  again) the Turn it would have written is looked up — same step and index, same request id, request digest and
  content. Only a participant with no request ids that answered two writers the same, word for word, could make
  another's Turn look like the lost one; then the usage is taken as journaled.

What no process can count: a worker killed (SIGKILL, OOM) between the answer and its record. The turn is asked
again when the step is re-executed, and that answer is journaled and counted; the lost one is not.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import F

from durable_agents.agents.messages import Usage
from durable_agents.connections import drop_connections, fresh_connection
from durable_agents.engine.events import record_event
from durable_agents.models import Run, Step, Turn

logger = logging.getLogger("durable_agents.engine")


@dataclass(frozen=True)
class Unjournaled:
    """One billed answer its Turn row may not hold: where it was asked, what it cost, and why it is counted here.

    `maybe_journaled`: a write of it may have committed (its COMMIT failed); the identity fields tell its Turn.
    """

    run_id: uuid.UUID
    step_pk: int
    step_id: str
    index: int | None
    usage: Usage
    cost: Decimal
    reason: str
    maybe_journaled: bool = False
    request_id: str = ""
    request_digest: str = ""
    content: list[dict[str, Any]] = field(default_factory=list)

    def numbers(self) -> str:
        usage = self.usage
        return (
            f"input_tokens={usage.input_tokens} output_tokens={usage.output_tokens} "
            f"cache_write_tokens={usage.cache_write_tokens} cache_read_tokens={usage.cache_read_tokens} "
            f"cost_usd={self.cost}"
        )


_owed: list[Unjournaled] = []
_owed_lock = threading.Lock()


def usage_counters(usage: Usage) -> dict[str, Any]:
    """F-expression updates that add one call's usage to a Run's or Step's counters."""
    return {
        "input_tokens": F("input_tokens") + usage.input_tokens,
        "output_tokens": F("output_tokens") + usage.output_tokens,
        "cache_write_tokens": F("cache_write_tokens") + usage.cache_write_tokens,
        "cache_read_tokens": F("cache_read_tokens") + usage.cache_read_tokens,
    }


def landed_turn(billed: Unjournaled) -> Turn | None:
    """The Turn a write of `billed` committed although its COMMIT failed; None if there is none."""
    if billed.index is None:
        return None
    turn = Turn.objects.filter(step_id=billed.step_pk, index=billed.index).first()
    if turn is None or (turn.request_id, turn.request_digest) != (billed.request_id, billed.request_digest):
        return None
    return turn if turn.content == billed.content else None


def count_unjournaled(billed: Unjournaled) -> None:
    """Add `billed` to its run's and step's counters, with an `unjournaled_usage` event. Never raises a database
    error: if neither this connection nor a fresh one takes it, it is logged at ERROR and owed (module docstring).
    """
    error: DatabaseError | None = None
    # A connection the failed write left dead is no chance: a statement in autocommit (the journal's, on Postgres)
    # leaves it on this thread, where a transaction's failed rollback would have closed it. Dropped first, so both
    # attempts reach the database.
    drop_connections()
    for fresh in (False, True):
        if fresh and not fresh_connection():
            break
        try:
            _record(billed, late=False)
        except DatabaseError as exc:
            error = exc
            continue
        record_owed()
        return
    _owe(billed, error)


def owed() -> tuple[Unjournaled, ...]:
    """Billed usage this process could not record yet (the database refused it); recorded by `record_owed`."""
    with _owed_lock:
        return tuple(_owed)


def record_owed() -> None:
    """Record the usage this process owes, now that the database takes writes again (called after each journal
    write and count that succeeded). What it still refuses stays owed."""
    if not _owed:
        return
    with _owed_lock:
        pending = list(_owed)
        _owed.clear()
    for position, billed in enumerate(pending):
        try:
            _record(billed, late=True)
        except DatabaseError:
            with _owed_lock:
                _owed[:0] = pending[position:]
            return
        logger.warning(
            "billed usage recorded late: run %s step %s turn %s (%s) %s",
            billed.run_id,
            billed.step_id,
            billed.index,
            billed.reason,
            billed.numbers(),
        )


def _record(billed: Unjournaled, *, late: bool) -> None:
    counters = usage_counters(billed.usage)
    with transaction.atomic():
        if billed.maybe_journaled and landed_turn(billed) is not None:
            return  # the write whose COMMIT failed committed: its Turn holds this usage, counted with it
        if not Run.objects.filter(pk=billed.run_id).update(cost_usd=F("cost_usd") + billed.cost, **counters):
            return  # the run was deleted meanwhile (retention): nothing is left to count against
        Step.objects.filter(pk=billed.step_pk).update(cost_usd=F("cost_usd") + billed.cost, **counters)
        detail: dict[str, Any] = {"late": True} if late else {}
        record_event(
            billed.run_id,
            "unjournaled_usage",
            step_id=billed.step_id,
            turn=billed.index,
            reason=billed.reason,
            tokens=billed.usage.total_tokens,
            cost_usd=str(billed.cost),
            **detail,
        )


def _owe(billed: Unjournaled, error: DatabaseError | None) -> None:
    logger.error(
        "billed usage not recorded: run %s step %s turn %s (%s) %s; the database refused it (%s), so this process "
        "records it after its next journal write that succeeds",
        billed.run_id,
        billed.step_id,
        billed.index,
        billed.reason,
        billed.numbers(),
        f"{type(error).__name__}: {error}" if error is not None else "inside a transaction that cannot reconnect",
    )
    with _owed_lock:
        _owed.append(billed)
