"""The replay lab: try a candidate model, participant, prompt or tool text on recorded runs before you switch.

A **cohort** is a named set of recordings: runs chosen from the journal (ids, workflow, status, a time range, a
sample of them with a seed), each frozen as a recording, or cases imported from a dataset (JSON lines, the schema
below). A **replay** of a cohort starts, for each recording, one replay run per lane:

* **observed** — the recording itself: nothing runs;
* **baseline** — the recorded model and prompts asked again: the model's own run-to-run noise;
* **candidate** — the same with the candidate's changes (model, participant, instructions, tool descriptions,
  thinking, effort).

A replay run is a run of the recorded workflow version that applies nothing (engine/replaying.py): its model steps
ask the lane's model; every tool call is answered from the recording (same tool, same arguments, in order); a call
the recording never made is a divergence, recorded, answered by a stub or ending that replay; its other steps return
their recorded results; it opens no wait, so no approval reaches a person. Replay runs hold their own concurrency
key (`durable-replay:<replay id>`, `concurrency` at a time), never a real run's; the metrics of real runs leave them
out; the console, `durable_runs` and `durable_show` mark them.

The **report** compares each lane with the observed one, run by run — the same tool calls (names and arguments), the
first divergence, the same outcome (final status and the effectful calls), the judge's score, tokens, cost and time
— and over the cohort: each lane's agreement with the observed lane (a 95 % Wilson interval), cost and time deltas,
and the runs that changed most. `passed(fail_under)` is the CI verdict: the candidate's agreement is at least
`fail_under` and not below the baseline's interval.

Recording schema (`durable_agents.recording/1`, one JSON object a line in an export)::

    {"schema": "durable_agents.recording/1", "workflow": "refund_agent", "version": 1, "input": {...},
     "source_run": "<uuid>" | null, "status": "completed", "output": ..., "error": null,
     "steps": [{"name": "load_order", "step_id": "load_order", "kind": "call", "status": "done", "result": ...,
                "args": {}, "head": null | {"model", "system", "tools", "prompt", "thinking", "output_config"}},
               ...],
     "turns": [{"step": "resolve", "purpose": "turn", "model": "...", "participant": "...", "content": [...],
                "stop_reason": "tool_use", "tool_results": [...] | null, "input_tokens": 0, "output_tokens": 0,
                "cost_usd": "0.001200"}, ...],
     "tool_calls": [{"step": "resolve", "name": "issue_refund", "input": {...}, "result": "<tool_result content>",
                     "is_error": false, "effectful": true}, ...],
     "verdicts": [{"step": "review_email", "passed": true, "score": 0.9, "reasons": "..."}],
     "usage": {"input_tokens": 0, "output_tokens": 0, "cost_usd": "0.0012"}, "seconds": 4.2}

`steps` holds every plan row that ran, in order (a redone step appears once per execution; `result` only where one
was committed); `turns` every journaled model call; `tool_calls` each tool_use of an agent turn with the result the
model read. An imported case needs `workflow`, `version`, `input` and `tool_calls` at least.

Example::

    from durable_agents import api

    cohort = api.save_cohort("refunds-nov", workflow="refund_agent", sample=200, seed=7)
    replay = api.replay(cohort="refunds-nov", candidate={"model": "claude-sonnet-4-5"}, budget_usd=5)
    report = api.replay_report(replay.id)      # once its runs have finished (or run_here(replay.id) first)
    assert report.passed(fail_under=0.95)
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction

from durable_agents import clock
from durable_agents.agents import batcher
from durable_agents.agents.capabilities import ModelChoice, shape_problem, thinking_param
from durable_agents.agents.messages import TURN
from durable_agents.agents.participants import participants
from durable_agents.conf import settings
from durable_agents.engine.admission import admit, admit_on_commit
from durable_agents.engine.advance import advance
from durable_agents.engine.payloads import load_result
from durable_agents.engine.replaying import DIVERGED, call_key
from durable_agents.engine.starts import start_run
from durable_agents.errors import (
    CohortNotFoundError,
    InvalidInputError,
    ReplayNotFoundError,
    UnknownToolError,
    UnknownWorkflowError,
)
from durable_agents.models import (
    Cohort,
    Event,
    Recording,
    Replay,
    ReplayRun,
    Run,
    Step,
    StepKind,
    Turn,
)
from durable_agents.states import FINISHED_RUN_STATUSES, RunStatus, StepStatus
from durable_agents.storable import decimal_amount, shown, whole_number
from durable_agents.tools import tools
from durable_agents.workflows import registry

SCHEMA = "durable_agents.recording/1"
LANES = ("baseline", "candidate")
OBSERVED = "observed"
PRUNED = "pruned"
CANDIDATE_FIELDS = ("model", "participant", "instructions", "tool_descriptions", "thinking", "effort")
DEFAULT_CONCURRENCY = 100
Z95 = 1.959964


# ---- recordings -----------------------------------------------------------------------------------------------


def record(run: Run) -> dict[str, Any]:
    """A run as a recording (the schema above): what a replay answers from, and what an export writes."""
    steps = list(Step.objects.filter(run_id=run.id).order_by("pk"))
    turns = list(Turn.objects.filter(run_id=run.id).select_related("step").order_by("step_id", "index"))
    recorded_steps = []
    for step in steps:
        entry: dict[str, Any] = {
            "name": step.name,
            "step_id": step.step_id,
            "kind": step.kind,
            "status": step.status,
            "args": step.args or {},
        }
        if step.status in (StepStatus.DONE, StepStatus.SUPERSEDED) and (step.result is not None or step.result_ref):
            entry["result"] = (
                load_result(step.result_ref, step.result_hash, run_id=run.id) if step.result_ref else (step.result)
            )
        if step.frozen_request:
            entry["head"] = {
                k: step.frozen_request[k]
                for k in ("model", "system", "tools", "prompt", "thinking", "output_config")
                if k in step.frozen_request
            }
        recorded_steps.append(entry)
    recorded_turns, calls = [], []
    for turn in turns:
        recorded_turns.append(
            {
                "step": turn.step.name,
                "purpose": turn.purpose,
                "model": turn.model,
                "participant": turn.participant,
                "content": turn.content,
                "stop_reason": turn.stop_reason,
                "tool_results": turn.tool_results,
                "input_tokens": turn.input_tokens,
                "output_tokens": turn.output_tokens,
                "cost_usd": str(turn.cost_usd),
            }
        )
        if turn.purpose == TURN:
            calls.extend(_calls_of(turn.step.name, turn.content, turn.tool_results))
    verdicts = [
        {"step": s.name, **{k: s.result.get(k) for k in ("passed", "score", "reasons")}}
        for s in steps
        if s.kind == StepKind.JUDGE and isinstance(s.result, dict)
    ]
    return {
        "schema": SCHEMA,
        "workflow": run.workflow,
        "version": run.workflow_version,
        "input": run.input,
        "source_run": str(run.id),
        "status": run.status,
        "output": run.output,
        "error": run.error,
        "steps": recorded_steps,
        "turns": recorded_turns,
        "tool_calls": calls,
        "verdicts": verdicts,
        "usage": {
            "input_tokens": run.input_tokens + run.cache_write_tokens + run.cache_read_tokens,
            "output_tokens": run.output_tokens,
            "cost_usd": str(run.cost_usd),
        },
        "seconds": _seconds(run.started_at, run.finished_at),
    }


def _calls_of(step: str, content: Any, results: Any) -> list[dict[str, Any]]:
    by_id = {r.get("tool_use_id"): r for r in results or () if isinstance(r, dict)}
    calls = []
    for block in content or ():
        if block.get("type") != "tool_use":
            continue
        result = by_id.get(block.get("id"))
        if result is None:
            continue  # never answered (the run stopped before its tools ran): nothing to answer a replay with
        calls.append(
            {
                "step": step,
                "name": block.get("name"),
                "input": block.get("input") or {},
                "result": result.get("content", ""),
                "is_error": bool(result.get("is_error")),
                "effectful": _effectful(block.get("name")),
            }
        )
    return calls


def _effectful(name: Any) -> bool:
    try:
        return tools.get(str(name)).effectful
    except UnknownToolError:
        return False


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return round((end - start).total_seconds(), 3) if start and end else None


# ---- cohorts --------------------------------------------------------------------------------------------------


def select_runs(
    *,
    runs: Sequence[uuid.UUID | str] = (),
    workflow: str | None = None,
    status: str | Sequence[str] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    sample: int | None = None,
    seed: int | None = None,
) -> list[Run]:
    """Real finished runs by ids, workflow, status and creation time; `sample` of them at random (by `seed`). Without
    a `status`, completed and failed runs: a cancelled run stopped where someone stopped it, not where its model did."""
    statuses: Any = (
        [RunStatus.COMPLETED, RunStatus.FAILED] if not status else [status] if isinstance(status, str) else status
    )
    if not isinstance(statuses, list | tuple) or not all(
        isinstance(s, str) and s in FINISHED_RUN_STATUSES for s in statuses
    ):
        raise InvalidInputError(f"status is one of {', '.join(FINISHED_RUN_STATUSES)}: only a finished run replays")
    for moment, what in ((since, "since"), (until, "until")):
        if moment is not None and not isinstance(moment, datetime):
            raise InvalidInputError(f"{what} is a datetime (an aware one), got {shown(moment)}")
    if sample is not None:
        sample = whole_number(sample, "the sample size", low=1)
    if seed is not None:
        seed = whole_number(seed, "the seed")
    query = Run.objects.filter(replay_lane="", status__in=list(statuses))
    if runs:
        ids = [_uuid(r) for r in runs]
        query = query.filter(pk__in=ids)
    if workflow:
        query = query.filter(workflow=workflow)
    if since:
        query = query.filter(created_at__gte=since)
    if until:
        query = query.filter(created_at__lt=until)
    chosen = list(query.order_by("created_at", "id"))
    if runs and len(chosen) < len(set(runs)):
        found = {str(r.id) for r in chosen}
        missing = [str(r) for r in runs if str(r) not in found]
        raise InvalidInputError(
            f"{len(missing)} of the runs named are not {' or '.join(statuses)} real runs of this database (first: "
            f"{missing[0]}); only a finished run replays, a cancelled one only with status cancelled"
        )
    if sample is not None and sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(chosen, sample), key=lambda r: (r.created_at, str(r.id)))
    return chosen


def save_cohort(name: str, *, description: str = "", **selection: Any) -> Cohort:
    """A cohort of the runs `select_runs(**selection)` picks, each frozen as a recording now."""
    name = _cohort_name(name)
    chosen = select_runs(**selection)
    if not chosen:
        raise InvalidInputError("no finished run matches that selection; a cohort needs at least one")
    return _save(name, description, [record(run) for run in chosen])


def _save(name: str, description: str, recordings: list[dict[str, Any]]) -> Cohort:
    taken = InvalidInputError(f"a cohort named {name!r} exists; choose another name")
    if Cohort.objects.filter(name=name).exists():
        raise taken
    try:
        with transaction.atomic():
            return _insert(name, description, recordings)
    except IntegrityError as exc:  # saved at the same moment by someone else
        raise taken from exc


def _insert(name: str, description: str, recordings: list[dict[str, Any]]) -> Cohort:
    cohort = Cohort.objects.create(name=name, description=description)
    Recording.objects.bulk_create(
        Recording(
            cohort=cohort,
            position=i,
            source_run_id=data.get("source_run"),
            workflow=data["workflow"],
            workflow_version=data["version"],
            data=data,
        )
        for i, data in enumerate(recordings)
    )
    return cohort


def get_cohort(name: str) -> Cohort:
    cohort = Cohort.objects.filter(name=name).first()
    if cohort is None:
        raise CohortNotFoundError(f"no cohort is named {name!r}; `durable_replay --cohorts` lists them")
    return cohort


def export_cohort(name: str) -> Iterator[str]:
    """The cohort's recordings as JSON lines (one recording each, the schema above)."""
    cohort = get_cohort(name)
    for data in cohort.recordings.order_by("position").values_list("data", flat=True).iterator(chunk_size=200):
        yield json.dumps(data, cls=DjangoJSONEncoder)


