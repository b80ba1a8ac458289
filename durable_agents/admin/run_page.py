"""What the run page shows, read in a fixed number of queries whatever the run's history length.

The troubleshooting answers come first (last committed step, in-flight effect, retry history, version),
then the timeline, steps, turns (those answered in a Message Batch marked as batch-priced), the run's Message Batch
turns, effects and events. Long histories are windowed: the steps around the
cursor, the latest turns, effects and events.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.db.models import Count
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from durable_agents import tracing
from durable_agents.admin.filters import stuck_cause, stuck_reason
from durable_agents.admin.statuses import wait_badge, wait_status_text
from durable_agents.admin.timeline import (
    Attempt,
    EffectMark,
    History,
    Retry,
    Stuck,
    WaitSpan,
    human_duration,
    render_timeline,
)
from durable_agents.compensations import (
    IN_FLIGHT,
    NOT_COMPENSABLE,
    NOT_COMPENSATED,
    UNDONE,
    Compensation,
    SagaProgress,
    compensations,
    saga_progress,
)
from durable_agents.decisions import AskedAgain, asked_again
from durable_agents.display import ago_text, coarse_duration, when_text
from durable_agents.engine.admission import holding
from durable_agents.errors import UnknownWorkflowError
from durable_agents.models import (
    ACTIVE_RUN_STATUSES,
    BatchTurn,
    Effect,
    EffectKind,
    EffectStatus,
    Event,
    ProcessHeartbeat,
    Run,
    RunStatus,
    Step,
    StepStatus,
    Turn,
    Wait,
    WaitStatus,
)
from durable_agents.operations import concurrency_note, is_executing, step_status_shown
from durable_agents.states import BatchTurnStatus
from durable_agents.workflows import registry

# Steps shown: this many plan positions, most of them before the cursor (where problems are).
STEP_WINDOW = 200
STEPS_BEFORE_CURSOR = 150
TURNS_SHOWN = 50
BATCH_TURNS_SHOWN = 50
EFFECTS_SHOWN = 200
EVENTS_SHOWN = 200
WAITS_SHOWN = 50
CHILDREN_SHOWN = 50
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


@dataclass(frozen=True)
class Failure:
    """A failed attempt of a step, from its `step_retry` or `failed` event: kept after a retry clears the
    step's error."""

    event: Event
    attempt: int
    error: str
    retried: bool


@dataclass(frozen=True)
class RunningStep:
    """The step a worker executes now: the run's cursor under a held lease. The engine writes the step row
    only when the attempt ends (a claim is one statement on the run), so this is read from the run."""

    step: Step
    attempt: int
    worker: str
    started: datetime | None
    lease_expires_at: datetime | None
    expired_for: str  # "" while the lease is live
    # The heartbeat of the worker the lease names (None: never seen), how long ago it was heard from, and
    # whether it was heard from after the lease ran out.
    node_seen: ProcessHeartbeat | None = None
    node_seen_ago: str = ""  # "just now", "12s ago"
    node_alive: bool = False

    @property
    def number(self) -> int:
        return self.step.position + 1

    @property
    def node(self) -> str:
        """The worker the lease names, without the pid of the process that holds it."""
        return self.worker.rpartition(":")[0] or self.worker


@dataclass(frozen=True)
class StepRow:
    """A row of the steps table: the step as the history tells it, not only as its row was last written."""

    step: Step
    result: Text
    status: str
    attempts: int
    started: datetime | None
    failures: list[Failure]
    # Each of the step's effects with what its compensation has come to, once a saga concerns it.
    undone: list[Compensation]
    # Attempts whose worker died holding the step, each with what it applied: "attempt 1 killed after applying
    # issue_refund".
    lost: list[Attempt] = field(default_factory=list)


