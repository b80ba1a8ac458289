"""What the run page shows, read in a fixed number of queries whatever the run's history length.

The troubleshooting answers come first (last committed step, in-flight effect, retry history, version),
then the timeline, steps, turns, effects and events. Long histories are windowed: the steps around the
cursor, the latest turns, effects and events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from durable_agents.admin.filters import stuck_reason
from durable_agents.admin.timeline import Retry, WaitSpan, render_timeline
from durable_agents.errors import UnknownWorkflowError
from durable_agents.models import (
    ACTIVE_RUN_STATUSES,
    Effect,
    EffectStatus,
    Event,
    Run,
    Step,
    StepStatus,
    Turn,
    Wait,
    WaitStatus,
)
from durable_agents.workflows import registry

# Steps shown: this many plan positions, most of them before the cursor (where problems are).
STEP_WINDOW = 200
STEPS_BEFORE_CURSOR = 150
TURNS_SHOWN = 50
EFFECTS_SHOWN = 200
EVENTS_SHOWN = 200
WAITS_SHOWN = 50
RETRIES_READ = 500
RETRIES_LISTED = 10
PREVIEW_CHARS = 160
FULL_CHARS = 20_000


@dataclass(frozen=True)
class Text:
    """A JSON value as a one-line preview and, when longer, a pretty full text for a <details>."""

    preview: str
    full: str = ""


def as_text(value: Any) -> Text:
    if value is None or value == "" or value == {} or value == []:
        return Text("")
    compact = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    if len(compact) <= PREVIEW_CHARS:
        return Text(compact)
    pretty = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False, indent=2)
    if len(pretty) > FULL_CHARS:
        pretty = pretty[:FULL_CHARS] + f"\n… ({len(pretty) - FULL_CHARS:,} more characters)"
    return Text(compact[: PREVIEW_CHARS - 1] + "…", pretty)


@dataclass
class RunPage:
    run: Run
    now: datetime
    stuck: str
    steps: list[Step]
    steps_before: int
    steps_after: int
    last_committed: Step | None
    in_flight: list[Effect]
    retries: list[Event]
    retry_count_shown: int
    turns: list[tuple[Turn, Text, Text]]
    effects: list[Effect]
    events: list[tuple[Event, Text]]
    timeline: str
    latest_version: int | None
    # The run's waits, newest first; an open one is approved or rejected with the run's decide actions.
    waits: list[Wait] = field(default_factory=list)

    @property
    def open_wait(self) -> Wait | None:
        return next((w for w in self.waits if w.status == WaitStatus.OPEN), None)

    @property
    def total_tokens(self) -> int:
        run = self.run
        return run.input_tokens + run.output_tokens + run.cache_write_tokens + run.cache_read_tokens

    @property
    def step_rows(self) -> list[tuple[Step, Text]]:
        return [(step, as_text(step.result)) for step in self.steps]


def build_run_page(run: Run, *, now: datetime) -> RunPage:
    """Everything the run page shows: nine indexed queries, none of which grows with the history."""
    low = max(0, run.cursor - STEPS_BEFORE_CURSOR)
    high = low + STEP_WINDOW
    steps = list(
        Step.objects.filter(run=run, position__gte=low, position__lt=high)
        .defer("context")
        .order_by("position", "id")[: STEP_WINDOW * 2]
    )
    last_committed = (
        Step.objects.live()
        .filter(run=run, status=StepStatus.DONE)
        .order_by("-position")
        .only("step_id", "position", "finished_at", "run_id")
        .first()
    )
    in_flight = list(Effect.objects.filter(run=run, status=EffectStatus.PENDING).select_related("step")[:20])
    retries = list(Event.objects.filter(run=run, kind="step_retry").order_by("-id")[:RETRIES_READ])[::-1]
    turns = list(
        Turn.objects.filter(run=run)
        .select_related("step")
        .defer("step__context", "step__result")
        .order_by("-id")[:TURNS_SHOWN]
    )
    effects = list(
        Effect.objects.filter(run=run)
        .select_related("step", "compensates", "compensation")
        .defer("step__context", "step__result")
        .order_by("-id")[:EFFECTS_SHOWN]
    )
    events = list(Event.objects.filter(run=run).order_by("-id")[:EVENTS_SHOWN])
    waits = list(
        Wait.objects.filter(run=run)
        .select_related("step")
        .defer("step__context", "step__result")
        .order_by("-id")[:WAITS_SHOWN]
    )
    shown = {step.step_id for step in steps}
    origin = run.started_at or run.created_at
    timeline = render_timeline(
        steps,
        [
            Retry(e.step_id, e.created_at, int(e.detail.get("attempt") or 0), _error_line(e.detail.get("error")))
            for e in retries
            if e.step_id in shown
        ],
        [
            WaitSpan(w.step.step_id, w.created_at, _wait_end(w), _wait_label(w))
            for w in waits
            if w.step is not None and w.step.step_id in shown
        ],
        now=now,
        origin=origin,
        active=run.status in ACTIVE_RUN_STATUSES,
    )
    try:
        latest_version: int | None = registry.get(run.workflow).version
    except UnknownWorkflowError:
        latest_version = None
    return RunPage(
        run=run,
        now=now,
        stuck=stuck_reason(run, now),
        steps=steps,
        steps_before=low,
        steps_after=max(0, run.step_count - high),
        last_committed=last_committed,
        in_flight=in_flight,
        retries=retries[-RETRIES_LISTED:][::-1],
        retry_count_shown=len(retries),
        turns=[(t, as_text(_transcript(t.content)), as_text(t.tool_results)) for t in reversed(turns)],
        effects=effects[::-1],
        events=[(e, as_text(e.detail)) for e in reversed(events)],
        timeline=timeline,
        latest_version=latest_version,
        waits=waits,
    )


def _wait_end(wait: Wait) -> datetime | None:
    if wait.status == WaitStatus.OPEN:
        return None
    return wait.decided_at or wait.updated_at


def _wait_label(wait: Wait) -> str:
    parts = [f"{wait.kind} {wait.name}".strip(), wait.status]
    if wait.deadline:
        parts.append(f"deadline {wait.deadline:%Y-%m-%d %H:%M} UTC")
    if wait.decided_by:
        parts.append(f"decided by {wait.decided_by}")
    return ", ".join(parts)


def _error_line(error: Any) -> str:
    if isinstance(error, dict):
        return f"{error.get('type', 'Error')}: {error.get('message', '')}"
    return str(error or "")


def _transcript(content: Any) -> str:
    """A model turn as readable text: its text blocks, and each tool call as name(arguments)."""
    if not isinstance(content, list):
        return json.dumps(content, default=str, ensure_ascii=False)
    lines = []
    for block in content:
        if not isinstance(block, dict):
            lines.append(str(block))
        elif block.get("type") == "text":
            lines.append(str(block.get("text", "")))
        elif block.get("type") == "tool_use":
            args = json.dumps(block.get("input", {}), default=str, ensure_ascii=False)
            lines.append(f"→ {block.get('name')}({args})")
        else:
            lines.append(json.dumps(block, default=str, ensure_ascii=False))
    return "\n".join(lines)
