"""Child runs: a fan-out step starts them, parks, and is woken once its join is met; cancelling a parent stops them.

A child's key is (parent, parent step, index), a named unique constraint: a step re-executed after a crash
between starting children and parking finds the children it started and starts only the missing ones.
The parent holds no worker while it waits: it parks on a `children` wait. A child reaching a terminal status
(any path: its last commit, a failure, a cancel) sends `run_finished` after its commit; the receiver locks the
parent's row and, if the join is met, closes the wait and wakes the parent in one transaction. Two children
finishing at once serialise on that lock: one closes the wait, the other finds it closed. A child that
finishes while its parent is parking is seen by the park itself (`join_if_ready_txn`, under the same lock).
A wake lost to a crash after a child's commit is found by the sweep (`sweep_children`), which re-checks each
open join at most once per IDLE_RESWEEP_SECONDS, and cancels the live children of cancelled parents.

A parent's compensation is its family's (`Run.family_undo`, set with the saga): live children are cancelled with
compensation, and children that had already ended undo what they applied in a saga of their own from their end
(`undo_finished`) — at the cancel, at a child's end after it, at the parent's end, and by the sweep after a crash.
Resuming a cancelled parent brings back the children its cancellation reached (`resume_family`).

Statuses move only through `transitions` and `runs.cancel_run`.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Q

from durable_agents import clock, tracing
from durable_agents.clock import DbNow
from durable_agents.conf import settings
from durable_agents.engine import transitions
from durable_agents.engine.admission import admit_on_commit, concurrency_of
from durable_agents.engine.events import record_event
from durable_agents.engine.payloads import check_input
from durable_agents.engine.records import get_run, locked, plan_row
from durable_agents.engine.runs import cancel_run, resume_run
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import (
    DefinitionError,
    InvalidInputError,
    InvalidTransitionError,
    LeaseLostError,
    PermanentError,
    UnknownWorkflowError,
)
from durable_agents.models import Event, Run, Step, StepKind, Wait, WaitKind
from durable_agents.signals import run_finished, send_on_commit, wait_closed
from durable_agents.states import ACTIVE_RUN_STATUSES, FINISHED_RUN_STATUSES, RunStatus, WaitOp, WaitStatus
from durable_agents.workflows import Workflow, registry

logger = logging.getLogger("durable_agents.engine")

CHILD_CONSTRAINT = "durable_run_child_uniq"
INSERT_CHUNK = 500  # children inserted per statement pair (runs, then their plan rows)
FAILED_STATUSES = (RunStatus.FAILED, RunStatus.CANCELLED)


@dataclass(frozen=True)
class Join:
    """When a fan-out is done waiting: `need` children completed (None: all of them); `fail_fast`: the first
    child that fails (or is cancelled) ends the wait."""

    need: int | None = None
    fail_fast: bool = True

    def needed(self, total: int) -> int:
        return total if self.need is None else min(self.need, total)


@dataclass(frozen=True)
class Tally:
    """A fan-out's children by outcome."""

    total: int = 0
    completed: int = 0
    failed: int = 0  # failed or cancelled
    active: int = 0


def is_ready(join: Join, tally: Tally) -> bool:
    """True once waiting longer cannot change the step's outcome."""
    # Collecting, a join that can no longer be met still waits for every outcome; failing fast, it cannot get there.
    return tally.completed >= join.needed(tally.total) or tally.active == 0 or (join.fail_fast and tally.failed > 0)