def import_cohort(name: str, lines: Iterable[str], *, description: str = "") -> Cohort:
    """A cohort from JSON lines of recordings (an export, or a dataset from elsewhere); each line is checked."""
    name = _cohort_name(name)
    recordings = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise InvalidInputError(f"line {number} is not JSON ({exc}); each line holds one recording") from exc
        recordings.append(_checked(data, number))
    if not recordings:
        raise InvalidInputError("the file holds no recording; a cohort needs at least one")
    return _save(name, description, recordings)


def _checked(data: Any, number: int) -> dict[str, Any]:
    where = f"line {number}"
    if not isinstance(data, dict):
        raise InvalidInputError(f"{where} is not a JSON object; each line holds one recording")
    if data.get("schema", SCHEMA) != SCHEMA:
        raise InvalidInputError(f"{where}: schema {data.get('schema')!r} is not {SCHEMA!r}")
    for key, kind in (("workflow", str), ("version", int), ("tool_calls", list)):
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            raise InvalidInputError(f"{where}: {key!r} is missing or not a {kind.__name__}")
    if "input" not in data:
        raise InvalidInputError(f"{where}: 'input' is missing")
    try:
        registry.get(data["workflow"], data["version"])
    except UnknownWorkflowError as exc:
        raise InvalidInputError(f"{where}: {exc}; a case replays on the workflow version it names") from exc
    for key, kind in (("steps", list), ("turns", list), ("verdicts", list), ("usage", dict)):
        if key in data and not isinstance(data[key], kind):
            raise InvalidInputError(f"{where}: {key!r} is a JSON {'array' if kind is list else 'object'}")
    for key in ("steps", "turns", "verdicts"):
        if not all(isinstance(item, dict) for item in data.get(key) or ()):
            raise InvalidInputError(f"{where}: each of {key!r} is a JSON object")
    usage = data.get("usage") or {}
    try:
        int(usage.get("input_tokens", 0)), int(usage.get("output_tokens", 0))
        if not Decimal(str(usage.get("cost_usd", "0"))).is_finite():
            raise ValueError
    except (TypeError, ValueError, InvalidOperation):
        raise InvalidInputError(f"{where}: usage holds input_tokens, output_tokens (whole numbers), cost_usd") from None
    for i, verdict in enumerate(data.get("verdicts") or ()):
        if verdict.get("score") is not None and (
            isinstance(verdict["score"], bool) or not isinstance(verdict["score"], int | float)
        ):
            raise InvalidInputError(f"{where}: verdicts[{i}].score is a number from 0 to 1")
    for i, call in enumerate(data["tool_calls"]):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "result" not in call:
            raise InvalidInputError(f"{where}: tool_calls[{i}] needs a 'name', an 'input' and a 'result'")
        call.setdefault("input", {})
        call.setdefault("is_error", False)
        call.setdefault("effectful", _effectful(call["name"]))
    data["schema"] = SCHEMA
    data.setdefault("source_run", None)
    data.setdefault("steps", [])
    data.setdefault("turns", [])
    data.setdefault("verdicts", [])
    data.setdefault("status", RunStatus.COMPLETED)
    return data