@dataclass
class RunPage:
    run: Run
    now: datetime
    stuck: str
    # The system's likely cause when the run is stuck ("" otherwise), as the overview names it.
    stuck_cause: str
    steps: list[Step]
    # Where the run stands on its concurrency key ("" without one): why a pending run has not started.
    concurrency: str
    steps_before: int
    steps_after: int
    last_committed: Step | None
    in_flight: list[Effect]
    retries: list[Failure]
    retry_count_shown: int
    turns: list[tuple[Turn, Text, Text]]
    effects: list[Effect]
    events: list[tuple[Event, Text]]
    timeline: str
    latest_version: int | None
    # The run's waits, newest first; an open one is approved or rejected with the run's decide actions.
    waits: list[Wait] = field(default_factory=list)
    running: RunningStep | None = None
    failed_count_shown: int = 0
    # By step row (pk): a superseded row keeps the failures and killed attempts it had before a re-plan.
    failures: dict[int | None, list[Failure]] = field(default_factory=dict)
    attempts_by_row: dict[int | None, list[Attempt]] = field(default_factory=dict)
    # Child runs: the parent that started this run, and this run's children (counts by status, the first few).
    parent: Run | None = None
    children: list[Run] = field(default_factory=list)
    children_by_status: dict[str, int] = field(default_factory=dict)
    # Concurrency key: for a queued run, the runs holding its key; for a holder, the queue behind it.
    key_holders: list[Run] = field(default_factory=list)
    queued_behind: int = 0
    next_in_queue: Run | None = None
    # By effect key: what each effect's compensation has come to; and, while the run compensates, how far.
    compensations: dict[str, Compensation] = field(default_factory=dict)
    saga: SagaProgress | None = None
    # By wait id: an approval asked again because the run re-planned after it was given (and the earlier one).
    asked_again: dict[int, AskedAgain] = field(default_factory=dict)
    # The run's model turns sent with delivery="batch" (the latest BATCH_TURNS_SHOWN, oldest first), with their batches.
    batch_turns: list[BatchTurn] = field(default_factory=list)

    @property
    def trace_url(self) -> str:
        """The run's trace in the operators' viewer (`TRACE_URL`); "" when unset or the run was started untraced."""
        return tracing.trace_url(self.run.trace_context)

    @property
    def trace_id(self) -> str:
        return tracing.trace_id(self.run.trace_context)

    @property
    def batch_priced(self) -> set[int]:
        """The journaled turns (pks) answered in a Message Batch, priced at batch prices: a batch answer is journaled
        with its request's custom id as the turn's request id."""
        answered = {b.custom_id for b in self.batch_turns if b.status == BatchTurnStatus.SUCCEEDED}
        return {turn.pk for turn, _, _ in self.turns if turn.request_id in answered}

    @property
    def batch_turn_rows(self) -> list[tuple[BatchTurn, str, str]]:
        """Each batch turn with its age (how long it has waited, or how long its batch took to end it) and when it
        was journaled, as text."""
        return [(b, batch_turn_age(b, self.now), when_text(b.created_at)) for b in self.batch_turns]

    @property
    def effect_rows(self) -> list[tuple[Effect, Compensation | None]]:
        return [(e, self.compensations.get(e.idempotency_key)) for e in self.effects]

    @property
    def compensating_now(self) -> list[Compensation]:
        return [c for c in self.compensations.values() if c.state == IN_FLIGHT]

    @property
    def children_count(self) -> int:
        return sum(self.children_by_status.values())

    @property
    def failed_child(self) -> Run | None:
        """The first failed child among those shown (a fan-out's error names it; the page links it)."""
        return next((child for child in self.children if child.status == RunStatus.FAILED), None)

    @property
    def open_wait(self) -> Wait | None:
        if self.run.is_finished:
            return None
        return next((w for w in self.waits if w.status == WaitStatus.OPEN), None)

    @property
    def open_wait_asked_again(self) -> AskedAgain | None:
        wait = self.open_wait
        return self.asked_again.get(wait.pk) if wait is not None else None

    @property
    def wait_rows(self) -> list[tuple[Wait, str, str]]:
        """Each wait with the status to show (a wait still open on a finished run went with it; a met join is
        joined) and its badge."""
        return [(w, text, wait_badge(text, w)) for w in self.waits for text in [wait_status_text(w, self.run)]]

    @property
    def next_step(self) -> Step | None:
        return next(
            (s for s in self.steps if s.position == self.run.cursor and s.status != StepStatus.SUPERSEDED), None
        )

    @property
    def total_tokens(self) -> int:
        run = self.run
        return run.input_tokens + run.output_tokens + run.cache_write_tokens + run.cache_read_tokens

    @property
    def step_rows(self) -> list[StepRow]:
        return [self._step_row(step) for step in self.steps]

    def _step_row(self, step: Step) -> StepRow:
        live = step.status != StepStatus.SUPERSEDED
        failures = list(self.failures.get(step.pk, []))
        if step.status == StepStatus.FAILED and failures and not failures[-1].retried:
            failures.pop()  # the step's own error says it
        told = [self.compensations.get(e.idempotency_key) for e in self.effects if e.step_id == step.pk and live]
        # A saga names what it leaves in place; without one, only the effects a compensation concerns.
        undone = [c for c in told if c and c.state != NOT_COMPENSATED and (self.saga or c.state != NOT_COMPENSABLE)]
        status = _step_status(step, self.run, undone)
        drawn = self.attempts_by_row.get(step.pk, [])
        lost = [a for a in drawn if a.outcome == "killed"]
        seen = max([f.attempt for f in self.failures.get(step.pk, [])] + [a.number for a in drawn], default=0)
        attempts, started = max(step.attempts, seen), step.started_at
        if self.running is not None and self.running.step.pk == step.pk:
            status, attempts, started = StepStatus.RUNNING, self.running.attempt, self.running.started or started
        return StepRow(step, as_text(step.result), status, attempts, started, failures, undone, lost)


