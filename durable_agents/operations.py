"""What operators can ask and do, shared by the management commands and the admin: find, list, show, act on batches."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models import Count, QuerySet

from durable_agents import api, clock, tracing
from durable_agents.compensations import compensations, saga_progress
from durable_agents.conf import settings
from durable_agents.engine.admission import queue_position
from durable_agents.engine.plans import version_drift as drifted_runs
from durable_agents.engine.records import get_run
from durable_agents.engine.sweep import SweepReport
from durable_agents.engine.sweep import sweep as _sweep
from durable_agents.errors import (
    BatchRefusedError,
    DurableAgentsError,
    InvalidInputError,
    InvalidTransitionError,
    RunNotFoundError,
)
from durable_agents.models import (
    ACTIVE_RUN_STATUSES,
    Effect,
    EffectStatus,
    ReplayRun,
    Run,
    RunStatus,
    Schedule,
    Step,
    StepStatus,
    Wait,
    WaitStatus,
)
from durable_agents.replays import LANES as REPLAY_LANES
from durable_agents.replays import get_replay
from durable_agents.search import check_filters, parse_filter
from durable_agents.storable import check_text, shown, whole_number

# The admin and the demo print a run id's first 8 characters; 6 keep a typo from matching a run by chance.
MIN_PREFIX = 6
AMBIGUOUS_SHOWN = 3
HEX_RE = re.compile(r"^[0-9a-f]+$")


def resolve_run_id(text: uuid.UUID | str) -> str:
    """A run id, or the first characters of one (6 or more, dashes optional) → the id of the one run it names.

    `resolve_run_id("3f9c2a1b")` is the full id ("3f9c2a1b-…") of the only run whose id starts so. A whole UUID
    comes back as written canonically, without a query (the action that follows says if no run has it). Too
    short, no match or several matches are a RunNotFoundError whose one line says what to give instead.
    """
    if isinstance(text, uuid.UUID):
        return str(text)
    try:
        return str(uuid.UUID(text))
    except (ValueError, TypeError, AttributeError):
        pass
    given = text.strip() if isinstance(text, str) else ""
    digits = given.replace("-", "").lower()
    if not HEX_RE.match(digits) or len(digits) > 32:
        raise RunNotFoundError(
            f"no run has id {shown(text)}; give a run id or its first {MIN_PREFIX}+ characters "
            "(list runs with `manage.py durable_runs`)"
        )
    if len(digits) < MIN_PREFIX:
        raise RunNotFoundError(
            f"run id prefix {shown(given)} is too short: give at least {MIN_PREFIX} characters of the id "
            "(list runs with `manage.py durable_runs`)"
        )
    matches = list(_ids_starting_with(digits)[: AMBIGUOUS_SHOWN + 1])
    if not matches:
        raise RunNotFoundError(
            f"no run has an id starting with {shown(given)}; list runs with `manage.py durable_runs`"
        )
    if len(matches) > 1:
        some = ", ".join(str(m) for m in matches[:AMBIGUOUS_SHOWN])
        more = ", …" if len(matches) > AMBIGUOUS_SHOWN else ""
        raise RunNotFoundError(
            f"run id prefix {shown(given)} matches several runs ({some}{more}); give more characters"
        )
    return str(matches[0])


def _ids_starting_with(digits: str) -> QuerySet[Run, uuid.UUID]:
    # A prefix is a range of UUIDs, [prefix000…, next prefix000…): a scan of the primary key index, where a
    # LIKE on the id cast to text would read every run. UUIDs order as their hex digits (bytewise on Postgres,
    # as 32-character strings on SQLite).
    shift = 4 * (32 - len(digits))
    low = int(digits, 16) << shift
    high = (int(digits, 16) + 1) << shift
    ids = Run.objects.filter(id__gte=uuid.UUID(int=low))
    if high < 1 << 128:  # a prefix of all f's has no upper bound
        ids = ids.filter(id__lt=uuid.UUID(int=high))
    return ids.order_by("id").values_list("id", flat=True)


def find_run(text: uuid.UUID | str) -> Run:
    """The run an operator named by its id or by a unique prefix of it (see `resolve_run_id`)."""
    return get_run(resolve_run_id(text))


def list_runs(*, limit: int | str = 100, **filters: Any) -> QuerySet[Run]:
    """Runs, newest first, filtered as an operator asks (`runs_matching`). `limit` is 1 or more (a count, not an
    index)."""
    limit = whole_number(limit, "--limit (how many runs to list)", low=1)
    return runs_matching(**filters).order_by("-created_at")[:limit]


def runs_matching(
    *,
    status: str | None = None,
    workflow: str | None = None,
    stuck: bool = False,
    older_than: timedelta | None = None,
    version_drift: bool = False,
    parent: str | None = None,
    search: Mapping[str, str] | None = None,
    replays: bool = False,
    lane: str | None = None,
    replay: str | None = None,
) -> QuerySet[Run]:
    """The runs an operator's filters pick: `parent` (a run id or unique prefix) lists that run's children;
    `search` ({field: value}) those whose search attributes hold every value given. Replay runs are left out
    unless `replays`, a `lane` (baseline, candidate) or a `replay` (its id) asks for them."""
    if workflow:
        check_text(workflow, "--workflow")
    runs = drifted_runs() if version_drift else Run.objects.all()
    if status:
        if status not in RunStatus.values:
            raise InvalidInputError(f"unknown status {status!r}; choose from {', '.join(RunStatus.values)}")
        runs = runs.filter(status=status)
    if workflow:
        runs = runs.filter(workflow=workflow)
    if parent:
        runs = runs.filter(parent_id=find_run(parent).id)
    if search:
        runs = runs.matching_search(check_filters(search))
    if lane:
        if lane not in REPLAY_LANES:
            raise InvalidInputError(f"unknown lane {shown(lane)}; choose from {', '.join(REPLAY_LANES)}")
        runs = runs.filter(replay_lane=lane)
    if replay:
        runs = runs.filter(pk__in=ReplayRun.objects.filter(replay=get_replay(replay)).values("run_id"))
    if not (replays or lane or replay):
        runs = runs.filter(replay_lane="")
    now = clock.now()
    if stuck:
        runs = runs.stuck(now=now, stuck_after=timedelta(seconds=float(settings.STUCK_AFTER_SECONDS)))
    if older_than is not None:
        runs = runs.filter(created_at__lt=now - older_than)
    return runs


def hidden_replay_runs(**filters: Any) -> int:
    """How many replay runs `runs_matching(**filters)` leaves out (0 when the filters ask for replay runs)."""
    if filters.get("replays") or filters.get("lane") or filters.get("replay"):
        return 0
    replay_runs = ReplayRun.objects.values("run_id")
    if not replay_runs.exists():
        return 0
    # Through the replay table, not `replay_lane <> ''`: no index holds the lane, and most runs are real.
    return runs_matching(**{**filters, "replays": True}).filter(pk__in=replay_runs).count()


def search_filters(texts: Iterable[str]) -> dict[str, str]:
    """`--search field=value` options (each once or more) as the filters `list_runs` takes."""
    filters: dict[str, str] = {}
    for text in texts:
        parsed = parse_filter(text)
        if parsed is None:
            raise InvalidInputError(f"--search takes field=value, e.g. --search order_id=A-1001; got {shown(text)}")
        field, value = parsed
        filters[field] = value
    return check_filters(filters)


CHILDREN_SHOWN = 50


def family_of(run: Run) -> dict[str, Any]:
    """A run's parent (the run, step and index that started it) and its children: counts by status, the first few."""
    parent = {"id": str(run.parent_id), "step_id": run.parent_step, "index": run.child_index} if run.parent_id else None
    children = Run.objects.filter(parent_id=run.id)
    counts = {row["status"]: row["n"] for row in children.order_by().values("status").annotate(n=Count("id"))}
    shown_children = children.order_by("parent_step", "child_index").values(
        "id", "parent_step", "child_index", "status"
    )[:CHILDREN_SHOWN]
    return {
        "parent": parent,
        "children": {
            "count": sum(counts.values()),
            "by_status": counts,
            "runs": [
                {"id": str(c["id"]), "step_id": c["parent_step"], "index": c["child_index"], "status": c["status"]}
                for c in shown_children
            ],
        },
    }