def _cohort_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise InvalidInputError("a cohort name must be a non-empty string of at most 200 characters")
    return name.strip()


def _uuid(value: Any) -> uuid.UUID:
    try:
        return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
    except ValueError as exc:
        raise InvalidInputError(f"{value!r} is not a run id") from exc


# ---- replays --------------------------------------------------------------------------------------------------


def check_candidate(candidate: Mapping[str, Any]) -> dict[str, Any]:
    """The candidate as stored: known fields only, its model, thinking and effort checked against the model table."""
    if not isinstance(candidate, Mapping):
        raise InvalidInputError(f"a candidate is a dict of {', '.join(CANDIDATE_FIELDS)}")
    unknown = set(candidate) - set(CANDIDATE_FIELDS)
    if unknown:
        raise InvalidInputError(f"unknown candidate field(s) {sorted(unknown)}; use {', '.join(CANDIDATE_FIELDS)}")
    out = {k: v for k, v in candidate.items() if v not in (None, "", {})}
    for field_name in ("model", "participant", "effort"):
        if field_name in out and not isinstance(out[field_name], str):
            raise InvalidInputError(f"the candidate's {field_name} is a name, got {shown(out[field_name])}")
    if "participant" in out:
        participants.get(out["participant"])  # UnknownParticipantError names the registered ones
    descriptions = out.get("tool_descriptions", {})
    if not isinstance(descriptions, dict) or not all(isinstance(v, str) for v in descriptions.values()):
        raise InvalidInputError("tool_descriptions maps a tool name to its new description")
    instructions = out.get("instructions")
    if instructions is not None and not (
        isinstance(instructions, str)
        or (isinstance(instructions, dict) and all(isinstance(v, str) for v in instructions.values()))
    ):
        raise InvalidInputError("instructions is a system prompt, or {step name: system prompt}")
    if "thinking" in out and not isinstance(out["thinking"], str | dict):
        raise InvalidInputError('thinking is "adaptive", "disabled", ... or the whole field as a dict')
    if out.get("model") or "thinking" in out or out.get("effort"):
        choice = ModelChoice(out.get("model"), thinking_param(out.get("thinking")), out.get("effort"), 8192)
        problem = shape_problem(choice.thinking, choice.effort, choice.max_tokens)
        if problem is None and out.get("model"):
            problem = choice.problem(choice.resolved_model)
        if problem:
            raise InvalidInputError(f"the candidate cannot be asked: {problem}")
    return out