def spawn(parent: Run, step: Step, workflow: str, inputs: Sequence[Any], *, lease_token: int | None = None) -> int:
    """Start the children of `step` that do not exist yet (one per input, by index); how many were started.

    `lease_token`: the execution's; the children are inserted only while it still holds the parent.
    Called by the step on every execution: children started by an earlier execution (or a zombie) are found by
    their key and never started twice, and the list is the one they were started from: items added to it since are
    recorded (`children_list_grew`), not started; a list changed in front is refused. Bad input for a child is an
    InvalidInputError naming its index.
    """
    definition = registry.get(workflow)
    for _ in range(3):
        started = dict(children_of(parent.id, step.step_id).values_list("child_index", "input_hash"))
        _refuse_a_changed_list(step, started, inputs)
        existing = set(started)
        missing = [i for i in range(len(inputs)) if i not in existing]
        if not missing:
            return 0
        _refuse_restarting_pruned(parent, step, len(existing))
        if existing:
            # All of a list's children are started in one transaction: a longer list now is one that grew since
            # (a live query read again when the step re-executes). Starting the newcomers, a list that keeps growing
            # would keep its parent waiting for ever; the list is the one the children were started from.
            record_event(
                parent.id, "children_list_grew", step_id=step.step_id, started=len(existing), not_started=len(missing)
            )
            return 0
        runs: list[Run] = []
        rows: list[Step] = []
        traced: list[tracing.Span] = []
        scopes = _scopes_of_source_children(parent, step)
        slots: dict[str, Any] = {}
        for index in missing:
            child_input = {} if inputs[index] is None else inputs[index]
            input_hash = check_input(child_input, f"child {index}'s input")
            try:
                plan = definition.build_plan(child_input)
                key, limit = _key_of_child(parent, definition, child_input)
                if key is not None and key not in slots:
                    slots[key] = _slot_holder(parent, key)
            except InvalidInputError as exc:
                raise InvalidInputError(f"child {index} of step {step.step_id!r}: {exc}") from exc
            child = Run(
                workflow=definition.name,
                workflow_version=definition.version,
                input=child_input,
                input_hash=input_hash,
                step_count=len(plan),
                parent_id=parent.id,
                parent_step=step.step_id,
                child_index=index,
                concurrency_key=key,
                concurrency_limit=limit,
                effect_scope=scopes[input_hash].pop(0) if scopes.get(input_hash) else "",
                slot_of_id=slots.get(key) if key is not None else None,
                search=definition.search_attributes(child_input),
            )
            # In its parent's trace: the child's span is a child of the step that starts it.
            traced.append(tracing.start_run(definition.name, definition.version, child.id))
            child.trace_context = traced[-1].traceparent
            runs.append(child)
            rows.extend(plan_row(child.id, definition, element, position) for position, element in enumerate(plan))
        try:
            with transaction.atomic():
                if lease_token is not None and not transitions.holds_txn(parent.id, lease_token):
                    # A worker paused past its lease (after its last proof) starts nothing for a run another worker,
                    # or an operator's cancel, now holds: its children would escape that cancel's compensation.
                    raise LeaseLostError(f"run {parent.id} is no longer held by token {lease_token}; no child started")
                _insert(runs, rows)
                for span in traced:
                    tracing.end_on_commit(span)
                # With the children, never without: the count a re-execution checks after a prune (above).
                record_event(parent.id, "children_started", step_id=step.step_id, count=len(runs), workflow=workflow)
        except IntegrityError as exc:
            if CHILD_CONSTRAINT not in str(exc):
                raise
            continue  # another execution of this step (a zombie) started some of them: look again
        return len(runs)
    raise InvalidTransitionError(f"children of step {step.step_id!r} are being started elsewhere; retry")


def _scopes_of_source_children(parent: Run, step: Step) -> dict[str, list[str]]:
    """A fork that shares its source's effect keys (the same input: `effect_scope`) starts its fan-out's children
    sharing the keys of its source's children with the same input, so what they applied is reused, not applied
    again (a fork at a fan-out step would otherwise charge every child's order twice). Matched by input, in index
    order, not by index: a live list that gained an item in front shifted every old item. Not the keys of a child
    whose saga undid its effects. {input hash: [scope, ...]} of the oldest source with children at that step."""
    if not parent.effect_scope:
        return {}
    try:
        origin = Q(pk=uuid.UUID(parent.effect_scope))
    except ValueError:
        origin = Q()
    sources = Run.objects.filter(origin | Q(effect_scope=parent.effect_scope)).exclude(pk=parent.id)
    children = Run.objects.filter(parent__in=sources, parent_step=step.step_id, finish_as="")
    rows = children.order_by("parent__created_at", "parent_id", "child_index")
    scopes: dict[str, list[str]] = defaultdict(list)
    first = None
    for source_id, input_hash, scope, child_id in rows.values_list("parent_id", "input_hash", "effect_scope", "id"):
        first = first or source_id
        if source_id == first:
            scopes[input_hash].append(scope or str(child_id))
    return scopes


