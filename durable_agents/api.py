"""The public API of durable_agents: start, inspect, cancel and resume runs; define workflows.

Example::

    from durable_agents import api

    run = api.start("noop", {"steps": 3}, idempotency_key="order-42")
    api.get(run.id).status   # "pending", then "running", then "completed"
"""

from __future__ import annotations

import uuid
from typing import Any

from durable_agents.agents.loop import agent
from durable_agents.agents.participants import FunctionParticipant, ScriptedParticipant, participants
from durable_agents.engine.context import StepContext
from durable_agents.engine.effects import resolve_effect as _resolve_effect
from durable_agents.engine.plans import fork_run, migrate_run
from durable_agents.engine.records import get_run
from durable_agents.engine.runs import cancel_run, resume_run, set_budget, set_participant, start_run
from durable_agents.engine.waits import decide_wait
from durable_agents.engine.waits import send_signal as _send_signal
from durable_agents.errors import (
    ApprovalRejectedError,
    DefinitionError,
    DurableAgentsError,
    EffectOutcomeUnknownError,
    IdempotencyKeyReusedError,
    InputTooLargeError,
    InvalidInputError,
    InvalidTransitionError,
    LeaseLostError,
    PermanentError,
    RetryableError,
    RunNotFoundError,
    StepNotFoundError,
    ToolArgumentsError,
    ToolFailedError,
    UnknownToolError,
    UnknownWorkflowError,
    WaitClosedError,
    WaitNotFoundError,
)
from durable_agents.judge import judge
from durable_agents.models import Effect, Run, RunStatus, StepStatus
from durable_agents.planner import planner
from durable_agents.tools import Field, Tool, tool
from durable_agents.waits import approval, sleep, wait_for_signal
from durable_agents.workflows import PlannedStep, RetryPolicy, Workflow, call, registry, tool_step, workflow

__all__ = [
    "DefinitionError",
    "ApprovalRejectedError",
    "DurableAgentsError",
    "EffectOutcomeUnknownError",
    "Field",
    "FunctionParticipant",
    "IdempotencyKeyReusedError",
    "InputTooLargeError",
    "InvalidInputError",
    "InvalidTransitionError",
    "LeaseLostError",
    "PermanentError",
    "PlannedStep",
    "RetryPolicy",
    "RetryableError",
    "Run",
    "RunNotFoundError",
    "RunStatus",
    "ScriptedParticipant",
    "StepContext",
    "StepNotFoundError",
    "StepStatus",
    "Tool",
    "ToolArgumentsError",
    "ToolFailedError",
    "UnknownToolError",
    "UnknownWorkflowError",
    "WaitClosedError",
    "WaitNotFoundError",
    "Workflow",
    "agent",
    "approval",
    "call",
    "cancel",
    "decide",
    "fork",
    "get",
    "judge",
    "migrate",
    "participants",
    "planner",
    "registry",
    "resolve_effect",
    "resume",
    "send_signal",
    "set_budget",
    "sleep",
    "start",
    "swap_participant",
    "tool",
    "tool_step",
    "wait_for_signal",
    "workflow",
]


def start(workflow: str, input: Any = None, *, idempotency_key: str | None = None, version: int | None = None) -> Run:
    """Start a run of `workflow` (latest version unless `version`); the same key returns the same run.

    Reusing a key with a different input raises IdempotencyKeyReusedError (Stripe semantics).
    """
    return start_run(workflow, input, idempotency_key=idempotency_key, version=version)


def get(run_id: uuid.UUID | str) -> Run:
    """The run with that id; RunNotFoundError if there is none."""
    return get_run(run_id)


def cancel(run_id: uuid.UUID | str, reason: str = "", *, compensate: bool = False, actor: str = "") -> Run:
    """Cancel a run; a step already executing finishes and is checkpointed, then the run stops.

    With `compensate=True` the run first undoes its applied effects (newest first) through each tool's
    compensating tool, each exactly once, then ends `cancelled`.
    """
    return cancel_run(run_id, reason=reason, actor=actor, compensate=compensate)


def resume(run_id: uuid.UUID | str, from_step: str | None = None, *, actor: str = "") -> Run:
    """Resume a failed or cancelled run, re-wake a stalled one, or run again from `from_step`."""
    return resume_run(run_id, from_step=from_step, actor=actor)


def decide(
    wait_id: int | str, approved: bool, *, by: str, comment: str = "", via: str = "api", run_id: Any = None
) -> Any:
    """Approve or reject exactly the approval wait `wait_id` and wake its run.

    A closed wait raises WaitClosedError (nothing changes); a signal or timer wait, InvalidTransitionError
    (signals come through `send_signal`). `run_id` checks the wait belongs to that run.
    """
    return decide_wait(wait_id, approved=approved, by=by, comment=comment, via=via, run_id=run_id)


def send_signal(run_id: uuid.UUID | str, name: str, payload: Any = None, *, by: str = "") -> Any:
    """Deliver signal `name` (with a JSON payload) to a run; kept until the run waits for it."""
    return _send_signal(run_id, name, payload, by=by)


def fork(run_id: uuid.UUID | str, at_step: str, *, input: Any = None, actor: str = "") -> Run:  # noqa: A002
    """Start a new run that copies `run_id`'s checkpoints before `at_step`, optionally with new input."""
    return fork_run(run_id, at_step, input=input, actor=actor)


def swap_participant(run_id: uuid.UUID | str, participant: str, *, actor: str = "") -> Run:
    """Make `participant` answer this run's model turns from the next turn on; recorded as an operator action."""
    participants.get(participant)  # unknown names are a clear error, before anything changes
    return set_participant(run_id, participant, actor=actor)


def resolve_effect(
    key: str, applied: bool, *, result: Any = None, actor: str, reason: str = "", resume: bool = True
) -> Effect:
    """Record the outcome of an effect nobody could know (it `needs_attention`): `applied` (with the receiving
    system's `result`), or not. With `resume`, a run that stopped on it (failed) then resumes from there:
    an applied effect is not called again; one recorded as not applied is called again under its key.
    """
    effect = _resolve_effect(key, applied=applied, result=result, actor=actor, reason=reason)
    if resume and Run.objects.filter(pk=effect.run_id, status=RunStatus.FAILED).exists():
        resume_run(effect.run_id, actor=actor)
    return effect


def migrate(run_id: uuid.UUID | str, version: int, *, replan: bool = False, actor: str = "") -> Run:
    """Move a run to another registered version of its workflow (recorded); wakes a run parked on drift."""
    return migrate_run(run_id, version, replan=replan, actor=actor)
