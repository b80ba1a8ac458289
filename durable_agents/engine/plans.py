"""Plans that stay true: re-plan on stale observations, redo from a step, version drift, forks, migrations.

Re-planning never repeats an applied effect: superseded steps keep their rows as history, and the fresh
copies keep their step ids, so an effect proposed again with the same tool and arguments finds its key
already applied and reuses the result (with other arguments it is an IdempotencyKeyReusedError for an
operator, never a silent second refund).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Q

from durable_agents import tracing
from durable_agents.clock import DbNow
from durable_agents.engine import transitions
from durable_agents.engine.admission import admit_on_commit, concurrency_of
from durable_agents.engine.control import Park, Rerun, WaitSpec
from durable_agents.engine.events import record_event
from durable_agents.engine.payloads import check_input, copy_payloads
from durable_agents.engine.records import get_run, let_go, plan_row
from durable_agents.engine.reliance import rely_on
from durable_agents.engine.wake import wake_on_commit
from durable_agents.errors import InvalidInputError, InvalidTransitionError, StepNotFoundError, UnknownWorkflowError
from durable_agents.models import (
    ACTIVE_RUN_STATUSES,
    Effect,
    EffectKind,
    EffectStatus,
    Event,
    Reliance,
    Run,
    Step,
    StepKind,
    StepStatus,
    Wait,
    WaitKind,
    WaitStatus,
)
from durable_agents.states import RunOp, StepOp, WaitOp
from durable_agents.workflows import Workflow, registry

MAX_REPLANS_PER_STEP = 3
VERSION_WAIT = "version_migration"


@dataclass(frozen=True)
class StaleObservation:
    step_id: str
    position: int
    age_seconds: float
    budget_seconds: float


def find_stale(run_id: uuid.UUID, depends_on: list[str], now: datetime) -> StaleObservation | None:
    """The earliest observation this step relies on that is older than its freshness budget."""
    rows = (
        Step.objects.live()
        .filter(run_id=run_id, step_id__in=depends_on, status=StepStatus.DONE, fresh_for__isnull=False)
        .exclude(observed_at=None)
        .order_by("position")
        .values_list("step_id", "position", "observed_at", "fresh_for")
    )
    for step_id, position, observed_at, fresh_for in rows:
        if observed_at + fresh_for < now:
            return StaleObservation(step_id, position, (now - observed_at).total_seconds(), fresh_for.total_seconds())
    return None


def replans_of(run_id: uuid.UUID, step_id: str) -> int:
    return Event.objects.filter(run_id=run_id, kind="replanned", step_id=step_id).count()


def replan_txn(run_id: uuid.UUID, stale: StaleObservation, *, because_of: str) -> list[str]:
    """Go back to the stale observation: re-observe it and re-run everything after it (re-planning too).

    Inside the fenced transaction that released the run (the caller's `hold_txn` moved its cursor)."""
    superseded = transitions.supersede_from_txn(run_id, stale.position)
    record_event(
        run_id,
        "replanned",
        step_id=because_of,
        observation=stale.step_id,
        reason=f"observation {stale.step_id!r} is {stale.age_seconds:.0f}s old, over its "
        f"{stale.budget_seconds:.0f}s budget",
        superseded=superseded,
    )
    wake_on_commit(run_id)
    return superseded


def redo_target(run_id: uuid.UUID, rerun: Rerun) -> Step:
    """The live step a redo goes back to."""
    target = Step.objects.live().filter(run_id=run_id, step_id=rerun.step_id).first()
    if target is None:
        raise StepNotFoundError(f"cannot redo from {rerun.step_id!r}: the run has no such step")
    return target


def redo_txn(run_id: uuid.UUID, rerun: Rerun, target: Step, *, from_step: str) -> list[str]:
    """Supersede from `target` on (the caller's `hold_txn` moved the cursor there) and wake the run."""
    superseded = transitions.supersede_from_txn(run_id, target.position)
    record_event(
        run_id, "redo_from_step", step_id=from_step, target=rerun.step_id, reason=rerun.reason, superseded=superseded
    )
    wake_on_commit(run_id)
    return superseded


# --- Versions -------------------------------------------------------------------------------------------


def missing_version(run: Run, step: Step) -> tuple[Workflow, str]:
    """The run's version is gone: the newest version of its workflow and that version's declared policy."""
    try:
        newest = registry.get(run.workflow)
    except UnknownWorkflowError:
        raise Park(_version_wait(run, f"workflow {run.workflow!r} is no longer registered")) from None
    return newest, newest.on_missing_version


def _version_wait(run: Run, reason: str) -> WaitSpec:
    return WaitSpec(kind=WaitKind.SIGNAL, name=VERSION_WAIT, question=f"{reason}; migrate the run to a version")


def park_for_version(run: Run, newest: Workflow) -> Park:
    return Park(
        _version_wait(run, f"version {run.workflow_version} of {run.workflow} is gone (newest: {newest.version})")
    )


def adopt_version_txn(run_id: uuid.UUID, newest: Workflow, *, replan: bool, actor: str = "") -> None:
    """Move a run to `newest`; with `replan`, its not-yet-done steps become the new version's plan.

    Inside a transaction that fenced the run (a worker's hold, or an operator's take)."""
    run = Run.objects.select_for_update().get(pk=run_id)
    previous = run.workflow_version
    changes: dict[str, Any] = {"workflow_version": newest.version, "updated_at": DbNow()}
    if replan:
        done = set(Step.objects.live().filter(run_id=run_id, status=StepStatus.DONE).values_list("step_id", flat=True))
        remaining = [e for e in newest.build_plan(run.input) if e.step_id not in done]
        transitions.move_steps_txn(
            StepOp.SUPERSEDE,
            Step.objects.live().filter(run_id=run_id, position__gte=run.cursor).exclude(status=StepStatus.DONE),
            to=StepStatus.SUPERSEDED,
        )
        Step.objects.bulk_create(
            plan_row(run_id, newest, element, run.cursor + i) for i, element in enumerate(remaining)
        )
        changes["step_count"] = run.cursor + len(remaining)
    Run.objects.filter(pk=run_id).update(**changes)
    record_event(run_id, "version_migrated", actor=actor, previous=previous, to=newest.version, replanned=replan)


def migrate_run(run_id: uuid.UUID | str, version: int, *, replan: bool = False, actor: str = "") -> Run:
    """An operator moves a run to a registered version (recorded); a run parked on version drift wakes."""
    run = get_run(run_id)
    if run.is_finished:
        raise InvalidTransitionError(f"run {run.id} is {run.status}; there is nothing to migrate")
    target = registry.get(run.workflow, version)
    if run.finish_as:
        raise InvalidTransitionError(
            f"run {run.id} is compensating (it ends {run.finish_as}); its saga finishes on any version, "
            "so there is nothing to migrate"
        )
    with transaction.atomic():
        # Take the run from whoever might hold it: a worker mid-step must not commit into a changed plan.
        # Fenced on finish_as too: a saga started since the read above is never re-planned over.
        if not transitions.take_txn(RunOp.TAKE, run.id, where=Q(finish_as="")):
            raise InvalidTransitionError(
                f"run {run.id} is being advanced by {run.lease_owner}, or began compensating; look at it again"
            )
        adopt_version_txn(run.id, target, replan=replan, actor=actor)
        parked = Wait.objects.open().filter(run_id=run.id, kind=WaitKind.SIGNAL, name=VERSION_WAIT)
        migrated = [
            wait_id
            for wait_id in parked.values_list("pk", flat=True)
            if transitions.move_wait(
                WaitOp.MIGRATE, wait_id, to=WaitStatus.APPROVED, decided_by=actor or "operator", decided_at=DbNow()
            )
        ]
        # Only a run parked on version drift wakes: one waiting for a person, a signal or a timer waits on.
        if migrated and transitions.wake_txn(run.id):
            wake_on_commit(run.id)
    run.refresh_from_db()
    return run


def version_drift() -> Any:
    """Active runs whose pinned workflow version is not registered in this process."""
    drift = Q()
    for name in registry.names():
        drift |= Q(workflow=name) & ~Q(workflow_version__in=registry.versions(name))
    drift |= ~Q(workflow__in=registry.names())
    return Run.objects.filter(status__in=ACTIVE_RUN_STATUSES).filter(drift)


# --- Forks ----------------------------------------------------------------------------------------------


def fork_run(run_id: uuid.UUID | str, at_step: str, *, input: Any = None, actor: str = "") -> Run:  # noqa: A002
    """A new run that copies the source's checkpoints before `at_step` and runs on from there.

    With the source's input the fork shares its effect scope: an effect the source applied is reused,
    not repeated. With new input it is a new request, with effects of its own. Either way the fork relies on
    the effects its copied checkpoints record: the source's saga keeps them while the fork stands. A fork
    copies the forward plan only (never a saga's compensation steps), and only checkpoints: every step
    before `at_step` must have one.
    """
    source = get_run(run_id)
    if source.replay_lane:
        raise InvalidTransitionError(
            f"run {source.id} is a replay run: a fork of it would be a real run acting on a replay's answers; replay "
            "its recording again instead (durable_replay)"
        )
    forward = Step.objects.live().filter(run_id=source.id).exclude(kind=StepKind.COMPENSATE)
    target = forward.filter(step_id=at_step).first()
    if target is None:
        raise StepNotFoundError(f"run {source.id} has no step {at_step!r} to fork at")
    unchecked = forward.filter(position__lt=target.position).exclude(status=StepStatus.DONE).order_by("position")
    if (first := unchecked.first()) is not None:
        raise InvalidTransitionError(
            f"step {first.step_id!r} of run {source.id} comes before {at_step!r} and has no checkpoint "
            f"({first.status}); fork at {first.step_id!r} or earlier"
        )
    if source.finish_as and not let_go(source):
        raise InvalidTransitionError(
            f"run {source.id} is compensating: its saga is undoing what a fork would stand on; fork it once the "
            "saga finished (the fork then applies its effects anew)"
        )
    undone = (
        Effect.objects.filter(step__run_id=source.id, step__position__lt=target.position, kind=EffectKind.EFFECT)
        .filter(status=EffectStatus.COMPENSATED)
        .select_related("step")
        .order_by("step__position")
        .first()
    )
    if undone is not None:
        raise InvalidTransitionError(
            f"the checkpoint of step {undone.step.step_id!r} records {undone.tool} (key {undone.idempotency_key}), "
            f"which run {source.id}'s saga undid; fork at {undone.step.step_id!r} or earlier to do it anew"
        )
    new_input = source.input if input is None else input
    input_hash = check_input(new_input)
    if input is not None and not isinstance(input, dict | list):
        raise InvalidInputError("a fork's input must be a JSON object or list")
    key = source.concurrency_key
    search = source.search
    if input is not None:
        definition = registry.get(source.workflow, source.workflow_version)
        definition.build_plan(new_input)  # the workflow's own checks
        search = definition.search_attributes(new_input)
        if definition.concurrency_key is not None:
            # New input, new work: the key is the one that input has (another customer's fork queues on theirs).
            key, _limit = concurrency_of(definition, new_input, None, source.concurrency_limit)
    steps = list(forward.order_by("position"))
    # With the source's input a fork shares its effect keys, so what the source applied is reused, not
    # repeated. Not once the source compensates: an undone effect's result no longer holds.
    compensated = bool(source.finish_as) or source.effects.filter(status=EffectStatus.COMPENSATED).exists()
    shared = input_hash == source.input_hash and not compensated
    # A trace of its own (a fork is new work, often days later), its run span linked to the source's.
    traced = tracing.start_run(source.workflow, source.workflow_version, "", links_to=source.trace_context)
    with transaction.atomic():
        fork = Run.objects.create(
            workflow=source.workflow,
            workflow_version=source.workflow_version,
            input=new_input,
            input_hash=input_hash,
            forked_from=source,
            cursor=target.position,
            step_count=len(steps),
            effect_scope=(source.effect_scope or str(source.id)) if shared else "",
            participant=source.participant,
            # The same work for the same customer: a fork queues on the source's concurrency key (its new input's,
            # when it has one and the workflow computes keys from input).
            concurrency_key=key,
            concurrency_limit=source.concurrency_limit,
            # A fork of a slot's run is that slot's work: its schedule's overlap policy sees it (engine/schedules.py).
            schedule=source.schedule,
            search=search,
            trace_context=traced.traceparent,
        )
        traced.set({tracing.RUN_ID: str(fork.id)})
        tracing.end_on_commit(traced)
        transitions.copy_plan_txn(steps, fork.id, target.position)
        _rely_on_copied_checkpoints(source, fork, target)
        # Out-of-row results are rows of their run: the fork gets its own, which outlive the source.
        copy_payloads(source.id, fork.id, [s.result_ref for s in steps if s.position < target.position])
        record_event(
            fork.id, "forked", step_id=at_step, actor=actor, source=str(source.id), new_input=input is not None
        )
        record_event(source.id, "fork_started", step_id=at_step, actor=actor, fork=str(fork.id))
        wake_on_commit(fork.id)
        admit_on_commit(fork.concurrency_key)
    return fork


def _rely_on_copied_checkpoints(source: Run, fork: Run, target: Step) -> None:
    """The fork's copied checkpoints record the source's effects (those its steps before `target` applied,
    and those those steps rely on): the fork relies on them, through its copies of those steps."""
    copies = dict(Step.objects.filter(run=fork).values_list("step_id", "pk"))
    before = Q(step__run_id=source.id, step__position__lt=target.position)
    applied = Effect.objects.filter(before, run_id=source.id, status=EffectStatus.APPLIED, kind=EffectKind.EFFECT)
    relied = Reliance.objects.filter(before, run_id=source.id).exclude(step__status=StepStatus.SUPERSEDED)
    pairs = [(e, copies.get(e.step.step_id)) for e in applied.select_related("step")]
    pairs += [(r.effect, copies.get(r.step.step_id)) for r in relied.select_related("effect", "step")]
    # A copied fan-out checkpoint records what the source's children (and theirs) did: the fork stands on their
    # effects too, so the saga of the source's family keeps them while the fork stands.
    copied = Step.objects.filter(run_id=source.id, position__lt=target.position).values_list("step_id", flat=True)
    generation = dict(
        Run.objects.filter(parent_id=source.id, parent_step__in=list(copied)).values_list("id", "parent_step")
    )
    family = dict(generation)
    while generation:
        below = Run.objects.filter(parent_id__in=list(generation)).values_list("id", "parent_id")
        generation = {child_id: generation[parent_id] for child_id, parent_id in below}
        family.update(generation)
    if family:
        theirs = Effect.objects.filter(run_id__in=list(family), status=EffectStatus.APPLIED, kind=EffectKind.EFFECT)
        pairs += [(e, copies.get(family[e.run_id])) for e in theirs]
    pairs = [(effect, step_pk) for effect, step_pk in pairs if step_pk is not None]
    rely_on([e for e, _ in pairs], fork.id, [s for _, s in pairs])


__all__ = ["find_stale", "fork_run", "migrate_run", "replan_txn", "version_drift"]