HISTORY_KINDS = ("step_retry", "failed", "lease_takeover", "swept")
BATCH_TURN_FIELDS = (
    "run_id",
    "step__step_id",
    "index",
    "purpose",
    "custom_id",
    "model",
    "status",
    "deadline",
    "used",
    "cost_usd",
    "created_at",
    "submitted_at",
    "ended_at",
    "batch__provider_id",
    "batch__status",
    "batch__request_count",
    "batch__created_at",
    "batch__ended_at",
)


def build_run_page(run: Run, *, now: datetime) -> RunPage:
    """Everything the run page shows: ten indexed queries, none of which grows with the history."""
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
    # A compensating effect in flight is told with its compensation (compensating_now), from the saga's step.
    in_flight = list(
        Effect.objects.filter(run=run, status=EffectStatus.PENDING)
        .exclude(kind=EffectKind.COMPENSATION)
        .select_related("step")[:20]
    )
    # Retries, failures, takeovers and sweeps: every attempt that did not end in the step's row.
    history = list(Event.objects.filter(run=run, kind__in=HISTORY_KINDS).order_by("-id")[:RETRIES_READ])[::-1]
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
    # Its request and answer stay out of the page: a batch turn's request is the whole conversation so far.
    batch_turns = list(
        BatchTurn.objects.filter(run=run)
        .select_related("step", "batch")
        .only(*BATCH_TURN_FIELDS)
        .order_by("-id")[:BATCH_TURNS_SHOWN]
    )
    failures = [_failure(e) for e in history if e.kind in ("step_retry", "failed")]
    row_of = RowOf.of(steps)
    by_row: dict[int | None, list[Failure]] = defaultdict(list)
    for failure in failures:
        by_row[row_of(failure.event.step_id, _moment(_detail(failure.event).get("started_at")))].append(failure)
    running = _running_step(run, steps, now)
    drawn = _history(run, steps, history, waits, effects[::-1], running, now)
    attempts_by_row: dict[int | None, list[Attempt]] = defaultdict(list)
    for attempt in drawn.attempts:
        attempts_by_row[attempt.row].append(attempt)
    timeline = render_timeline(
        steps,
        drawn,
        now=now,
        origin=run.started_at or run.created_at,
        active=run.status in ACTIVE_RUN_STATUSES,
    )
    states = compensations(run, effects)
    try:
        latest_version: int | None = registry.get(run.workflow).version
    except UnknownWorkflowError:
        latest_version = None
    stuck = stuck_reason(run, now)
    return RunPage(
        run=run,
        now=now,
        stuck=stuck,
        stuck_cause=stuck_cause(now) if stuck else "",
        concurrency=concurrency_note(run),
        steps=steps,
        steps_before=low,
        steps_after=max(0, run.step_count - high),
        last_committed=last_committed,
        in_flight=in_flight,
        retries=failures[-RETRIES_LISTED:][::-1],
        retry_count_shown=sum(f.retried for f in failures),
        failed_count_shown=sum(not f.retried for f in failures),
        failures=dict(by_row),
        attempts_by_row=dict(attempts_by_row),
        turns=[(t, as_text(_transcript(t.content)), as_text(t.tool_results)) for t in reversed(turns)],
        effects=effects[::-1],
        events=[(e, as_text(e.detail)) for e in reversed(events)],
        timeline=timeline,
        latest_version=latest_version,
        waits=waits,
        running=running,
        compensations=states,
        saga=saga_progress(run, states),
        asked_again=asked_again(waits, runs=[run.pk]),
        batch_turns=batch_turns[::-1],
        **_family(run),
        **_key_queue(run),
    )