def run_summary(run: Run) -> dict[str, Any]:
    """One run's row. Steps are numbered from 1 as the admin shows them: `step_number` is the step the run is at
    (None once its plan is done); `cursor` stays the 0-based plan index JSON consumers already read."""
    return {
        "id": str(run.id),
        "workflow": run.workflow,
        "version": run.workflow_version,
        "status": run.status,
        "cursor": run.cursor,
        "step_number": run.cursor + 1 if run.cursor < run.step_count else None,
        "steps": run.step_count,
        "idempotency_key": run.idempotency_key,
        "concurrency_key": run.concurrency_key,
        "search": run.search,
        "replay_lane": run.replay_lane or None,
        "created_at": _iso(run.created_at),
        "updated_at": _iso(run.updated_at),
        "finished_at": _iso(run.finished_at),
        "error": run.error,
    }


def summarize_runs(runs: Iterable[Run]) -> list[dict[str, Any]]:
    """`run_summary` of each run, plus `open_wait` ({id, kind, name}, or None): the id `durable_decide` takes."""
    runs = list(runs)
    waiting = [run.id for run in runs if run.status == RunStatus.WAITING]
    # One query for the page, on the one-open-wait-per-run index, however many runs wait.
    waits = Wait.objects.filter(run_id__in=waiting, status=WaitStatus.OPEN).only("id", "run_id", "kind", "name")
    open_waits = {wait.run_id: wait for wait in waits} if waiting else {}
    return [{**run_summary(run), "open_wait": _wait_brief(open_waits.get(run.id))} for run in runs]


