"""The public API of durable_agents: start, inspect, cancel and resume runs; define workflows.

Example::

    from durable_agents import api

    run = api.start("noop", {"steps": 3}, idempotency_key="order-42")
    api.get(run.id).status   # "pending", then "running", then "completed"
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from django.db.models import QuerySet

from durable_agents.agents.loop import agent
from durable_agents.agents.participants import FunctionParticipant, ScriptedParticipant, participants
from durable_agents.children import children
from durable_agents.engine.context import StepContext
from durable_agents.engine.effects import resolve_effect as _resolve_effect
from durable_agents.engine.family import cancel_family, parent_is_cancelled, resume_family
from durable_agents.engine.plans import fork_run, migrate_run
from durable_agents.engine.records import get_run, let_go
from durable_agents.engine.runs import resume_run, set_participant
from durable_agents.engine.runs import set_budget as _set_budget
from durable_agents.engine.schedules import define_schedule, delete_schedule
from durable_agents.engine.schedules import pause_schedule as _pause_schedule
from durable_agents.engine.schedules import resume_schedule as _resume_schedule
from durable_agents.engine.schedules import trigger_schedule as _trigger_schedule
from durable_agents.engine.starts import start_run, start_runs
from durable_agents.engine.waits import decide_wait
from durable_agents.engine.waits import send_signal as _send_signal
from durable_agents.errors import (
    AgentLimitError,
    ApprovalRejectedError,
    BudgetExceededError,
    ChildRunFailedError,
    CohortNotFoundError,
    ContextWindowExceededError,
    DefinitionError,
    DurableAgentsError,
    EffectConflictError,
    EffectOutcomeUnknownError,
    IdempotencyKeyReusedError,
    InputTooLargeError,
    InvalidInputError,
    InvalidTransitionError,
    LeaseLostError,
    ModelRefusalError,
    ModelRequestError,
    ModelUnavailableError,
    NotificationFailedError,
    PermanentError,
    ReplayAppliesNothingError,
    ReplayBudgetExceededError,
    ReplayDivergedError,
    ReplayNotFoundError,
    RetryableError,
    RunNotFoundError,
    ScheduleDeclaredError,
    ScheduleNotFoundError,
    StepError,
    StepNotFoundError,
    ToolArgumentsError,
    ToolFailedError,
    UnknownParticipantError,
    UnknownToolError,
    UnknownWorkflowError,
    WaitClosedError,
    WaitExpiredError,
    WaitNotFoundError,
)
from durable_agents.judge import judge
from durable_agents.models import Effect, MissedSlots, Overlap, Run, RunStatus, Schedule, StepStatus
from durable_agents.planner import planner
from durable_agents.replays import Report, export_cohort, import_cohort, save_cohort
from durable_agents.replays import replay as _replay
from durable_agents.replays import report as _report
from durable_agents.replays import run_here as _run_here
from durable_agents.search import check_filters
from durable_agents.storable import check_json, check_text, whole_number
from durable_agents.tools import Field, Tool, tool
from durable_agents.waits import approval, sleep, wait_for_signal
from durable_agents.workflows import (
    Batch,
    Cron,
    PlannedStep,
    RetryPolicy,
    Workflow,
    call,
    cron,
    registry,
    tool_step,
    workflow,
)

__all__ = [
    "AgentLimitError",
    "ApprovalRejectedError",
    "Batch",
    "BudgetExceededError",
    "ChildRunFailedError",
    "CohortNotFoundError",
    "ContextWindowExceededError",
    "Cron",
    "DefinitionError",
    "DurableAgentsError",
    "EffectConflictError",
    "EffectOutcomeUnknownError",
    "Field",
    "FunctionParticipant",
    "IdempotencyKeyReusedError",
    "InputTooLargeError",
    "InvalidInputError",
    "InvalidTransitionError",
    "LeaseLostError",
    "ModelRefusalError",
    "ModelRequestError",
    "ModelUnavailableError",
    "NotificationFailedError",
    "PermanentError",
    "PlannedStep",
    "ReplayAppliesNothingError",
    "ReplayBudgetExceededError",
    "ReplayDivergedError",
    "ReplayNotFoundError",
    "Report",
    "RetryPolicy",
    "RetryableError",
    "Run",
    "RunNotFoundError",
    "RunStatus",
    "Schedule",
    "ScheduleDeclaredError",
    "ScheduleNotFoundError",
    "ScriptedParticipant",
    "StepContext",
    "StepError",
    "StepNotFoundError",
    "StepStatus",
    "Tool",
    "ToolArgumentsError",
    "ToolFailedError",
    "UnknownParticipantError",
    "UnknownToolError",
    "UnknownWorkflowError",
    "WaitClosedError",
    "WaitExpiredError",
    "WaitNotFoundError",
    "Workflow",
    "agent",
    "approval",
    "call",
    "cancel",
    "children",
    "cron",
    "decide",
    "export_cohort",
    "fork",
    "get",
    "import_cohort",
    "judge",
    "migrate",
    "participants",
    "pause_schedule",
    "planner",
    "registry",
    "replay",
    "replay_report",
    "replay_here",
    "resolve_effect",
    "resume",
    "resume_schedule",
    "runs",
    "save_cohort",
    "schedule",
    "send_signal",
    "set_budget",
    "sleep",
    "start",
    "start_many",
    "swap_participant",
    "tool",
    "tool_step",
    "trigger_schedule",
    "unschedule",
    "wait_for_signal",
    "workflow",
]


# Text arguments are checked before anything is written: the column widths they are stored in
# (Run.idempotency_key, Run.participant), or bounds for free text kept in every event (the admin forms' own).
KEY_MAX_CHARS = 255
PARTICIPANT_MAX_CHARS = 100
REASON_MAX_CHARS = 1000
COMMENT_MAX_CHARS = 2000
SCHEDULE_NAME_MAX_CHARS = 200  # Schedule.name; its runs' keys "schedule:<name>:<slot>" then fit in 255


def start(
    workflow: str,
    input: Any = None,
    *,
    idempotency_key: str | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> Run:
    """Start a run of `workflow` (latest version unless `version`); the same key returns the same run.

    Reusing a key with a different input raises IdempotencyKeyReusedError (Stripe semantics).
    `concurrency_key` (else the workflow's, from the input) queues the run until fewer than `concurrency_limit`
    (else the workflow's, default 1) runs with that key are in flight, e.g.
    ``start("refund", {...}, concurrency_key="customer-42")``.
    """
    check_text(workflow, "a workflow name")
    if idempotency_key is not None:
        check_text(idempotency_key, "the idempotency key", max_chars=KEY_MAX_CHARS)
    if concurrency_key is not None:
        check_text(concurrency_key, "the concurrency key", max_chars=KEY_MAX_CHARS)
    return start_run(
        workflow,
        input,
        idempotency_key=idempotency_key,
        version=_version(version, optional=True),
        concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
    )


def start_many(
    workflow: str,
    inputs: Iterable[Any],
    *,
    idempotency_keys: Iterable[str | None] | None = None,
    version: int | None = None,
    concurrency_key: str | None = None,
    concurrency_limit: int | None = None,
) -> list[Run]:
    """Start a run of `workflow` for each of `inputs`, all or none, and return them in order (as `start` would).

    One statement on Postgres whatever their number, and one transaction (the caller's, if any): every input is
    checked first, and one refused input (InvalidInputError, listing each refused one by its index) or one key reused
    with another input (IdempotencyKeyReusedError) starts none. `idempotency_keys` gives each input its key (None:
    none), as `start`'s: an input whose key a run already holds with that input gets that run, and one key given twice
    with one input is one run. The runs are woken together once the start commits. `version`, `concurrency_key` and
    `concurrency_limit` are `start`'s, for every run.

    Example::

        orders = ["A-1001", "A-1002", "A-1003"]
        runs = api.start_many(
            "noop", [{"steps": 2} for _ in orders], idempotency_keys=[f"nightly-{order}" for order in orders]
        )
        assert [run.idempotency_key for run in runs] == ["nightly-A-1001", "nightly-A-1002", "nightly-A-1003"]
    """
    check_text(workflow, "a workflow name")
    inputs = _each(inputs, "inputs", "one input a run; for one run, use start()")
    keys = None
    if idempotency_keys is not None:
        keys = _each(idempotency_keys, "idempotency_keys", "one key (or None) an input")
    for index, key in enumerate(keys or ()):
        if key is not None:
            check_text(key, f"idempotency_keys[{index}]", max_chars=KEY_MAX_CHARS)
    if concurrency_key is not None:
        check_text(concurrency_key, "the concurrency key", max_chars=KEY_MAX_CHARS)
    return start_runs(
        workflow,
        inputs,
        idempotency_keys=keys,
        version=_version(version, optional=True),
        concurrency_key=concurrency_key,
        concurrency_limit=concurrency_limit,
    )


def get(run_id: uuid.UUID | str) -> Run:
    """The run with that id; RunNotFoundError if there is none."""
    return get_run(run_id)


def runs(
    *, workflow: str | None = None, search: Mapping[str, str] | None = None, replays: bool = False
) -> QuerySet[Run]:
    """Runs, newest first: of one `workflow`, and whose search attributes hold every `field: value` of `search`
    (the fields the workflow declares with `workflow(..., search=(...))`; on Postgres a GIN index serves it).
    Replay runs (`Run.replay_lane`, replays.py) only with `replays=True`: they are not the system's work.

    Example: ``api.runs(search={"order_id": "A-1001"}).first()``
    """
    found = Run.objects.all() if replays else Run.objects.filter(replay_lane="")
    if workflow is not None:
        check_text(workflow, "a workflow name")
        found = found.filter(workflow=workflow)
    if search is not None:
        found = found.matching_search(check_filters(search))
    return found.order_by("-created_at")


def cancel(run_id: uuid.UUID | str, reason: str = "", *, compensate: bool = False, actor: str = "") -> Run:
    """Cancel a run; a step already executing finishes and is checkpointed, then the run stops.

    With `compensate=True` the run first undoes its applied effects (newest first) through each tool's
    compensating tool, each exactly once, then ends `cancelled`. Its child runs are cancelled too (with the
    same `compensate`).
    """
    check_text(reason, "the reason", max_chars=REASON_MAX_CHARS)
    return cancel_family(run_id, reason=reason, actor=_actor(actor), compensate=compensate)


def resume(run_id: uuid.UUID | str, from_step: str | None = None, *, actor: str = "") -> Run:
    """Resume a failed or cancelled run, re-wake a stalled one, or run again from `from_step`.

    A cancelled parent brings back the child runs its cancellation cancelled (theirs too); a child whose parent
    is cancelled is refused: resume the parent."""
    if from_step is not None:
        check_text(from_step, "the step id (--from-step)")
    return resume_family(run_id, from_step=from_step, actor=_actor(actor))


def decide(
    wait_id: int | str, approved: bool, *, by: str, comment: str = "", via: str = "api", run_id: Any = None
) -> Any:
    """Approve or reject exactly the approval wait `wait_id` and wake its run.

    A closed wait raises WaitClosedError (nothing changes); a signal or timer wait, InvalidTransitionError
    (signals come through `send_signal`). `run_id` checks the wait belongs to that run.
    """
    if not isinstance(approved, bool):
        raise InvalidInputError(f"approved is True or False, got {approved!r}")
    if isinstance(wait_id, bool) or not isinstance(wait_id, int | str):
        raise WaitNotFoundError(f"no wait has id {wait_id!r}; wait ids are whole numbers")
    check_text(comment, "the comment", max_chars=COMMENT_MAX_CHARS)
    check_text(via, "via")
    by = _actor(by, "the decider (by, --as)")
    return decide_wait(wait_id, approved=approved, by=by, comment=comment, via=via, run_id=run_id)


def send_signal(
    run_id: uuid.UUID | str, name: str, payload: Any = None, *, by: str = "", wait_id: int | None = None
) -> Any:
    """Deliver signal `name` (with a JSON payload) to a run; kept until the run waits for it.

    With `wait_id` (the open signal wait an operator saw) it goes to that wait only, or raises WaitClosedError
    and nothing is kept: a form posted twice delivers once, e.g.
    ``send_signal(run.id, "paid", {"amount": 40}, by="alice", wait_id=wait.pk)``.
    """
    if not check_text(name, "the signal name").strip():
        raise InvalidInputError("the signal name is empty; give the name the run waits for")
    if wait_id is not None and (isinstance(wait_id, bool) or not isinstance(wait_id, int)):
        raise WaitNotFoundError(f"no wait has id {wait_id!r}; wait ids are whole numbers")
    return _send_signal(run_id, name, payload, by=_actor(by, "the sender (by, --as)"), wait_id=wait_id)


def fork(run_id: uuid.UUID | str, at_step: str, *, input: Any = None, actor: str = "") -> Run:  # noqa: A002
    """Start a new run that copies `run_id`'s checkpoints before `at_step`, optionally with new input."""
    check_text(at_step, "the step id (--at-step)")
    return fork_run(run_id, at_step, input=input, actor=_actor(actor))


def resolve_effect(
    key: str, applied: bool, *, result: Any = None, actor: str, reason: str = "", resume: bool = True
) -> Effect:
    """Record the outcome of an effect nobody could know (it `needs_attention`): `applied` (with the receiving
    system's `result`), or not. With `resume`, a run that stopped on it (failed) then resumes from there:
    an applied effect is not called again; one recorded as not applied is called again under its key. A child
    run whose parent is cancelled is not resumed: resuming the parent brings it back.
    """
    if not isinstance(applied, bool):
        raise InvalidInputError(f"applied is True or False, got {applied!r}")
    check_text(key, "the effect key", max_chars=300)
    check_text(reason, "the reason", max_chars=REASON_MAX_CHARS)
    check_json(result, "the result")
    actor = _actor(actor)
    effect = _resolve_effect(key, applied=applied, result=result, actor=actor, reason=reason)
    stopped = Run.objects.filter(pk=effect.run_id, status__unindexed=RunStatus.FAILED).first()
    # A run whose saga is over stays over (fork it instead); a child whose parent is cancelled comes back with it.
    if resume and stopped is not None and not let_go(stopped) and not parent_is_cancelled(stopped):
        resume_run(effect.run_id, actor=actor)
    return effect


def migrate(run_id: uuid.UUID | str, version: int, *, replan: bool = False, actor: str = "") -> Run:
    """Move a run to another registered version of its workflow (recorded); wakes a run parked on drift."""
    return migrate_run(run_id, _version(version), replan=replan, actor=_actor(actor))


def set_budget(
    run_id: uuid.UUID | str,
    *,
    tokens: int | None = None,
    cost_usd: Decimal | str | None = None,
    actor: str = "",
) -> Run:
    """Set a run's token and/or cost budget (e.g. raise it after BudgetExceededError, then resume).

    `tokens` is a whole number that fits a bigint; `cost_usd` a finite amount >= 0 with at most 6 decimals.
    """
    return _set_budget(run_id, tokens=tokens, cost_usd=cost_usd, actor=_actor(actor))


def swap_participant(run_id: uuid.UUID | str, participant: str, *, actor: str = "") -> Run:
    """Make `participant` answer this run's model turns from the next turn on; recorded as an operator action."""
    check_text(participant, "the participant name", max_chars=PARTICIPANT_MAX_CHARS)
    participants.get(participant)  # unknown names are a clear error, before anything changes
    return set_participant(run_id, participant, actor=_actor(actor))


def schedule(
    name: str,
    workflow: str,
    *,
    cron: str,
    input: Any = None,  # noqa: A002
    timezone: str = "UTC",
    missed: str = MissedSlots.SKIP,
    catch_up_limit: int = 10,
    overlap: str = Overlap.SKIP,
) -> Schedule:
    """Start `workflow` with `input` at every slot of `cron` (five fields, in `timezone`), each slot exactly once.

    For a schedule that is part of the code, declare it instead (`DURABLE_AGENTS["SCHEDULES"]` or
    `workflow(..., schedule=cron(...))`): each sweep keeps its row in step. This call is for schedules made at run
    time (a user's own report); a name declared in code is refused (ScheduleDeclaredError). Idempotent: the same
    definition changes nothing, a new cron starts from its next slot, and a schedule an operator paused stays
    paused. Slots missed while no sweep
    ran: `missed="skip"` starts the latest only, `"catch_up"` each (at most `catch_up_limit`, the latest).
    A slot due while a run the schedule started is still live (pending, running, waiting): `overlap="skip"` (the
    default) does not start it, nor owes it later, and counts it in `Schedule.overlap_skipped` (so catching up
    under it starts the oldest owed slot only: the others would overlap its run); `"allow"` starts it beside
    the live one.

    Example::

        api.schedule("nightly-report", "report", cron="0 3 * * *", input={"days": 1}, timezone="Europe/Paris")
    """
    check_text(name, "the schedule name", max_chars=SCHEDULE_NAME_MAX_CHARS)
    check_text(workflow, "a workflow name")
    check_text(cron, "the cron expression")
    check_text(timezone, "the time zone", max_chars=64)
    check_text(missed, "missed")
    check_text(overlap, "overlap")
    return define_schedule(
        name,
        workflow,
        cron=cron,
        run_input=input,
        tz=timezone,
        missed=missed,
        catch_up_limit=catch_up_limit,
        overlap=overlap,
    )


def pause_schedule(name: str, *, actor: str = "") -> Schedule:
    """Stop starting the schedule's slots (until `resume_schedule`); ScheduleNotFoundError for an unknown name.

    `actor` is who paused it, kept on the schedule (`paused_changed_by`, `paused_changed_at`). Example::

        api.pause_schedule("nightly-report", actor="alice")
    """
    check_text(name, "the schedule name", max_chars=SCHEDULE_NAME_MAX_CHARS)
    return _pause_schedule(name, actor=_actor(actor))


def resume_schedule(name: str, *, actor: str = "") -> Schedule:
    """Start the schedule's slots again, from the next one after now (the paused slots are not owed); `actor`
    is who resumed it, kept as for `pause_schedule`."""
    check_text(name, "the schedule name", max_chars=SCHEDULE_NAME_MAX_CHARS)
    return _resume_schedule(name, actor=_actor(actor))


def trigger_schedule(name: str, *, actor: str, token: str) -> Run:
    """Start the schedule's workflow with its input now, beside its slots; the same `token` starts one run.

    Example::

        api.trigger_schedule("nightly-report", actor="alice", token=uuid.uuid4().hex)
    """
    check_text(name, "the schedule name", max_chars=SCHEDULE_NAME_MAX_CHARS)
    check_text(token, "the trigger token")
    return _trigger_schedule(name, actor=_actor(actor), token=token)


def unschedule(name: str) -> None:
    """Delete the schedule; the runs it started stay. One declared in code is refused (ScheduleDeclaredError):
    remove its declaration instead, and the next sweep deletes it."""
    delete_schedule(check_text(name, "the schedule name", max_chars=SCHEDULE_NAME_MAX_CHARS))


def replay(
    *,
    cohort: str | None = None,
    candidate: Mapping[str, Any] | None = None,
    lanes: tuple[str, ...] = ("baseline", "candidate"),
    stubs: Mapping[str, Any] | None = None,
    budget_usd: Decimal | float | str | None = None,
    concurrency: int | None = None,
    actor: str = "",
    delivery: str | None = None,
    **selection: Any,
) -> Any:
    """Replay a cohort, or the finished runs chosen by `runs=`, `workflow=`, `status=`, `since=`, `until=`,
    `sample=`, `seed=`, with a `candidate` (model, participant, instructions, tool_descriptions, thinking, effort)
    beside the baseline (the recorded model asked again). Nothing is applied (replays.py). Returns the Replay; its
    runs go to workers like any run (or `replay_here(replay.id)`), and `replay_report(replay.id)` compares them.
    `delivery="batch"`: every model call through the Message Batches API, at half price (answered within 24 h).

    Example::

        replay = api.replay(workflow="refund_agent", sample=50, seed=1, candidate={"model": "claude-haiku-4-5"})
    """
    return _replay(
        cohort=cohort,
        candidate=candidate,
        lanes=lanes,
        stubs=stubs,
        budget_usd=budget_usd,
        concurrency=concurrency,
        actor=actor,
        **selection,
        delivery=delivery,
    )


def replay_report(replay_id: uuid.UUID | str) -> Report:
    """The replay's three lanes compared, run by run and over its cohort (`Report.verdict(fail_under)` for CI)."""
    return _report(replay_id)


def replay_here(replay_id: uuid.UUID | str) -> Report:
    """Advance the replay's runs in this process until all have finished (CI without workers), then report."""
    _run_here(replay_id)
    return _report(replay_id)


def _each(values: Iterable[Any], what: str, give: str) -> list[Any]:
    """`values` as a list; a string or a mapping (one value where a list of them is expected) is refused."""
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise InvalidInputError(f"{what} is a list ({give}), got {type(values).__name__}")
    return list(values)


def _actor(actor: str, what: str = "the actor (who is acting, --as)") -> str:
    """Who acts is kept in 200-character columns (Event.actor, Wait.decided_by): refuse what would not fit."""
    return check_text(actor, what)


def _version(version: Any, *, optional: bool = False) -> int | None:
    if version is None and optional:
        return None
    return whole_number(version, "a workflow version", low=1, high=2**31 - 1)