def batch_turn_age(turn: BatchTurn, now: datetime) -> str:
    """ "waiting 12 min" while in flight; "ended after 40 min" once its result (or its abandonment) came."""
    if turn.ended_at is None:
        return f"waiting {coarse_duration((now - turn.created_at).total_seconds())}"
    return f"ended after {coarse_duration((turn.ended_at - turn.created_at).total_seconds())}"


def _family(run: Run) -> dict[str, Any]:
    """Three queries: the parent, this run's children by status, and the first CHILDREN_SHOWN of them."""
    parent = Run.objects.filter(pk=run.parent_id).first() if run.parent_id else None
    kids = Run.objects.filter(parent_id=run.id)
    by_status = {row["status"]: row["n"] for row in kids.order_by().values("status").annotate(n=Count("id"))}
    shown = list(kids.order_by("parent_step", "child_index")[:CHILDREN_SHOWN]) if by_status else []
    return {"parent": parent, "children": shown, "children_by_status": by_status}


def _key_queue(run: Run) -> dict[str, Any]:
    """A queued run waits for the runs holding its key (one query); a run holding a key has a queue behind
    it (two queries: how many, and the next). Nothing for a run without a key or one that has released it."""
    key = run.concurrency_key
    if key is None or run.is_finished:
        return {}
    if run.is_queued:
        held = Run.objects.filter(holding(key)).order_by("admitted_at", "id")
        return {"key_holders": list(held.only("id", "workflow", "status", "concurrency_key")[:5])}
    queue = Run.objects.queued().filter(concurrency_key=key)
    behind = queue.count()
    following = queue.order_by("created_at", "id").only("id", "workflow", "status").first() if behind else None
    return {"queued_behind": behind, "next_in_queue": following}


def _running_step(run: Run, steps: list[Step], now: datetime) -> RunningStep | None:
    """The live step under the cursor of a run a worker holds (or held: its lease may have run out)."""
    step = next((s for s in steps if is_executing(s, run)), None)
    if step is None:
        return None
    expires = run.lease_expires_at
    expired = expires is not None and expires < now
    node = run.lease_owner.rpartition(":")[0] or run.lease_owner
    seen = (
        ProcessHeartbeat.objects.filter(kind=ProcessHeartbeat.Kind.WORKER, hostname=node).order_by("-last_seen").first()
    )
    return RunningStep(
        step=step,
        attempt=run.attempt,
        worker=run.lease_owner,
        started=run.claimed_at,
        lease_expires_at=expires,
        expired_for=coarse_duration((now - expires).total_seconds()) if expired and expires else "",
        node_seen=seen,
        node_seen_ago=ago_text(seen.last_seen, now) if seen else "",
        # Heard from since the lease ran out: the worker lives and only the process holding the lease is silent.
        node_alive=seen is not None and expires is not None and seen.last_seen > expires,
    )


