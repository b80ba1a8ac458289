"""Starting runs: each input checked and planned, the runs and their plan rows written together, idempotency keys
settled, workers woken once the start commits.

Every input of a batch is checked before anything is written: one bad input, or an idempotency key reused with
another input, and no run is started. On Postgres the write is one statement for the whole batch (startpath.py);
elsewhere (SQLite) the ORM writes it in one transaction. A run with a concurrency key is queued instead of woken: it
is admitted once the start commits (engine/admission.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, transaction

from durable_agents import tracing
from durable_agents.engine import startpath
from durable_agents.engine.admission import admit_on_commit, concurrency_of
from durable_agents.engine.gather import GATHERER, gathering
from durable_agents.engine.payloads import checked_input
from durable_agents.engine.records import PlanRow, new_plan_row
from durable_agents.engine.wake import wake_many, wake_on_commit
from durable_agents.errors import (
    DurableAgentsError,
    IdempotencyKeyReusedError,
    InvalidInputError,
    InvalidTransitionError,
)
from durable_agents.models import Run, Step
from durable_agents.workflows import Workflow, registry

# A start whose key a racing start takes meanwhile is sent again (it then finds the winner's run): this many times.
KEY_RACE_ATTEMPTS = 3
# Problems listed in the error of a refused batch (all are counted).
PROBLEMS_SHOWN = 5


def start_run(
    workflow: str,
    run_input: Any = None,
    *,
    idempotency_key: str | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
    schedule: str = "",
    participant: str = "",
    replay_lane: str = "",
    hand_on: bool = True,
) -> Run:
    """Create a run and its plan rows (one statement on Postgres: startpath.py); a worker is woken once it commits
    (the caller's transaction, if any; else at once, with the first step's kind, so its queue costs no query).

    A run with a concurrency key (`concurrency_key`, else the workflow's function of the input) is queued instead:
    once the start commits it is admitted when its key has a free slot (engine/admission.py), and woken then.
    `hand_on=False` leaves that admission to the caller: one that starts thousands of runs on one key in one
    transaction (a replay) hands the key on once, not once a run (each admission reads the key's whole queue).
    """
    batch = _Batch(
        registry.get(workflow, version),
        concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
        columns={"schedule": schedule, "participant": participant, "replay_lane": replay_lane},
    )
    batch.add(run_input, idempotency_key, what="input")
    batch.refuse_problems()
    (run,) = batch.write(hand_on=hand_on, one_wake=True)
    return run


def start_runs(
    workflow: str,
    inputs: Sequence[Any],
    *,
    idempotency_keys: Sequence[str | None] | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> list[Run]:
    """Start a run of `workflow` for each input, all in one statement on Postgres (and so one transaction), in the
    order given; `idempotency_keys[i]` (None: no key) is input i's. Runs are returned as start_run returns them: an
    input whose key a run already holds with that input gets that run (one key given twice with one input, one
    run); every run started is woken (wake_many) once the start commits. Nothing is written if any input is refused
    (InvalidInputError, listing every refused input) or reuses a key with another input (IdempotencyKeyReusedError).
    """
    inputs = list(inputs)
    keys = [None] * len(inputs) if idempotency_keys is None else list(idempotency_keys)
    if len(keys) != len(inputs):
        raise InvalidInputError(
            f"{len(inputs)} inputs but {len(keys)} idempotency keys: give one key (or None) per input, in order"
        )
    batch = _Batch(
        registry.get(workflow, version), concurrency_key=concurrency_key, concurrency_limit=concurrency_limit
    )
    for index, (run_input, key) in enumerate(zip(inputs, keys, strict=True)):
        batch.add(run_input, key, what=f"inputs[{index}]")
    batch.refuse_problems()
    return batch.write(hand_on=True, one_wake=False) if inputs else []


@dataclass
class _Start:
    """One run of a batch, checked, not written yet."""

    run: Run
    input_json: str
    plan: list[PlanRow]
    span: tracing.Span = tracing.OFF


@dataclass
class _Batch:
    """The inputs of one start call, checked one by one (`add`), then written together (`write`)."""

    definition: Workflow
    concurrency_key: str | None = None
    concurrency_limit: int | None = None
    columns: dict[str, str] = field(default_factory=dict)
    # Each input's key and place: its start (an index into `starts`), or the error that refused it.
    keys: list[str | None] = field(default_factory=list)
    places: list[int | DurableAgentsError] = field(default_factory=list)
    starts: list[_Start] = field(default_factory=list)
    # Inputs with a key whose plan refused them: refused only if no run holds their key (it is returned instead).
    unplanned: dict[int, str] = field(default_factory=dict)
    # Where each key was first given (its input's hash); the runs found holding keys.
    first: dict[str, tuple[int, str]] = field(default_factory=dict)
    found: dict[str, Run] = field(default_factory=dict)

    def add(self, run_input: Any, key: str | None, *, what: str) -> None:
        """Check and plan one input; its problem, if any, is kept, to be raised with every other's."""
        run_input = {} if run_input is None else run_input
        self.keys.append(key)
        try:
            input_hash, input_json = checked_input(run_input, what)
            key_of_run, limit = concurrency_of(self.definition, run_input, self.concurrency_key, self.concurrency_limit)
            if key is not None and (not isinstance(key, str) or not key.strip() or len(key) > 255):
                raise InvalidInputError("idempotency key must be a non-empty string of at most 255 characters")
        except DurableAgentsError as exc:
            self.places.append(_placed(exc, what))
            return
        if key is not None:
            if key in self.first:
                # One key twice in one call: one run, as two starts with it make, if the inputs are the same.
                index, first_hash = self.first[key]
                if first_hash != input_hash:
                    self.places.append(_given_twice(key, what))
                    return
                if index in self.unplanned:
                    self.unplanned[len(self.keys) - 1] = input_hash
                self.places.append(self.places[index])
                return
            self.first[key] = (len(self.keys) - 1, input_hash)
        try:
            plan = self.definition.build_plan(run_input)
            rows = [new_plan_row(self.definition, element, position) for position, element in enumerate(plan)]
        except InvalidInputError as exc:
            if key is not None:
                # A key's run is returned without planning its input again (it was planned when the run started).
                self.unplanned[len(self.keys) - 1] = input_hash
            self.places.append(_placed(exc, what))
            return
        run = _new_run(
            id=uuid.uuid4(),
            workflow=self.definition.name,
            workflow_version=self.definition.version,
            input=run_input,
            input_hash=input_hash,
            idempotency_key=key,
            step_count=len(rows),
            concurrency_key=key_of_run,
            concurrency_limit=limit,
            search=self.definition.search_attributes(run_input),
            **self.columns,
        )
        self.places.append(len(self.starts))
        self.starts.append(_Start(run, input_json, rows))

    def refuse_problems(self) -> None:
        """Raise the inputs' problems, all in one error (of the first's class), except a plan's refusal of an input
        whose key a run holds with that input: that run is its start's."""
        if self.unplanned:
            keys = [self.keys[i] for i in self.unplanned]
            self.found.update((run.idempotency_key, run) for run in Run.objects.filter(idempotency_key__in=keys))
        problems: list[DurableAgentsError] = []
        for i, place in enumerate(self.places):
            if isinstance(place, int) or place in problems:
                continue
            existing = self.found.get(self.keys[i] or "") if i in self.unplanned else None
            if existing is None:
                problems.append(place)
            elif _is_reused(existing, self.definition.name, self.unplanned[i]):
                problems.append(_reused_error(existing))
        if len(problems) == 1:
            raise problems[0]
        if problems:
            shown = "; ".join(str(problem) for problem in problems[:PROBLEMS_SHOWN])
            more = f" (and {len(problems) - PROBLEMS_SHOWN} more)" if len(problems) > PROBLEMS_SHOWN else ""
            raise type(problems[0])(
                f"{len(problems)} of {len(self.places)} inputs are refused, so no run was started (fix them or leave"
                f" them out, and start the batch again): {shown}{more}"
            ) from problems[0]

    def write(self, *, hand_on: bool, one_wake: bool) -> list[Run]:
        """Write the runs; return every input's run, in order (a run holding its key where one does)."""
        for start in self.starts:
            # The run's span, child of the caller's (a request, a parent's step): its context is kept in the row. A
            # start that fails never ends it: it is not exported.
            start.span = tracing.start_run(self.definition.name, self.definition.version, start.run.id)
            start.run.trace_context = start.span.traceparent
        written = _insert(self.definition.name, self.starts, self.found)
        for start in self.starts:
            if start.run.pk in written:
                tracing.end_on_commit(start.span)
                continue
            # Not the run's span (the key's run has its own, in its trace): the caller's trace shows the run it found.
            found = self.found[start.run.idempotency_key or ""]
            start.span.rename(f"reuse run {self.definition.name}")
            start.span.set({tracing.RUN_ID: str(found.id), "durable_agents.run.reused": True})
            tracing.end(start.span)
        _wake([start for start in self.starts if start.run.pk in written], hand_on=hand_on, one_wake=one_wake)
        runs = []
        for key, place in zip(self.keys, self.places, strict=True):
            if key is not None and key in self.found:
                runs.append(self.found[key])
            else:
                assert isinstance(place, int), "a refused input is raised by refuse_problems"
                runs.append(self.starts[place].run)
        return runs


# Every field of a new run but those given per run, as its default; the fields whose default is made per row (the id,
# a dict) are given every time.
PER_ROW = frozenset({"id", "input", "search"})


@cache
def _run_defaults() -> tuple[tuple[Any, ...], dict[str, int]]:
    fields = Run._meta.concrete_fields
    for f in fields:
        assert f.attname in PER_ROW or not (f.has_default() and callable(f.default)), f"Run.{f.attname}: per row"
    return tuple(f.get_default() for f in fields), {f.attname: i for i, f in enumerate(fields)}


def _new_run(**given: Any) -> Run:
    """An unsaved Run of `given` values, every other field its default: Django's positional __init__, a third of the
    time of its keyword one (which looks every field up), for the thousand runs of a batch."""
    defaults, index = _run_defaults()
    assert given.keys() >= PER_ROW
    values = list(defaults)
    for name, value in given.items():
        values[index[name]] = value
    return Run(*values)


def _placed(exc: DurableAgentsError, what: str) -> DurableAgentsError:
    """The error of one input of a batch, naming it (a lone start's error is its own)."""
    if what == "input" or str(exc).startswith(what):
        return exc
    placed = type(exc)(f"{what}: {exc}")
    placed.__cause__ = exc
    return placed


def _given_twice(key: str, what: str) -> IdempotencyKeyReusedError:
    return IdempotencyKeyReusedError(
        f"idempotency key {key!r} is given for {what} and for an earlier input with a different input; use a new "
        "key for a new run"
    )


def _insert(workflow: str, starts: list[_Start], found: dict[str, Run]) -> set[Any]:
    """Write the runs of `starts` whose keys no run holds, adding the runs that hold the others' keys to `found`
    (IdempotencyKeyReusedError if one holds it with another input: then nothing is written). The ids written."""
    if not starts:
        return set()
    for _ in range(KEY_RACE_ATTEMPTS):
        try:
            if startpath.is_available():
                return _insert_statement(workflow, starts, found)
            return _insert_orm(workflow, starts, found)
        except startpath.KeyTaken:
            continue  # a racing start took a key meanwhile and nothing was written: look again, and find its run
    raise InvalidTransitionError(
        f"runs of {workflow!r} with these idempotency keys are being started elsewhere at the same time; retry"
    )


def _insert_statement(workflow: str, starts: list[_Start], found: dict[str, Run]) -> set[Any]:
    inserted = startpath.insert_runs(
        [start.run for start in starts], [start.input_json for start in starts], [start.plan for start in starts]
    )
    found.update(inserted.existing)
    _refuse_reused(workflow, starts, found)
    written = {start.run.pk for start in starts if start.run.idempotency_key not in found}
    if inserted.count != len(written):
        # Only in the caller's transaction: a key taken by a start that committed while the statement ran was
        # skipped (startpath.py). Its run is the winner's.
        keys = [start.run.idempotency_key for start in starts if start.run.pk in written and start.run.idempotency_key]
        raced = {run.idempotency_key: run for run in Run.objects.filter(idempotency_key__in=keys)}
        raced = {key: run for key, run in raced.items() if run.pk not in written}
        found.update(raced)
        written = {start.run.pk for start in starts if start.run.idempotency_key not in found}
        if inserted.count != len(written) or _reused(workflow, starts, raced):
            # The runs written beside it are in the caller's transaction, which must not commit half a batch.
            if inserted.count:
                transaction.set_rollback(True)
            _refuse_reused(workflow, starts, raced)
            raise InvalidTransitionError(f"runs of {workflow!r} were started elsewhere at the same time; retry")
    for n, start in enumerate(starts):
        if start.run.pk in written:
            start.run.created_at = start.run.updated_at = inserted.created_at + timedelta(microseconds=n)
            start.run._state.adding, start.run._state.db = False, DEFAULT_DB_ALIAS
    return written


def _insert_orm(workflow: str, starts: list[_Start], found: dict[str, Run]) -> set[Any]:
    keys = [start.run.idempotency_key for start in starts if start.run.idempotency_key]
    try:
        with transaction.atomic():
            if keys:
                found.update((run.idempotency_key, run) for run in Run.objects.filter(idempotency_key__in=keys))
                _refuse_reused(workflow, starts, found)
            new = [start for start in starts if start.run.idempotency_key not in found]
            for start in new:
                start.run.save(force_insert=True)
            Step.objects.bulk_create([row.step(start.run.id) for start in new for row in start.plan])
    except IntegrityError as exc:
        if keys:
            raise startpath.KeyTaken from exc  # a key taken since it was looked up (a racing start)
        raise
    return {start.run.pk for start in new}


def _is_reused(existing: Run, workflow: str, input_hash: str) -> bool:
    return existing.workflow != workflow or existing.input_hash != input_hash


def _reused_error(existing: Run) -> IdempotencyKeyReusedError:
    return IdempotencyKeyReusedError(
        f"idempotency key {existing.idempotency_key!r} was used for run {existing.id} "
        f"({existing.workflow}) with a different input; use a new key for a new run"
    )


def _reused(workflow: str, starts: list[_Start], found: dict[str, Run]) -> list[IdempotencyKeyReusedError]:
    """The errors of the starts whose key a run in `found` holds with another input."""
    held = ((start, found.get(start.run.idempotency_key or "")) for start in starts)
    return [
        _reused_error(run) for start, run in held if run is not None and _is_reused(run, workflow, start.run.input_hash)
    ]


def _refuse_reused(workflow: str, starts: list[_Start], found: dict[str, Run]) -> None:
    errors = _reused(workflow, starts, found)
    if errors:
        raise errors[0]


def _wake(written: list[_Start], *, hand_on: bool, one_wake: bool) -> None:
    """Wake the runs written once the start commits (a lone start's by wake_on_commit, which wakes it with the other
    runs its caller's transaction wakes); a run with a concurrency key is queued for its key's admission instead."""
    woken = [start for start in written if start.run.concurrency_key is None]
    kinds = [start.plan[0].kind if start.plan else None for start in woken]
    if one_wake and len(woken) == 1:
        run_id, kind = woken[0].run.id, kinds[0]
        if gathering():
            transaction.on_commit(lambda: GATHERER.add(run_id, kind))
        else:
            wake_on_commit(run_id, kind=kind)
    elif woken:
        ids = [start.run.id for start in woken]
        transaction.on_commit(lambda: wake_many(ids, kinds=kinds))
    if hand_on:
        for key in sorted({start.run.concurrency_key for start in written} - {None}):
            admit_on_commit(key)