def _slot_holder(parent: Run, key: str) -> Any:
    """The nearest of `parent` and its ancestors with `key` (the run whose slot a child of that key runs in), or
    None. A family is a few generations deep: one read per generation, once per key of a fan-out."""
    run_id: Any = parent.id
    while run_id is not None:
        row = Run.objects.filter(pk=run_id).values_list("concurrency_key", "slot_of_id", "parent_id").first()
        if row is None:
            return None
        own_key, slot_of, up = row
        if own_key == key:
            return slot_of or run_id
        run_id = up
    return None


def _key_of_child(parent: Run, definition: Workflow, child_input: Any) -> tuple[str | None, int]:
    """A child's concurrency key: its workflow's (computed from its input), else its parent's. A child of a keyed
    run is part of that run's work: it holds the key while it lives, in its family's slot (admission.py)."""
    key, limit = concurrency_of(definition, child_input, None, None)
    if key is None and parent.concurrency_key is not None:
        return parent.concurrency_key, parent.concurrency_limit
    return key, limit


def _refuse_a_changed_list(step: Step, started: dict[int, str], inputs: Sequence[Any]) -> None:
    """Children are found again by index: a list that changed since they started (a rerun from the step that makes
    it, a live list that grew in front) would pair the old children with new inputs — their charges counted for
    the wrong items, the new items never done. Refused, naming the first index that changed."""
    for index, input_hash in sorted(started.items()):
        given = inputs[index] if index < len(inputs) else None
        now = check_input({} if given is None else given, f"child {index}'s input") if index < len(inputs) else None
        if now != input_hash:
            raise PermanentError(
                f"the list of step {step.step_id!r} changed since its children started: child {index} was started "
                f"with other input{' (the list is shorter now)' if now is None else ''}; its children stand as they "
                "are — start the new list as a new run (`manage.py durable_fork` with the new input) rather than "
                "pairing them with other items"
            )


def _refuse_restarting_pruned(parent: Run, step: Step, existing: int) -> None:
    """A step re-executed (a rerun, a resume) after retention pruned some of its children must not start them
    again: under new run ids their effects would apply a second time. The parent's events count what it started."""
    started = Event.objects.filter(run_id=parent.id, kind="children_started", step_id=step.step_id)
    counted = sum(int((detail or {}).get("count") or 0) for detail in started.values_list("detail", flat=True))
    if counted > existing:
        raise PermanentError(
            f"{counted - existing} of the {counted} child runs step {step.step_id!r} started were pruned; starting "
            f"them again would repeat their effects: start the work as a new run (`manage.py durable_fork`) instead"
        )


def _insert(runs: list[Run], rows: list[Step]) -> None:
    first_kind: dict[uuid.UUID, str] = {}
    for row in rows:
        first_kind.setdefault(row.run_id, row.kind)
    with transaction.atomic():
        for start in range(0, len(runs), INSERT_CHUNK):
            Run.objects.bulk_create(runs[start : start + INSERT_CHUNK])
        for start in range(0, len(rows), INSERT_CHUNK):
            Step.objects.bulk_create(rows[start : start + INSERT_CHUNK])
        for child in runs:
            if child.concurrency_key is None:
                wake_on_commit(child.id, kind=first_kind.get(child.id))
        # A keyed child queues for its key like any run: admitted at once in its parent's slot, else in its turn.
        for key in sorted({child.concurrency_key for child in runs} - {None}):
            admit_on_commit(key)


def children_of(parent_id: Any, step_id: str | None = None) -> Any:
    """The children of a run (of one of its steps), a queryset in index order."""
    children = Run.objects.filter(parent_id=parent_id)
    if step_id is not None:
        children = children.filter(parent_step=step_id)
    return children.order_by("parent_step", "child_index")


def tally(parent_id: Any, step_id: str) -> Tally:
    """One grouped query: the step's children by status."""
    grouped = children_of(parent_id, step_id).order_by().values("status").annotate(n=Count("id"))
    return _tally_of({row["status"]: row["n"] for row in grouped})


def _tally_of(counts: dict[str, int]) -> Tally:
    return Tally(
        total=sum(counts.values()),
        completed=counts.get(RunStatus.COMPLETED, 0),
        failed=sum(counts.get(s, 0) for s in FAILED_STATUSES),
        active=sum(counts.get(s, 0) for s in ACTIVE_RUN_STATUSES),
    )