def replay(
    *,
    cohort: str | None = None,
    candidate: Mapping[str, Any] | None = None,
    lanes: Sequence[str] = LANES,
    stubs: Mapping[str, Any] | None = None,
    budget_usd: Decimal | float | str | None = None,
    concurrency: int | None = None,
    actor: str = "",
    seed: int | None = None,
    delivery: str | None = None,
    **selection: Any,
) -> Replay:
    """Replay a cohort (by name), or the runs `selection` picks (saved as a new cohort first), in each lane.

    `candidate`: any of model, participant, instructions, tool_descriptions, thinking, effort. `stubs`: tool name
    → the result that answers a call the recording never made (else such a call ends that replay). `budget_usd`:
    what the whole replay may spend; `concurrency`: its runs in flight at once (default 100). `delivery="batch"`
    sends every model call of its runs through the Message Batches API at half price, each run parked while its
    batch is answered (within 24 h): give it a `concurrency` as large as the cohort, a parked run holds nothing.
    """
    if delivery not in (None, "", "live", "batch"):
        raise InvalidInputError(f'a replay\'s delivery is "live" or "batch", not {delivery!r}')
    lanes = tuple(dict.fromkeys(lanes))
    if not lanes or not set(lanes) <= set(LANES):
        raise InvalidInputError(f"lanes are {' and '.join(LANES)} (the observed lane is the recording itself)")
    checked = check_candidate(candidate or {})
    for name in stubs or {}:
        tools.get(name)  # a stub for no registered tool would answer nothing: UnknownToolError names the tools
    if "candidate" in lanes and not checked:
        raise InvalidInputError("the candidate changes nothing: give it a model, participant, instructions, ...")
    if stubs is not None and not isinstance(stubs, Mapping):
        raise InvalidInputError("stubs map a tool name to the result that answers its unrecorded calls")
    # 0 is refused, not taken for the default.
    limit = DEFAULT_CONCURRENCY if concurrency is None else whole_number(concurrency, "concurrency", low=1)
    budget = None
    if budget_usd is not None:
        budget = decimal_amount(budget_usd, "a replay budget", max_digits=14, decimal_places=6, unit="USD")
        if not budget > 0:
            raise InvalidInputError("a replay budget is a positive amount of dollars, e.g. 5.00")
    if seed is not None:
        seed = whole_number(seed, "the seed")
    if cohort is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        chosen = save_cohort(f"replay-{stamp}-{uuid.uuid4().hex[:6]}", seed=seed, **selection)
    elif selection:
        raise InvalidInputError("name a cohort or choose runs, not both")
    else:
        chosen = get_cohort(cohort)
    _check_names(checked, chosen)
    with transaction.atomic():
        made = Replay.objects.create(
            cohort=chosen,
            candidate=checked,
            stubs=dict(stubs or {}),
            budget_usd=budget,
            seed=seed,
            created_by=actor,
            delivery="batch" if delivery == "batch" else "",
        )
        key = f"durable-replay:{made.id}"
        links = []
        for recording in chosen.recordings.order_by("position"):
            data = recording.data
            for lane in lanes:
                run = start_run(
                    recording.workflow,
                    data.get("input"),
                    version=recording.workflow_version,
                    concurrency_key=key,
                    concurrency_limit=limit,
                    participant=_participant(data, checked if lane == "candidate" else {}),
                    replay_lane=lane,
                    hand_on=False,
                )
                links.append(ReplayRun(run_id=run.id, replay=made, recording=recording, lane=lane))
        ReplayRun.objects.bulk_create(links)
        admit_on_commit(key)  # once for all its runs: an admission reads the key's whole queue
    return made