@dataclass(frozen=True)
class RowOf:
    """Which row of a step id a moment of its history belongs to. A re-plan keeps the superseded rows under
    the same step id: what began before a row was superseded (its `updated_at`) is that row's, later the live
    row's. None: the step is outside the page's window."""

    superseded: dict[str, list[Step]]
    live: dict[str, int]

    @classmethod
    def of(cls, steps: list[Step]) -> RowOf:
        superseded: dict[str, list[Step]] = defaultdict(list)
        for step in sorted(steps, key=lambda s: s.pk):
            if step.status == StepStatus.SUPERSEDED:
                superseded[step.step_id].append(step)
        return cls(dict(superseded), {s.step_id: s.pk for s in steps if s.status != StepStatus.SUPERSEDED})

    def __call__(self, step_id: str, moment: datetime | None) -> int | None:
        if moment is not None:
            for step in self.superseded.get(step_id, ()):
                if moment <= step.updated_at:
                    return step.pk
        return self.live.get(step_id)


def _history(
    run: Run,
    steps: list[Step],
    events: list[Event],
    waits: list[Wait],
    effects: list[Effect],
    running: RunningStep | None,
    now: datetime,
) -> History:
    """What the timeline draws besides the steps' rows: every attempt the events and the run's lease tell,
    each on the row (live or superseded) it belongs to, saying which effects it applied."""
    row_of = RowOf.of(steps)
    attempts: list[Attempt] = []
    stuck: list[Stuck] = []
    for event in events:
        if event.kind in ("step_retry", "failed"):
            detail = _detail(event)
            began = _moment(detail.get("started_at"))
            row = row_of(event.step_id, began)
            if began is not None and row is not None:
                note = _error_line(detail.get("error")) + (", retried" if event.kind == "step_retry" else "")
                attempt = _number(detail.get("attempt"))
                ended = event.created_at
                attempts.append(Attempt(event.step_id, attempt, min(began, ended), ended, "failed", note=note, row=row))
        elif event.kind == "lease_takeover":
            attempts_stuck = _taken_over(event)
            row = row_of(event.step_id, attempts_stuck[0].began) if attempts_stuck else None
            if attempts_stuck is not None and row is not None:
                attempts.append(replace(attempts_stuck[0], row=row))
                stuck.append(replace(attempts_stuck[1], row=row))
    attempts = [replace(a, did=_applied_during(a, effects)) for a in attempts]
    # An attempt never ends before it begins on the drawing, whatever clocks wrote its times.
    if running is not None and running.started is not None:
        step_id, expires = running.step.step_id, running.lease_expires_at
        if running.expired_for and expires is not None:
            attempts.append(
                Attempt(
                    step_id,
                    running.attempt,
                    min(running.started, expires),
                    expires,
                    "lease expired",
                    running.worker,
                    f"its lease ran out at {when_text(expires)}; the worker is presumed dead",
                    row=running.step.pk,
                )
            )
            stuck.append(
                Stuck(
                    step_id,
                    expires,
                    now,
                    f"stuck {running.expired_for}: the lease of {running.worker} expired at {when_text(expires)} "
                    "and no worker has taken the run over (is the sweep, celery beat, running?)",
                    row=running.step.pk,
                )
            )
        else:
            began = min(running.started, now)  # a claim stamped after this page's now (clocks apart) began by now
            attempts.append(
                Attempt(step_id, running.attempt, began, now, "running", running.worker, row=running.step.pk)
            )
    return History(
        retries=[
            Retry(
                e.step_id,
                e.created_at,
                _number(_detail(e).get("attempt")),
                _error_line(_detail(e).get("error")),
                row=row_of(e.step_id, e.created_at),
            )
            for e in events
            if e.kind == "step_retry"
        ],
        waits=[
            WaitSpan(w.step.step_id, w.created_at, _wait_end(w, run), _wait_label(w, run), row=w.step.pk)
            for w in waits
            if w.step is not None
        ],
        attempts=attempts,
        stuck=stuck,
        effects=[
            EffectMark(e.step.step_id, e.applied_at or e.created_at, _effect_label(e), row=e.step.pk)
            for e in effects
            if e.step is not None
        ],
    )


