"""What each applied effect's compensation has come to, as the run page and `durable_show` both say it.

A saga plans one compensation step per effect to undo (`engine/saga.py`); the effect, its compensating
effect (`<key>:compensate`), that step and the run's lease each hold part of the answer. Read here once, so the
banner, the in-flight line, the steps table, the effects table and the command line cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from durable_agents.display import when_text
from durable_agents.engine.reliance import is_compensable
from durable_agents.models import Effect, EffectKind, EffectStatus, Event, Run, RunStatus, Step, StepKind, StepStatus

NOT_COMPENSABLE = "not compensable"
NOT_COMPENSATED = "not compensated"  # no saga asked for it
PENDING = "pending"
IN_FLIGHT = "in flight"
COMPENSATED = "compensated"
FAILED = "failed"
RESOLVED = "resolved by operator"
KEPT = "kept"  # another run still stands on it
NOTHING_TO_UNDO = "nothing to undo"  # its outcome, learned, was: not applied
UNDONE = (COMPENSATED, RESOLVED)


@dataclass(frozen=True)
class Compensation:
    """One effect's compensation: its state, and what says so (the compensating key, the attempt, the error)."""

    key: str
    tool: str
    state: str
    by: str = ""  # the compensating effect's key
    attempt: int = 0
    started: datetime | None = None
    note: str = ""  # the error, the operator, the run that keeps it

    @property
    def text(self) -> str:
        """`compensation in flight (attempt 1, started 14:02:03 UTC)`, `compensated by k:compensate`."""
        if self.state == COMPENSATED:
            return f"compensated by {self.by}"
        if self.state in (NOT_COMPENSABLE, NOT_COMPENSATED, NOTHING_TO_UNDO):
            return self.state
        if self.state == KEPT:
            return f"kept: {self.note}"
        if self.state == IN_FLIGHT:
            started = f", started {when_text(self.started, precise=True)}" if self.started else ""
            return f"compensation in flight (attempt {self.attempt}{started})"
        if self.state == RESOLVED:
            return f"compensation {RESOLVED} {self.note}".rstrip()
        return f"compensation {self.state}" + (f": {self.note}" if self.note else "")


@dataclass(frozen=True)
class SagaProgress:
    """Where a compensating run stands: `compensating, will end cancelled: 1 of 3 effects undone, …`."""

    finish_as: str
    planned: list[Compensation]

    @property
    def undone(self) -> int:
        return sum(c.state in UNDONE for c in self.planned)

    @property
    def text(self) -> str:
        parts = [f"compensating, will end {self.finish_as}: {self.undone} of {len(self.planned)} effects undone"]
        parts += [f"{c.tool} key {c.key} {c.state}" for c in self.planned if c.state in (IN_FLIGHT, FAILED)]
        return ", ".join(parts)


def compensations(run: Run, effects: Iterable[Effect]) -> dict[str, Compensation]:
    """By effect key, the compensation of each of `effects` (those of kind `effect`, their `compensation`
    selected) and of each effect the run's saga plans to undo. Two queries: the saga's steps, and the
    operators' records of compensating effects."""
    originals = {e.idempotency_key: e for e in effects if e.kind == EffectKind.EFFECT}
    steps = {
        str((s.args or {}).get("effect")): s
        for s in Step.objects.live().filter(run=run, kind=StepKind.COMPENSATE).defer("context").order_by("position")
    }
    resolved = {
        str(event.detail.get("key")): event.actor
        for event in Event.objects.filter(run=run, kind="effect_resolved").only("detail", "actor")
        if isinstance(event.detail, dict)
    }
    keys = list(steps) + [k for k in originals if k not in steps]
    return {key: _state(key, originals.get(key), steps.get(key), run, resolved) for key in keys}


def saga_progress(run: Run, states: dict[str, Compensation]) -> SagaProgress | None:
    """The banner of a run still compensating; None for any other run."""
    if not run.finish_as or run.is_finished:
        return None
    planned = [c for c in states.values() if c.state not in (NOT_COMPENSABLE, NOT_COMPENSATED)]
    return SagaProgress(run.finish_as, planned)


def _compensation(effect: Effect) -> Effect | None:
    return getattr(effect, "compensation", None)


def _state(key: str, effect: Effect | None, step: Step | None, run: Run, resolved: dict[str, str]) -> Compensation:
    tool = effect.tool if effect is not None else ""
    by = _compensation(effect) if effect is not None else None
    said: dict[str, Any] = {"key": key, "tool": tool, "by": by.idempotency_key if by is not None else ""}
    if effect is not None and effect.status == EffectStatus.COMPENSATED:
        if by is not None and by.idempotency_key in resolved:
            return Compensation(**said, state=RESOLVED, note=resolved[by.idempotency_key])
        return Compensation(**said, state=COMPENSATED)
    if by is not None and by.status == EffectStatus.FAILED:
        return Compensation(**said, state=FAILED, note=_error(by.error))
    if step is None:
        if effect is not None and not is_compensable(effect.tool):
            return Compensation(**said, state=NOT_COMPENSABLE)
        return Compensation(**said, state=NOT_COMPENSATED)
    if _executing(step, run):
        return Compensation(**said, state=IN_FLIGHT, attempt=max(run.attempt, 1), started=run.claimed_at)
    if step.status == StepStatus.FAILED:
        return Compensation(**said, state=FAILED, note=_error(step.error))
    if by is not None and by.needs_attention:
        return Compensation(**said, state=FAILED, note=by.needs_attention)
    result = step.result if isinstance(step.result, dict) else {}
    if step.status == StepStatus.DONE and "kept" in result:
        relying = result.get("for") if isinstance(result.get("for"), list) else []
        return Compensation(**said, state=KEPT, note=f"run {', '.join(map(str, relying))} stands on it")
    if step.status == StepStatus.DONE and "skipped" in result:
        return Compensation(**said, state=NOTHING_TO_UNDO)
    if step.status == StepStatus.DONE:
        return Compensation(**said, state=COMPENSATED)
    return Compensation(**said, state=PENDING)


def _executing(step: Step, run: Run) -> bool:
    """The saga's step under the run's cursor, held by a worker (its row reads pending until the attempt ends)."""
    return (
        run.status == RunStatus.RUNNING
        and bool(run.lease_owner)
        and step.position == run.cursor
        and step.status == StepStatus.PENDING
    )


def _error(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('type', 'Error')}: {error.get('message', '')}"
    return str(error or "")