def _check_names(candidate: dict[str, Any], cohort: Cohort) -> None:
    """A step or tool the candidate names must be one of the cohort's workflows: a typo would leave the candidate the
    baseline, and pass CI while changing nothing."""
    named_steps = set(candidate["instructions"]) if isinstance(candidate.get("instructions"), dict) else set()
    named_tools = set(candidate.get("tool_descriptions") or {})
    if not named_steps and not named_tools:
        return
    steps: set[str] = set()
    tool_names: set[str] = set()
    for name, version in cohort.recordings.values_list("workflow", "workflow_version").distinct():
        for definition in registry.get(name, version).steps:
            steps.add(definition.name)
            spec = definition.options.get("agent")
            tool_names |= {t.name for t in getattr(spec, "tools", ())}
            tool_names |= {t.name for t in definition.options.get("tools", ()) if hasattr(t, "name")}
    if named_steps - steps:
        raise InvalidInputError(
            f"instructions name no step of the cohort's workflows: {', '.join(sorted(named_steps - steps))} "
            f"(its steps: {', '.join(sorted(steps))})"
        )
    if named_tools - tool_names:
        raise InvalidInputError(
            f"tool_descriptions name no tool of the cohort's agents: {', '.join(sorted(named_tools - tool_names))} "
            f"(their tools: {', '.join(sorted(tool_names)) or 'none'})"
        )


def _participant(data: dict[str, Any], candidate: dict[str, Any]) -> str:
    """Who answers a lane's model turns: the candidate's participant, else the one the recording's turns name."""
    if candidate.get("participant"):
        return str(candidate["participant"])
    named = [t.get("participant") for t in data.get("turns") or () if t.get("participant")]
    return str(named[0]) if named else ""


def get_replay(replay_id: uuid.UUID | str) -> Replay:
    try:
        found = Replay.objects.select_related("cohort").filter(pk=_uuid(replay_id)).first()
    except InvalidInputError as exc:
        raise ReplayNotFoundError(f"{replay_id!r} is not a replay id") from exc
    if found is None:
        raise ReplayNotFoundError(f"no replay has the id {replay_id}; `durable_replay --replays` lists them")
    return found