def _wait_brief(wait: Wait | None) -> dict[str, Any] | None:
    return {"id": wait.pk, "kind": wait.kind, "name": wait.name} if wait else None


def replay_of(run: Run) -> dict[str, Any] | None:
    """A replay run's replay, lane and recording (None for a real run): its tool calls were answered from the
    recording and it applied nothing (engine/replaying.py)."""
    if not run.replay_lane:
        return None
    link = ReplayRun.objects.select_related("recording__cohort").filter(run_id=run.id).first()
    if link is None:
        return dict.fromkeys(("id", "cohort", "recording", "position", "source_run"), None) | {"lane": run.replay_lane}
    recording = link.recording
    return {
        "id": str(link.replay_id),
        "lane": link.lane,
        "cohort": recording.cohort.name,
        "recording": recording.pk,
        "position": recording.position,
        "source_run": str(recording.source_run_id) if recording.source_run_id else None,
    }


def concurrency_note(run: Run, position: int | None = None) -> str:
    """Where the run stands on its concurrency key, for the console ("" without one), e.g. "waiting for
    concurrency key 'customer-42' (position 2): it starts when a run holding the key ends". `position`: the
    run's place in its key's queue, if known (else one query for a queued run)."""
    key = run.concurrency_key
    if key is None:
        return ""
    if run.is_queued:
        position = position or queue_position(run)
        holders = (
            "the run holding the key ends"
            if run.concurrency_limit == 1
            else f"one of the {run.concurrency_limit} runs holding the key ends"
        )
        return f"waiting for concurrency key {key!r} (position {position}): it starts when {holders}"
    if run.admitted_at is None:
        return f"concurrency key {key!r}: not admitted"
    if run.is_finished:
        return f"ran under concurrency key {key!r} (released)"
    return f"holds concurrency key {key!r} (limit {run.concurrency_limit})"


def is_executing(step: Step, run: Run) -> bool:
    """Whether a worker executes `step` now: the run's cursor, under a held lease. The engine writes the step's
    row only when the attempt ends (a claim is one statement on the run), so its row still reads pending."""
    return (
        run.status == RunStatus.RUNNING
        and bool(run.lease_owner)
        and run.cursor < run.step_count
        and step.position == run.cursor
        and step.status != StepStatus.SUPERSEDED
    )


def step_status_shown(step: Step, run: Run) -> str:
    """A step's status as the run page and `durable_show` both say it: an executing step is running (its row
    reads pending), a step left waiting by a cancelled run was cancelled with it (its row stays waiting so a
    resume re-asks)."""
    if is_executing(step, run):
        return StepStatus.RUNNING
    if step.status == StepStatus.WAITING and run.status == RunStatus.CANCELLED:
        return "cancelled"
    return step.status