def gather(parent_id: Any, step_id: str) -> list[dict[str, Any]]:
    """The step's children in index order: run id, status, and output or error."""
    rows = children_of(parent_id, step_id).values(
        "id", "child_index", "status", "output", "error", "cancel_requested_at"
    )
    gathered = []
    for row in rows:
        status = row["status"]
        if status in ACTIVE_RUN_STATUSES and row["cancel_requested_at"] is not None:
            status = "cancelling"  # its step is finishing; it stops after it
        entry: dict[str, Any] = {"index": row["child_index"], "run": str(row["id"]), "status": status}
        if status == RunStatus.COMPLETED:
            entry["output"] = row["output"]
        elif row["error"] is not None:
            entry["error"] = row["error"]
        gathered.append(entry)
    return gathered


def join_of(workflow: str, version: int, step_name: str) -> Join:
    """The join declared by the step definition `step_name` of that workflow version; if that is gone, wait for
    all children (a wake-up too many costs one re-check; one too few would strand the run)."""
    try:
        definition = registry.get(workflow, version).definition(step_name)
    except (UnknownWorkflowError, DefinitionError):
        return Join(need=None, fail_fast=False)
    return Join(need=definition.options.get("join"), fail_fast=bool(definition.options.get("fail_fast", True)))


def is_met(parent_id: Any, step_id: str, join: Join, *, finished: str | None = None) -> bool:
    """True once waiting longer cannot change the step's outcome (`is_ready`), read with indexed probes instead
    of counting every child: a join of 1,000 children is not re-counted 1,000 times. `finished`: the status of
    the child that just ended (its own failure decides a fail-fast join without a read)."""
    kids = Run.objects.filter(parent_id=parent_id, parent_step=step_id).order_by()
    if join.fail_fast and finished in FAILED_STATUSES:
        return True
    if join.need is not None and kids.filter(status=RunStatus.COMPLETED)[: join.need].count() >= join.need:
        return True
    if not kids.filter(status__in=ACTIVE_RUN_STATUSES).exists():  # durable_run_live_children
        return True
    # A sibling's failure was told by its own end; without one (the park, the sweep) it is looked for.
    return join.fail_fast and finished is None and kids.filter(status__in=FAILED_STATUSES).exists()


# --- Waking the parent ----------------------------------------------------------------------------------


def notify_parent(child_id: Any, status: str | None = None) -> bool:
    """A run ended (`status`): if it is a child whose parent waits on a join now met, wake the parent. True if
    woken. Most children end with the join unmet: one read and one probe, no lock."""
    row = (
        Run.objects.filter(pk=child_id)
        .values_list("parent_id", "parent_step", "parent__workflow", "parent__workflow_version")
        .first()
    )
    if row is None or row[0] is None:
        return False
    parent_id, step_id, workflow, version = row
    join = _join_of_step(parent_id, step_id, workflow, version)
    if not is_met(parent_id, step_id, join, finished=status):
        return False
    with transaction.atomic():
        # The parent's row first: the lock order of every operation on a run and its waits (cancel, park, decide).
        if not Run.objects.select_for_update().filter(pk=parent_id).exists():
            return False
        wait = Wait.objects.open().filter(run_id=parent_id, kind=WaitKind.CHILDREN, name=step_id).first()
        return wait is not None and join_if_ready_txn(wait, finished=status)


def _join_of_step(parent_id: Any, step_id: str, workflow: str, version: int) -> Join:
    """A children step's id is its definition's name unless a plan named it otherwise: then read its name."""
    try:
        definition = registry.get(workflow, version).definition(step_id)
        if definition.kind == StepKind.CHILDREN:
            return join_of(workflow, version, step_id)
    except (UnknownWorkflowError, DefinitionError):
        pass
    name = Step.objects.live().filter(run_id=parent_id, step_id=step_id).values_list("name", flat=True).first()
    return join_of(workflow, version, name or step_id)


def join_if_ready_txn(wait: Wait, *, finished: str | None = None) -> bool:
    """Close the open `children` wait and wake its run if the join is met (the caller holds the run's row lock).

    The park calls it too, in the parking transaction: a child that finished after the step counted its
    children, but before the wait existed, found no wait to close — the park sees it instead."""
    assert connection.in_atomic_block, "join_if_ready_txn must run inside transaction.atomic()"
    step = Step.objects.filter(pk=wait.step_id).values_list("step_id", "name", "run__workflow", "run__workflow_version")
    found = step.first()
    if found is None:
        return False
    step_id, step_name, workflow, version = found
    if not is_met(wait.run_id, step_id, join_of(workflow, version, step_name), finished=finished):
        return False
    return _close_txn(wait, step_id)


