"""Control flow a step raises to tell the engine what to do instead of checkpointing a result.

    BaseException
     ├── Park         park the run on a wait (approval, signal, timer)
     ├── Rerun        send the run back to an earlier step (a judge's "redo"), keeping this step's result
     └── ExtendPlan   checkpoint this step (a planner) and insert planned steps right after it

BaseException subclasses on purpose, like GeneratorExit: step and tool code that catches `Exception`
must not swallow them. Steps built on the engine (approvals, judges, planners) raise them; only
`engine/advance.py` catches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from durable_agents.models import DeadlinePolicy


@dataclass(frozen=True)
class WaitSpec:
    """What a parking step waits for, and how the wait behaves while open.

    A tool approval names the call it authorises: `effect_key` and `args_hash` (tool and checked arguments).
    """

    kind: str
    name: str = ""
    effect_key: str = ""
    args_hash: str = ""
    question: str = ""
    brief: str = ""
    deadline: datetime | None = None
    on_deadline: str = DeadlinePolicy.REJECT
    escalate_to: str = ""
    warn_before: timedelta | None = None
    remind_every: timedelta | None = None
    notify_to: tuple[str, ...] = field(default_factory=tuple)


class Park(BaseException):  # noqa: N818 - control flow, not an error
    """Raised by step code to park the run on a wait."""

    def __init__(self, spec: WaitSpec) -> None:
        super().__init__(spec.kind, spec.name)
        self.spec = spec


class Rerun(BaseException):  # noqa: N818 - control flow, not an error
    """Raised by a step to send the run back to an earlier step (a judge's "redo"), keeping its own result."""

    def __init__(self, step_id: str, reason: str, result: Any) -> None:
        super().__init__(step_id, reason)
        self.step_id = step_id
        self.reason = reason
        self.result = result


@dataclass(frozen=True)
class PlannedRow:
    """One step a planner adds to the plan: a unique step id, the definition it executes, its arguments."""

    step_id: str
    name: str
    args: Mapping[str, Any]
    fresh_for: timedelta | None = None


class ExtendPlan(BaseException):  # noqa: N818 - control flow, not an error
    """Raised by a planner step: checkpoint `result` and put `rows` right after this step in the plan."""

    def __init__(self, rows: list[PlannedRow], result: dict[str, Any]) -> None:
        super().__init__(len(rows))
        self.rows = rows
        self.result = result