def describe_run(run_id: uuid.UUID | str, *, events: int = 200) -> dict[str, Any]:
    """Everything an operator needs about one run (its id or a unique prefix): the row, its steps, its history."""
    run = find_run(run_id)
    steps = Step.objects.filter(run=run).order_by("position", "id")
    history = list(run.events.order_by("-id")[:events])[::-1]
    effects = list(run.effects.select_related("step", "compensates", "compensation").order_by("id"))
    undoing = compensations(run, effects)
    saga = saga_progress(run, undoing)
    return {
        **run_summary(run),
        "input": run.input,
        "output": run.output,
        "lease": {
            "owner": run.lease_owner,
            "token": run.lease_token,
            "expires_at": _iso(run.lease_expires_at),
        },
        "attempt": run.attempt,
        # The run's OpenTelemetry trace ("" when it was started with tracing off), and its page in the viewer.
        "trace": {"id": tracing.trace_id(run.trace_context), "url": tracing.trace_url(run.trace_context)},
        "cancel_requested_at": _iso(run.cancel_requested_at),
        "concurrency": {
            "key": run.concurrency_key,
            "limit": run.concurrency_limit,
            "admitted_at": _iso(run.admitted_at),
            "queue_position": queue_position(run),
            "note": concurrency_note(run),
        },
        "usage": {
            "input_tokens": run.input_tokens,
            "output_tokens": run.output_tokens,
            "cache_write_tokens": run.cache_write_tokens,
            "cache_read_tokens": run.cache_read_tokens,
            "cost_usd": str(run.cost_usd),
            "token_budget": run.token_budget,
            "cost_budget_usd": str(run.cost_budget_usd) if run.cost_budget_usd is not None else None,
        },
        "step_rows": [
            {
                "step_id": s.step_id,
                "name": s.name,
                "kind": s.kind,
                "position": s.position,
                "number": s.position + 1,
                "status": step_status_shown(s, run),
                "row_status": s.status,
                "attempts": max(s.attempts, run.attempt) if is_executing(s, run) else s.attempts,
                "started_at": _iso(s.started_at),
                "finished_at": _iso(s.finished_at),
                "duration_ms": _ms(s),
                "error": s.error,
                "result_ref": s.result_ref,
                "tokens": {
                    "input": s.input_tokens,
                    "output": s.output_tokens,
                    "cache_write": s.cache_write_tokens,
                    "cache_read": s.cache_read_tokens,
                },
                "cost_usd": str(s.cost_usd),
            }
            for s in steps
        ],
        "finish_as": run.finish_as,
        "saga": saga.text if saga else None,
        "replay": replay_of(run),
        **family_of(run),
        "effects": [
            {
                "key": e.idempotency_key,
                "tool": e.tool,
                "kind": e.kind,
                "status": e.status,
                "attempts": e.attempts,
                "step_id": e.step.step_id if e.step else None,
                "compensates": e.compensates.idempotency_key if e.compensates else None,
                "applied_at": _iso(e.applied_at),
                "next_attempt_at": _iso(e.next_attempt_at),
                "error": e.error,
                "needs_attention": e.needs_attention,
                "skipped": skip_reason(e),
                "compensation": (
                    {"state": c.state, "text": c.text, "by": c.by or None}
                    if (c := undoing.get(e.idempotency_key))
                    else None
                ),
            }
            for e in effects
        ],
        "waits": [
            {
                "id": w.pk,
                "kind": w.kind,
                "name": w.name,
                "status": w.status,
                "question": w.question,
                "brief": w.brief,
                "deadline": _iso(w.deadline),
                "reminders_sent": w.reminders_sent,
                "decided_by": w.decided_by,
                "decided_at": _iso(w.decided_at),
                "decision": w.decision,
            }
            for w in run.waits.order_by("id")
        ],
        # Its model turns sent with delivery="batch": the request and answer stay out (the conversation so far).
        "batch_turns": [
            {
                "step_id": b.step.step_id,
                "index": b.index,
                "purpose": b.purpose,
                "status": b.status,
                "custom_id": b.custom_id,
                "batch": (b.batch.provider_id or f"#{b.batch.pk}") if b.batch else None,
                "batch_status": b.batch.status if b.batch else None,
                "created_at": _iso(b.created_at),
                "ended_at": _iso(b.ended_at),
                "deadline": _iso(b.deadline),
                "cost_usd": str(b.cost_usd),
            }
            for b in run.batch_turns.select_related("step", "batch").defer("params", "result").order_by("id")
        ],
        "events": [
            {
                "at": _iso(e.created_at),
                "kind": e.kind,
                "step_id": e.step_id,
                "actor": e.actor,
                "detail": e.detail,
            }
            for e in history
        ],
    }


def skip_reason(effect: Effect) -> str | None:
    """Why a `skipped` notification was not sent ("no recipients", "wait 7 is already approved"), else None."""
    if effect.status != EffectStatus.SKIPPED:
        return None
    return (effect.result or {}).get("skipped") if isinstance(effect.result, dict) else None


def _iso(value: Any) -> str | None:
    return value.isoformat() if value else None


def _ms(step: Step) -> float | None:
    if step.started_at and step.finished_at:
        return round((step.finished_at - step.started_at).total_seconds() * 1000, 3)
    return None


def sweep() -> SweepReport:
    """One sweep pass, as celery beat runs it: wake lost runs, settle cancellations, apply wait deadlines."""
    return _sweep()