def _close_txn(wait: Wait, step_id: str) -> bool:
    counted = tally(wait.run_id, step_id)
    decision = {"via": "join", "completed": counted.completed, "failed": counted.failed, "active": counted.active}
    closing = {"decided_by": "children", "decided_at": DbNow(), "decision": decision}
    if not transitions.move_wait(WaitOp.JOIN, wait.pk, to=WaitStatus.APPROVED, **closing):
        return False
    send_on_commit(wait_closed, run_id=wait.run_id, wait_id=wait.pk, status=WaitStatus.APPROVED, decided_by="children")
    record_event(wait.run_id, "children_joined", step_id=step_id, wait=wait.pk, **decision)
    if transitions.wake_txn(wait.run_id):
        wake_on_commit(wait.run_id)
    return True


# --- Cancelling -----------------------------------------------------------------------------------------


# Runs whose children the current cancel_family call cancels itself (with the compensation it was asked for):
# the `run_finished` backstop, sent when the parent's cancel commits, leaves them alone.
_cascading: ContextVar[frozenset[str]] = ContextVar("durable_cascading", default=frozenset())


def cancel_family(run_id: Any, *, reason: str = "", actor: str = "", compensate: bool = False) -> Run:
    """Cancel a run (runs.cancel_run) and then its live children, theirs too, with the same `compensate`.

    The parent first: a parent waiting on its join is stopped before its children's cancels could wake it."""
    token = _cascading.set(_cascading.get() | {str(run_id)})
    try:
        run = cancel_run(run_id, reason=reason, actor=actor, compensate=compensate)
    finally:
        _cascading.reset(token)
    with transaction.atomic():
        # Under the parent's row lock, re-read: a parent another operator resumed since its cancel committed keeps
        # its children (`resume_family` takes the parent's row first too).
        parent = (
            Run.objects.select_for_update().filter(pk=run.id).values_list("status", "finish_as", "cancel_requested_at")
        )
        status, finish_as, requested = parent.first() or ("", "", None)
        if status == RunStatus.CANCELLED or finish_as or requested is not None:
            cancel_children(run.id, compensate=compensate, why=_cancelled_with(run.id))
            if compensate:
                undo_finished_children(run.id)
    return run


def _cancelled_with(parent_id: Any) -> str:
    """The reason recorded on a child its parent's cancellation cancelled (what `resume_family` brings back)."""
    return f"its parent run {parent_id} was cancelled"


def cancel_children(parent_id: Any, *, compensate: bool, why: str, step_id: str | None = None) -> int:
    """Cancel the live children of a run (of one of its steps); how many. One that finishes meanwhile is left."""
    live = children_of(parent_id, step_id).filter(
        status__in=ACTIVE_RUN_STATUSES, cancel_requested_at__isnull=True, finish_as=""
    )
    cancelled = 0
    for child_id in list(live.values_list("id", flat=True)):
        try:
            cancel_family(child_id, reason=why, actor=f"parent:{parent_id}", compensate=compensate)
        except InvalidTransitionError:
            continue  # it finished between the query and the cancel
        cancelled += 1
    return cancelled


def _on_run_finished(sender: Any, run_id: Any, status: str, **kwargs: Any) -> None:
    """After any run's terminal commit: wake its waiting parent; a child that ended after its family's saga started
    undoes what it did too; a cancelled (or compensated) parent's late children stop and undo theirs."""
    try:
        if kwargs.get("parent_id") is not None:
            notify_parent(run_id, status)
            if Run.objects.filter(pk=kwargs["parent_id"], family_undo=True).exists():
                undo_finished(run_id)
        # A completed run costs nothing more here: only a cancel, or a saga ending failed, can owe its children.
        owed = status == RunStatus.FAILED and Run.objects.filter(pk=run_id, family_undo=True).exists()
        if (status == RunStatus.CANCELLED or owed) and str(run_id) not in _cascading.get():
            _cascade(run_id)
    except Exception:  # noqa: BLE001 - the run is committed; the sweep finds what this missed
        logger.warning("run %s finished: its family could not be told now; the sweep will", run_id, exc_info=True)