def _applied_during(attempt: Attempt, effects: list[Effect]) -> str:
    """`after applying issue_refund`: the effects of the attempt's row applied while it held the step. An
    attempt that died after an effect landed did not do nothing; the re-executed step reuses that effect."""
    tools = [
        e.tool
        for e in effects
        if e.step_id == attempt.row
        and e.kind == EffectKind.EFFECT
        and e.status in (EffectStatus.APPLIED, EffectStatus.COMPENSATED)
        and attempt.began <= (e.applied_at or e.created_at) <= attempt.ended
    ]
    return f"after applying {', '.join(dict.fromkeys(tools))}" if tools else ""


def _taken_over(event: Event) -> tuple[Attempt, Stuck] | None:
    """A takeover's dead attempt (claimed, lease out) and the stretch until the takeover nobody worked."""
    detail = _detail(event)
    began, expired = _moment(detail.get("previous_claimed_at")), _moment(detail.get("previous_expires_at"))
    if began is None or expired is None:
        return None  # recorded before takeovers kept the dead attempt's times
    owner = str(detail.get("previous_owner") or "")
    number = _number(detail.get("attempt"))
    waited = human_duration((event.created_at - expired).total_seconds())
    return (
        Attempt(
            event.step_id,
            number,
            began,
            max(expired, began),
            "killed",
            owner,
            f"its lease ran out at {when_text(expired)}; taken over at {when_text(event.created_at)}",
        ),
        Stuck(
            event.step_id,
            expired,
            max(event.created_at, expired),
            f"stuck {waited}: the lease of {owner} expired at {when_text(expired)}, "
            f"taken over at {when_text(event.created_at)}",
        ),
    )


def _failure(event: Event) -> Failure:
    detail = _detail(event)
    return Failure(event, _number(detail.get("attempt")), _error_line(detail.get("error")), event.kind == "step_retry")


# An event's detail is any JSON: written by an older version, by hand, or damaged. The page reads what it can
# of it and draws nothing from the rest, rather than failing for the one operator who needs it.


def _detail(event: Event) -> dict[str, Any]:
    return event.detail if isinstance(event.detail, dict) else {}


def _moment(value: Any) -> datetime | None:
    """A moment the engine wrote as ISO text; None if missing or not a moment. Without a zone: UTC."""
    if not isinstance(value, str):
        return None
    try:
        moment = parse_datetime(value)
    except ValueError:  # well-formed but impossible, e.g. February 30th
        return None
    if moment is not None and settings.USE_TZ and timezone.is_naive(moment):
        return moment.replace(tzinfo=UTC)
    return moment


def _number(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def _step_status(step: Step, run: Run, undone: list[Compensation]) -> str:
    """The status to show: a skipped step whose effects a saga undid was compensated; a step left waiting
    by a cancelled run was cancelled with it (the engine keeps its row waiting so a resume re-asks)."""
    if step.status == StepStatus.SKIPPED and any(c.state in UNDONE for c in undone):
        return "compensated"
    return step_status_shown(step, run)


def _effect_label(effect: Effect) -> str:
    parts = [
        f"{effect.tool} {effect.status}",
        f"key {effect.idempotency_key}",
        f"invoked {when_text(effect.created_at)}",
    ]
    if effect.applied_at:
        parts.append(f"applied {when_text(effect.applied_at)}")
    return ", ".join(parts)


def _wait_end(wait: Wait, run: Run) -> datetime | None:
    if wait.status == WaitStatus.OPEN:
        return run.finished_at if run.is_finished else None
    return wait.decided_at or wait.updated_at


def _wait_label(wait: Wait, run: Run) -> str:
    parts = [f"{wait.kind} {wait.name}".strip(), wait_status_text(wait, run)]
    if wait.deadline:
        parts.append(f"deadline {when_text(wait.deadline)}")
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