def list_schedules() -> list[dict[str, Any]]:
    """Every schedule as `durable_schedules` shows it: timing and policies, next slot (UTC), last run, paused (and
    who paused or resumed it last, when), slots skipped for overlapping a live run, last error, and where code
    declares it ("setting", "workflow"; None: made with api.schedule)."""
    return [
        {
            "name": schedule.name,
            "workflow": schedule.workflow,
            "cron": schedule.cron,
            "timezone": schedule.timezone,
            "missed": schedule.missed,
            "overlap": schedule.overlap,
            "overlap_skipped": schedule.overlap_skipped,
            "paused": schedule.paused,
            "paused_changed_by": schedule.paused_changed_by,
            "paused_changed_at": _iso(schedule.paused_changed_at),
            "next_slot": _iso(schedule.next_slot),
            "last_slot": _iso(schedule.last_slot),
            "last_run": str(schedule.last_run_id) if schedule.last_run_id else None,
            "last_error": schedule.last_error,
            "declared": schedule.declared or None,
        }
        for schedule in Schedule.objects.order_by("name")
    ]


# --- Batches: all or nothing ---------------------------------------------------------------------------------

# The states each batch operation accepts; the engine enforces them again, atomically, for each run.
CANCELLABLE = ACTIVE_RUN_STATUSES
RESUMABLE = (RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.PENDING, RunStatus.RUNNING)


def cancel_runs(
    run_ids: Iterable[uuid.UUID | str], *, reason: str = "", compensate: bool = False, actor: str = ""
) -> list[Run]:
    """Cancel every run of the batch, or none: see `act_on_all`."""

    def refusal(run: Run) -> str | None:
        if run.status in CANCELLABLE:
            return None
        return f"run {run.id} is already {run.status}; there is nothing to cancel"

    return act_on_all(
        run_ids, "cancel", refusal, lambda run: api.cancel(run.id, reason, compensate=compensate, actor=actor)
    )


def resume_runs(run_ids: Iterable[uuid.UUID | str], *, actor: str = "") -> list[Run]:
    """Resume (or re-wake) every run of the batch, or none: see `act_on_all`."""

    def refusal(run: Run) -> str | None:
        if run.status in RESUMABLE:
            return None
        hint = "pass --from-step to run again from a step" if run.status == RunStatus.COMPLETED else "decide its wait"
        return f"run {run.id} is {run.status}; only failed or cancelled runs resume ({hint})"

    return act_on_all(run_ids, "resume", refusal, lambda run: api.resume(run.id, actor=actor))


def act_on_all(
    run_ids: Iterable[uuid.UUID | str],
    verb: str,
    refusal: Callable[[Run], str | None],
    act: Callable[[Run], Run],
) -> list[Run]:
    """Check every run first (its id or prefix names one, its state allows `verb`), then act on all in one transaction.

    A batch with bad ids changes nothing and names each bad id with its reason. A run that changes between
    the check and the action (a race with a worker or another operator) rolls the whole batch back: the
    error names that run and says that none of the others changed either. A batch of one is simply the
    operation, with its own error.
    """
    given = list(run_ids)
    if len(given) == 1:
        return [act(find_run(given[0]))]
    runs: dict[uuid.UUID, Run] = {}
    problems: list[str] = []
    for run_id in given:
        try:
            run = find_run(run_id)
        except DurableAgentsError as exc:
            problems.append(str(exc))
            continue
        why = refusal(run)
        if why:
            problems.append(why)
        runs.setdefault(run.id, run)  # the same run named twice is acted on once
    if problems:
        raise BatchRefusedError(f"nothing changed: {'; '.join(problems)}", problems=problems)
    done: list[Run] = []
    with transaction.atomic():
        for run in runs.values():
            # A state error now means the run changed since its check (a race). Other domain errors (a bad
            # --as or --reason) are about the arguments: they roll the batch back too, and say so as they are.
            try:
                done.append(act(run))
            except (InvalidTransitionError, RunNotFoundError) as exc:
                raise _raced(verb, run, exc, [r for r in runs.values() if r.id != run.id]) from exc
    return done


def _raced(verb: str, run: Run, exc: DurableAgentsError, others: list[Run]) -> BatchRefusedError:
    left = f"; the other runs ({', '.join(str(r.id) for r in others)}) were not changed either" if others else ""
    return BatchRefusedError(
        f"nothing changed: run {run.id} changed between the check and the {verb}: {exc}{left}; look and retry",
        problems=[str(exc)],
    )