def _cascade(parent_id: Any) -> int:
    """A cancelled parent's live children (e.g. started by its step after the cancel looked) are cancelled, with
    compensation if its compensation was asked for; then its finished children undo what they did too.

    Under the parent's row lock, re-read: a family resumed meanwhile (`resume_family`, which takes the parent's
    row first too) is not cancelled again."""
    with transaction.atomic():
        parent = (
            Run.objects.select_for_update()
            .filter(pk=parent_id)
            .values_list("status", "finish_as", "family_undo")
            .first()
        )
        if parent is None:
            return 0
        status, finish_as, owed = parent
        cancelled = 0
        if status == RunStatus.CANCELLED or (owed and status in FINISHED_RUN_STATUSES):
            cancelled = cancel_children(parent_id, compensate=bool(finish_as or owed), why=_cancelled_with(parent_id))
        if owed:
            undo_finished_children(parent_id)
        return cancelled


# --- A family's saga ---------------------------------------------------------------------------------------


def undo_finished_children(parent_id: Any) -> int:
    """A run's compensation is its family's: its children that had already ended (completed, failed, or cancelled
    without compensation) undo what they applied too, each in a saga of its own from its end (newest effect first;
    it then ends `cancelled`); theirs too. Live children are cancelled with compensation instead (cancel_children).
    How many started a saga."""
    ended = children_of(parent_id).filter(status__in=FINISHED_RUN_STATUSES, finish_as="").order_by("child_index")
    return sum(undo_finished(child_id) for child_id in list(ended.values_list("id", flat=True)))


def undo_finished(run_id: Any) -> int:
    """One finished run of a compensated family undoes what it applied (1 if a saga started), then its children."""
    with transaction.atomic():
        saga = transitions.undo_finished_txn(run_id)
        if saga.planned:
            record_event(run_id, "family_compensation", why="its parent's compensation undoes its family's effects")
            wake_on_commit(run_id)
            admit_on_commit(Run.objects.filter(pk=run_id).values_list("concurrency_key", flat=True).first())
    return int(bool(saga.planned)) + undo_finished_children(run_id)


# --- Resuming ------------------------------------------------------------------------------------------


def resume_family(run_id: Any, *, from_step: str | None = None, actor: str = "") -> Run:
    """Resume (or, with `from_step`, rerun) a run (runs.resume_run); a cancelled one brings back the children its
    cancellation cancelled, theirs too, in the same transaction (the parent's row first, as the cascade takes it).

    Resumed alone, the parent would re-read its children cancelled and fail its join; a child resumed under a
    cancelled parent would be cancelled again by the sweep's orphan pass, so that is refused. Children that ended
    otherwise (completed, failed, cancelled by an operator or by their join, compensated) stay as they are:
    resume a failed one after its parent if its work is still wanted."""
    run = get_run(run_id)
    # A child whose own saga stopped half-way finishes it (the orphan pass leaves a saga alone); any other waits.
    if run.status in (RunStatus.FAILED, RunStatus.CANCELLED) and not run.finish_as and parent_is_cancelled(run):
        raise InvalidTransitionError(
            f"run {run.id} cannot resume while its parent run {run.parent_id} is cancelled: resume the parent, "
            f"which resumes the children cancelled with it (`manage.py durable_resume {run.parent_id}`)"
        )
    if run.status != RunStatus.CANCELLED:
        return resume_run(run_id, from_step=from_step, actor=actor)
    with transaction.atomic():
        resumed = resume_run(run_id, from_step=from_step, actor=actor)
        _bring_back_children(run.id, actor=actor)
    return resumed


def parent_is_cancelled(run: Run) -> bool:
    """True for a child whose parent is cancelled (it does not resume on its own: the parent brings it back)."""
    return (
        run.parent_id is not None
        and Run.objects.filter(pk=run.parent_id, status__unindexed=RunStatus.CANCELLED).exists()
    )