def run_here(replay_id: uuid.UUID | str, *, max_rounds: int = 100_000) -> bool:
    """Advance the replay's runs in this process until each has finished (True), for CI without workers: each run is
    advanced by the engine as a worker would, one after another; a retry's backoff is waited out. False if they had
    not finished after `max_rounds` rounds. A replay with `delivery="batch"` runs the batcher here too while its runs
    wait on their batches (as long as the API takes to answer them)."""
    made = get_replay(replay_id)
    key = f"durable-replay:{made.id}"
    ids = list(ReplayRun.objects.filter(replay=made).values_list("run_id", flat=True))
    for _ in range(max_rounds):
        admit(key)
        live = Run.objects.filter(pk__in=ids).exclude(status__in=FINISHED_RUN_STATUSES)
        rows = list(live.values_list("id", "admitted_at", "wake_at", "status"))
        if not rows:
            return True
        now = clock.now()
        ready = [
            run_id
            for run_id, admitted, wake_at, status in rows
            if admitted and status != RunStatus.WAITING and (wake_at is None or wake_at <= now)
        ]
        if not ready and any(status == RunStatus.WAITING for *_, status in rows):
            # Parked on Message Batches: send, poll and collect them here, at the batcher's own pace.
            if not batcher.run().get("answered"):
                time.sleep(min(float(settings.BATCH_POLL_SECONDS), 5.0))
            continue
        if not ready:
            due = [(wake_at - now).total_seconds() for _, admitted, wake_at, _ in rows if admitted and wake_at]
            time.sleep(min(max(min(due, default=0.1), 0.01), 5.0))
        for run_id in ready:
            advance(run_id)
    return False


# ---- the report -----------------------------------------------------------------------------------------------


@dataclass
class Lane:
    """One lane of one case: the recording (observed) or a replay run."""

    lane: str
    run_id: str | None
    status: str
    calls: list[tuple[str, str]]
    effectful: list[tuple[str, str]]
    judge_score: float | None
    tokens: int
    cost_usd: Decimal
    seconds: float | None
    error: str = ""
    error_type: str = ""
    output: Any = None
    same_calls: bool = True
    # The run's output is the recording's, exactly. Not part of agreement: a model's words differ run to run (the
    # judge's score compares them); a classifier's label or an extracted field shows here.
    same_output: bool = True
    same_outcome: bool = True
    first_divergence: int | None = None
    diverged: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        """Ended, or pruned (it will not end now)."""
        return self.status in FINISHED_RUN_STATUSES or self.status == PRUNED

    @property
    def budget_stopped(self) -> bool:
        """Stopped by the replay's budget before it finished: not judged either way."""
        return self.error_type == "ReplayBudgetExceededError"

    @property
    def agrees(self) -> bool:
        return self.same_calls and self.same_outcome


@dataclass
class Case:
    recording_id: int
    position: int
    source_run: str | None
    lanes: dict[str, Lane]

    def change(self, lane: str = "candidate") -> tuple[int, float]:
        """How much `lane` changed against the observed lane: for sorting, the most changed first."""
        replayed, observed = self.lanes.get(lane), self.lanes[OBSERVED]
        if replayed is None:
            return (0, 0.0)
        divergence = replayed.first_divergence if replayed.first_divergence is not None else len(replayed.calls)
        return (int(not replayed.agrees), -divergence + abs(float(replayed.cost_usd - observed.cost_usd)))


@dataclass
class LaneSummary:
    lane: str
    runs: int
    finished: int
    agree: int
    agreement: float | None
    low: float | None
    high: float | None
    diverged: int
    cost_usd: Decimal
    mean_cost_usd: Decimal | None
    tokens: int
    median_seconds: float | None
    mean_judge_score: float | None
    # Stopped by the replay's budget, or pruned: finished, but judged neither way (`agreement` leaves them out).
    budget_stopped: int = 0
    pruned: int = 0
    same_output: int = 0