def _bring_back_children(parent_id: Any, *, actor: str) -> None:
    """The children a parent's cancellation reached come back with it, theirs too: a cancel still only requested (a
    worker is running the child's step) is withdrawn first — settled later it would cancel a child under a live
    parent — then those it cancelled resume. Children that compensated stay as they are."""
    why = _cancelled_with(parent_id)
    mine = children_of(parent_id).filter(cancel_reason=why, finish_as="")
    requested = mine.filter(status__in=ACTIVE_RUN_STATUSES, cancel_requested_at__isnull=False)
    for child_id in list(requested.order_by("child_index").values_list("id", flat=True)):
        if transitions.withdraw_cancel_txn(child_id, reason=why):
            record_event(child_id, "cancel_withdrawn", actor=actor, why="its parent run was resumed")
            _bring_back_children(child_id, actor=actor)
    for child_id in list(mine.filter(status=RunStatus.CANCELLED).order_by("child_index").values_list("id", flat=True)):
        resume_run(child_id, actor=actor)
        _bring_back_children(child_id, actor=actor)


run_finished.connect(_on_run_finished, dispatch_uid="durable_agents.engine.family")


# --- The sweep's share -----------------------------------------------------------------------------------


def sweep_children(now: datetime | None = None, *, batch: int | None = None) -> dict[str, int]:
    """Wake parents whose join was met but whose wake-up was lost (each open join re-checked at most once per
    IDLE_RESWEEP_SECONDS), and cancel live children of cancelled parents. Safe to run concurrently."""
    now = now or clock.now()
    limit = batch or int(settings.SWEEP_BATCH)
    idle = timedelta(seconds=float(settings.IDLE_RESWEEP_SECONDS))
    joined = 0
    stale = Wait.objects.open().filter(kind=WaitKind.CHILDREN, updated_at__lt=now - idle).order_by("updated_at")
    columns = ("id", "run_id", "step__step_id", "step__name", "run__workflow", "run__workflow_version")
    due = list(stale.values_list(*columns)[:limit])
    # One grouped read for the whole batch, not probes per join.
    counts: dict[tuple[Any, str], dict[str, int]] = defaultdict(dict)
    parents = Run.objects.filter(parent_id__in={row[1] for row in due}).order_by()
    grouped = parents.values_list("parent_id", "parent_step", "status").annotate(n=Count("id"))
    for parent_id, step_id, status, n in grouped:
        counts[(parent_id, step_id)][status] = n
    checked = []
    for wait_id, run_id, step_id, name, workflow, version in due:
        if not is_ready(join_of(workflow, version, name), _tally_of(counts[(run_id, step_id)])):
            checked.append(wait_id)
            continue
        with transaction.atomic():
            if locked(Run.objects.filter(pk=run_id)).first() is None:
                continue  # being parked, cancelled or decided: a later pass gets to it
            wait = Wait.objects.open(keyed=True).filter(pk=wait_id).first()
            joined += bool(wait is not None and join_if_ready_txn(wait))
    # Checked and not met: not again before IDLE_RESWEEP_SECONDS (their status is unchanged).
    Wait.objects.filter(pk__in=checked, status=WaitStatus.OPEN).update(updated_at=DbNow())
    orphans = Run.objects.filter(
        Q(parent__status=RunStatus.CANCELLED),
        status__in=ACTIVE_RUN_STATUSES,
        cancel_requested_at__isnull=True,
        finish_as="",
    )
    parents = set(orphans.values_list("parent_id", flat=True)[:limit])
    cancelled = sum(_cascade(parent_id) for parent_id in parents)
    # Sagas owed to families whose run has ended (a crash lost its cascade, or a child's end hook): reach their
    # children, and let go of a run once none of its children is live or standing on what it applied. Each at most
    # once per idle period, oldest check first: one that cannot let go yet (a child queued behind a week-long
    # holder) goes to the back, never holding up the others.
    undone = 0
    owed = Run.objects.filter(family_undo=True, status__in=FINISHED_RUN_STATUSES, updated_at__lt=now - idle)
    for run_id in list(owed.order_by("updated_at").values_list("id", flat=True)[:limit]):
        undone += undo_finished_children(run_id)
        cancelled += _cascade(run_id)
        with transaction.atomic():
            transitions.family_undone_txn(run_id)
    return {"joined": joined, "orphans_cancelled": cancelled, "family_undone": undone}


__all__ = [
    "Join",
    "Tally",
    "cancel_children",
    "cancel_family",
    "children_of",
    "gather",
    "is_met",
    "is_ready",
    "join_if_ready_txn",
    "join_of",
    "notify_parent",
    "parent_is_cancelled",
    "resume_family",
    "undo_finished",
    "undo_finished_children",
    "spawn",
    "sweep_children",
    "tally",
]