@dataclass
class Report:
    """A replay's lanes against the observed one, run by run and over the cohort (`replay_report`, `replay_here`).

    `cases` holds each recorded run with its `lanes`; `lanes` each lane's summary (agreement and its interval,
    divergences, cost, tokens, median time, judge score).
    """

    replay_id: str
    cohort: str
    candidate: dict[str, Any]
    cases: list[Case]
    lanes: dict[str, LaneSummary] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Whether every run of every lane has finished."""
        return all(lane.finished for case in self.cases for lane in case.lanes.values())

    def changed_most(self, limit: int = 10, lane: str = "candidate") -> list[Case]:
        """The `limit` cases whose `lane` disagrees with the recording the most, most changed first."""
        changed = [c for c in self.cases if lane in c.lanes and not c.lanes[lane].agrees]
        return sorted(changed, key=lambda c: c.change(lane), reverse=True)[:limit]

    def verdict(self, fail_under: float) -> tuple[bool, str]:
        """The CI verdict: (passed, why)."""
        if not self.finished:
            return False, "the replay has not finished"
        candidate = self.lanes.get("candidate")
        if candidate is None:
            return False, "the replay has no candidate lane to judge"
        if candidate.budget_stopped:
            return False, (
                f"the replay's budget ran out: {candidate.budget_stopped} candidate runs stopped before they finished; "
                "replay again with a larger budget"
            )
        if candidate.agreement is None:
            return False, "no candidate run can be judged (each was pruned)"
        if candidate.agreement < fail_under:
            return False, f"candidate agreement {candidate.agreement:.1%} is under {fail_under:.1%}"
        baseline = self.lanes.get("baseline")
        if baseline is not None and baseline.low is not None and candidate.agreement < baseline.low:
            return False, (
                f"candidate agreement {candidate.agreement:.1%} is below the baseline's interval "
                f"({baseline.low:.1%}–{baseline.high:.1%}): worse than the recorded model's own noise"
            )
        return True, f"candidate agreement {candidate.agreement:.1%} (at least {fail_under:.1%})"

    def passed(self, fail_under: float) -> bool:
        return self.verdict(fail_under)[0]

    def as_json(self, fail_under: float | None = None) -> dict[str, Any]:
        """The report as JSON-ready data; with `fail_under`, the verdict too."""
        out: dict[str, Any] = {
            "replay": self.replay_id,
            "cohort": self.cohort,
            "candidate": self.candidate,
            "finished": self.finished,
            "lanes": {name: _plain(asdict(summary)) for name, summary in self.lanes.items()},
            "changed_most": [_case_json(c) for c in self.changed_most()],
            "cases": [_case_json(c) for c in self.cases],
        }
        if fail_under is not None:
            passed, why = self.verdict(fail_under)
            out["verdict"] = {"passed": passed, "fail_under": fail_under, "why": why}
        return out


def _case_json(case: Case) -> dict[str, Any]:
    lanes = {}
    for name, lane in case.lanes.items():
        data = _plain(asdict(lane))
        data["calls"] = [{"name": n, "input": json.loads(i)} for n, i in lane.calls]
        data.pop("effectful")
        data["agrees"] = lane.agrees
        lanes[name] = data
    return {"recording": case.recording_id, "position": case.position, "source_run": case.source_run, "lanes": lanes}


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data, cls=DjangoJSONEncoder))


def report(replay_id: uuid.UUID | str) -> Report:
    """Each case in each lane against the observed one, and each lane over the cohort (a few queries in all)."""
    made = get_replay(replay_id)
    links = list(ReplayRun.objects.filter(replay=made).select_related("recording").order_by("recording__position"))
    run_ids = [link.run_id for link in links]
    runs = {r.id: r for r in Run.objects.filter(pk__in=run_ids)}
    calls_by_run: dict[Any, list[tuple[str, str]]] = {rid: [] for rid in run_ids}
    # Calls that changed something if effectful: answered, and not with an error.
    landed_by_run: dict[Any, list[tuple[str, str]]] = {rid: [] for rid in run_ids}
    turns = Turn.objects.filter(run_id__in=run_ids, purpose=TURN).order_by("run_id", "step_id", "index")
    for run_id, content, results in turns.values_list("run_id", "content", "tool_results"):
        answered = {r.get("tool_use_id"): r for r in results or ()}
        for block in content or ():
            if block.get("type") == "tool_use":
                call = (block.get("name"), call_key(block.get("name"), block.get("input") or {}))
                calls_by_run[run_id].append(call)
                result = answered.get(block.get("id"))
                if result is not None and not result.get("is_error"):
                    landed_by_run[run_id].append(call)
    scores: dict[Any, list[float]] = {}
    judged = Step.objects.filter(run_id__in=run_ids, kind=StepKind.JUDGE, status=StepStatus.DONE)
    for run_id, result in judged.values_list("run_id", "result"):
        if isinstance(result, dict) and isinstance(result.get("score"), int | float):
            scores.setdefault(run_id, []).append(float(result["score"]))
    divergences: dict[Any, dict[str, Any]] = {}
    for run_id, step_id, detail in (
        Event.objects.filter(run_id__in=run_ids, kind=DIVERGED)
        .order_by("id")
        .values_list("run_id", "step_id", "detail")
    ):
        divergences.setdefault(run_id, {"step": step_id, **detail})
    cases: dict[int, Case] = {}
    for link in links:
        recording = link.recording
        case = cases.get(recording.pk)
        if case is None:
            case = cases[recording.pk] = Case(
                recording.pk,
                recording.position,
                str(recording.source_run_id or "") or None,
                {OBSERVED: _observed(recording.data)},
            )
        case.lanes[link.lane] = _lane(
            link.lane,
            link.run_id,
            runs.get(link.run_id),
            calls_by_run[link.run_id],
            landed_by_run[link.run_id],
            scores.get(link.run_id),
            divergences.get(link.run_id),
            case.lanes[OBSERVED],
        )
    ordered = sorted(cases.values(), key=lambda c: c.position)
    result = Report(str(made.id), made.cohort.name, dict(made.candidate or {}), ordered)
    for lane in (OBSERVED, *LANES):
        members = [c.lanes[lane] for c in ordered if lane in c.lanes]
        if members:
            result.lanes[lane] = _summary(lane, members)
    return result


def _observed(data: dict[str, Any]) -> Lane:
    calls = [(c["name"], call_key(c["name"], c.get("input") or {})) for c in data.get("tool_calls") or ()]
    effectful = [
        (c["name"], call_key(c["name"], c.get("input") or {}))
        for c in data.get("tool_calls") or ()
        if c.get("effectful") and not c.get("is_error")
    ]
    verdicts = [v["score"] for v in data.get("verdicts") or () if isinstance(v.get("score"), int | float)]
    usage = data.get("usage") or {}
    return Lane(
        lane=OBSERVED,
        run_id=data.get("source_run"),
        status=data.get("status") or RunStatus.COMPLETED,
        calls=calls,
        effectful=effectful,
        judge_score=verdicts[-1] if verdicts else None,
        tokens=int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0)),
        cost_usd=Decimal(str(usage.get("cost_usd", "0"))),
        seconds=data.get("seconds"),
        output=data.get("output"),
    )


def _lane(
    name: str,
    run_id: Any,
    run: Run | None,
    calls: list[tuple[str, str]],
    landed: list[tuple[str, str]],
    scores: list[float] | None,
    divergence: dict[str, Any] | None,
    observed: Lane,
) -> Lane:
    if run is None:
        return Lane(
            name,
            str(run_id),
            PRUNED,
            [],
            [],
            None,
            0,
            Decimal(0),
            None,
            "the replay run was pruned",
            same_calls=False,
            same_outcome=False,
        )
    effectful_names = {n for n, _ in observed.effectful} | {n for n, _ in calls if _effectful(n)}
    effectful = [call for call in landed if call[0] in effectful_names]
    lane = Lane(
        lane=name,
        run_id=str(run.id),
        status=run.status,
        calls=calls,
        effectful=effectful,
        judge_score=scores[-1] if scores else None,
        tokens=run.input_tokens + run.cache_write_tokens + run.cache_read_tokens + run.output_tokens,
        cost_usd=run.cost_usd,
        seconds=_seconds(run.started_at, run.finished_at),
        error=(run.error or {}).get("message", "") if isinstance(run.error, dict) else "",
        error_type=(run.error or {}).get("type", "") if isinstance(run.error, dict) else "",
        diverged=divergence,
    )
    lane.same_calls = calls == observed.calls
    lane.first_divergence = None if lane.same_calls else _first_difference(calls, observed.calls)
    lane.same_outcome = run.status == observed.status and effectful == observed.effectful
    lane.output = run.output
    lane.same_output = _plain({"o": run.output}) == _plain({"o": observed.output})
    return lane


def _first_difference(a: list[Any], b: list[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _summary(name: str, lanes: list[Lane]) -> LaneSummary:
    finished = [lane for lane in lanes if lane.finished]
    judged = [lane for lane in finished if not lane.budget_stopped and lane.status != PRUNED]
    agree = sum(1 for lane in judged if lane.agrees)
    low, high = wilson(agree, len(judged))
    costs = [lane.cost_usd for lane in finished]
    seconds = [lane.seconds for lane in finished if lane.seconds is not None]
    scores = [lane.judge_score for lane in finished if lane.judge_score is not None]
    total_cost = sum(costs, Decimal(0))
    return LaneSummary(
        lane=name,
        runs=len(lanes),
        finished=len(finished),
        agree=agree,
        agreement=agree / len(judged) if judged else None,
        low=low,
        high=high,
        diverged=sum(1 for lane in finished if lane.diverged),
        cost_usd=total_cost,
        mean_cost_usd=(total_cost / len(costs)).quantize(Decimal("0.000001")) if costs else None,
        tokens=sum(lane.tokens for lane in finished),
        median_seconds=statistics.median(seconds) if seconds else None,
        mean_judge_score=round(statistics.fmean(scores), 4) if scores else None,
        budget_stopped=sum(1 for lane in finished if lane.budget_stopped),
        pruned=sum(1 for lane in finished if lane.status == PRUNED),
        same_output=sum(1 for lane in judged if lane.same_output),
    )


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float | None, float | None]:
    """The Wilson score interval of a proportion (95 % by default); (None, None) for no trials."""
    if n == 0:
        return None, None
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return round(max(0.0, centre - half), 6), round(min(1.0, centre + half), 6)


__all__ = [
    "LANES",
    "SCHEMA",
    "Report",
    "check_candidate",
    "export_cohort",
    "get_cohort",
    "get_replay",
    "import_cohort",
    "record",
    "replay",
    "report",
    "run_here",
    "save_cohort",
    "select_runs",
    "wilson",
]
