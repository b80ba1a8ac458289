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
                "head": null | {"model", "system", "tools", "thinking", "output_config"}},
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

    cohort = api.save_cohort("refunds-nov", workflow="refund_agent", status="completed", sample=200, seed=7)
    replay = api.replay(cohort="refunds-nov", candidate={"model": "claude-sonnet-4-5"}, budget_usd=5)
    report = api.replay_report(replay.id)      # once its runs have finished (or run_here(replay.id) first)
    assert report.passed(fail_under=0.95)
"""

from __future__ import annotations

import json
import math
import random
import statistics
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.db.models import Q

from durable_agents.agents.capabilities import ModelChoice, thinking_param
from durable_agents.agents.messages import TURN
from durable_agents.engine.admission import admit_on_commit
from durable_agents.engine.payloads import load_result
from durable_agents.engine.replaying import DIVERGED, canonical
from durable_agents.engine.runs import start_run
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
from durable_agents.tools import tools
from durable_agents.workflows import registry

SCHEMA = "durable_agents.recording/1"
LANES = ("baseline", "candidate")
OBSERVED = "observed"
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
        entry: dict[str, Any] = {"name": step.name, "step_id": step.step_id, "kind": step.kind, "status": step.status}
        if step.status in (StepStatus.DONE, StepStatus.SUPERSEDED) and (step.result is not None or step.result_ref):
            entry["result"] = (
                load_result(step.result_ref, step.result_hash, run_id=run.id) if step.result_ref else (step.result)
            )
        if step.frozen_request:
            entry["head"] = {
                k: step.frozen_request[k]
                for k in ("model", "system", "tools", "thinking", "output_config")
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
    """Real finished runs by ids, workflow, status and creation time; `sample` of them at random (by `seed`)."""
    query = Run.objects.filter(replay_lane="", status__in=FINISHED_RUN_STATUSES)
    if runs:
        ids = [_uuid(r) for r in runs]
        query = query.filter(pk__in=ids)
    if workflow:
        query = query.filter(workflow=workflow)
    if status:
        query = query.filter(status__in=[status] if isinstance(status, str) else list(status))
    if since:
        query = query.filter(created_at__gte=since)
    if until:
        query = query.filter(created_at__lt=until)
    chosen = list(query.order_by("created_at", "id"))
    if runs and len(chosen) < len(set(runs)):
        found = {str(r.id) for r in chosen}
        missing = [str(r) for r in runs if str(r) not in found]
        raise InvalidInputError(
            f"{len(missing)} of the runs named are not finished real runs of this database (first: {missing[0]}); "
            "only a finished run can be replayed"
        )
    if sample is not None:
        if sample < 1:
            raise InvalidInputError("the sample size must be at least 1")
        if sample < len(chosen):
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
    with transaction.atomic():
        if Cohort.objects.filter(name=name).exists():
            raise InvalidInputError(f"a cohort named {name!r} exists; choose another name")
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
    unknown = set(candidate) - set(CANDIDATE_FIELDS)
    if unknown:
        raise InvalidInputError(f"unknown candidate field(s) {sorted(unknown)}; use {', '.join(CANDIDATE_FIELDS)}")
    out = {k: v for k, v in candidate.items() if v not in (None, "", {})}
    if "participant" in out:
        from durable_agents.agents.participants import participants  # noqa: PLC0415 - the registry, at call time

        participants.get(out["participant"])  # UnknownParticipantError names the registered ones
    descriptions = out.get("tool_descriptions", {})
    if not isinstance(descriptions, dict) or not all(isinstance(v, str) for v in descriptions.values()):
        raise InvalidInputError("tool_descriptions maps a tool name to its new description")
    instructions = out.get("instructions")
    if instructions is not None and not isinstance(instructions, str | dict):
        raise InvalidInputError("instructions is a system prompt, or {step name: system prompt}")
    if out.get("model") or "thinking" in out or out.get("effort"):
        choice = ModelChoice(out.get("model"), thinking_param(out.get("thinking")), out.get("effort"), 8192)
        problem = choice.problem(choice.resolved_model) if out.get("model") else None
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
    **selection: Any,
) -> Replay:
    """Replay a cohort (by name), or the runs `selection` picks (saved as a new cohort first), in each lane.

    `candidate`: any of model, participant, instructions, tool_descriptions, thinking, effort. `stubs`: tool name
    → the result that answers a call the recording never made (else such a call ends that replay). `budget_usd`:
    what the whole replay may spend; `concurrency`: its runs in flight at once (default 100).
    """
    lanes = tuple(dict.fromkeys(lanes))
    if not lanes or not set(lanes) <= set(LANES):
        raise InvalidInputError(f"lanes are {' and '.join(LANES)} (the observed lane is the recording itself)")
    checked = check_candidate(candidate or {})
    if "candidate" in lanes and not checked:
        raise InvalidInputError("the candidate changes nothing: give it a model, participant, instructions, ...")
    limit = int(concurrency or DEFAULT_CONCURRENCY)
    if limit < 1:
        raise InvalidInputError("concurrency must be at least 1")
    budget = Decimal(str(budget_usd)) if budget_usd is not None else None
    if budget is not None and not budget > 0:
        raise InvalidInputError("a replay budget must be a positive amount of dollars")
    if cohort is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        chosen = save_cohort(f"replay-{stamp}-{uuid.uuid4().hex[:6]}", seed=seed, **selection)
    elif selection:
        raise InvalidInputError("name a cohort or choose runs, not both")
    else:
        chosen = get_cohort(cohort)
    with transaction.atomic():
        made = Replay.objects.create(
            cohort=chosen,
            candidate=checked,
            stubs=dict(stubs or {}),
            budget_usd=budget,
            seed=seed,
            created_by=actor,
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


def run_here(replay_id: uuid.UUID | str, *, max_advances: int = 10_000) -> None:
    """Advance the replay's runs in this process until each has finished: for CI without workers. Each run is
    advanced by the engine as a worker would, one at a time."""
    from durable_agents.engine.admission import admit  # noqa: PLC0415 - only this path needs it
    from durable_agents.engine.advance import Outcome, advance  # noqa: PLC0415

    replay_obj = get_replay(replay_id)
    ids = list(ReplayRun.objects.filter(replay=replay_obj).values_list("run_id", flat=True))
    for _ in range(max_advances):
        admit(f"durable-replay:{replay_obj.id}")
        live = list(
            Run.objects.filter(pk__in=ids).exclude(status__in=FINISHED_RUN_STATUSES).exclude(Q(admitted_at=None))
        )
        if not live and not Run.objects.filter(pk__in=ids).exclude(status__in=FINISHED_RUN_STATUSES).exists():
            return
        for run in live:
            if advance(run.id) is Outcome.SKIPPED:
                continue
    raise InvalidInputError(f"replay {replay_obj.id} did not finish within {max_advances} rounds")


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
    same_calls: bool = True
    same_outcome: bool = True
    first_divergence: int | None = None
    diverged: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.status in FINISHED_RUN_STATUSES

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


@dataclass
class Report:
    replay_id: str
    cohort: str
    candidate: dict[str, Any]
    cases: list[Case]
    lanes: dict[str, LaneSummary] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(lane.finished for case in self.cases for lane in case.lanes.values())

    def changed_most(self, limit: int = 10, lane: str = "candidate") -> list[Case]:
        changed = [c for c in self.cases if lane in c.lanes and not c.lanes[lane].agrees]
        return sorted(changed, key=lambda c: c.change(lane), reverse=True)[:limit]

    def verdict(self, fail_under: float) -> tuple[bool, str]:
        """The CI verdict: (passed, why)."""
        if not self.finished:
            return False, "the replay has not finished"
        candidate = self.lanes.get("candidate")
        if candidate is None or candidate.agreement is None:
            return False, "the replay has no candidate lane to judge"
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
    # Positions of each run's calls whose (recorded) answer was an error: they changed nothing then either.
    errors_by_run: dict[Any, set[int]] = {rid: set() for rid in run_ids}
    answered: dict[Any, int] = dict.fromkeys(run_ids, 0)
    turns = Turn.objects.filter(run_id__in=run_ids, purpose=TURN).order_by("run_id", "step_id", "index")
    for run_id, content, results in turns.values_list("run_id", "content", "tool_results"):
        for block in content or ():
            if block.get("type") == "tool_use":
                calls_by_run[run_id].append((block.get("name"), canonical(block.get("input") or {})))
        for result in results or ():
            if result.get("is_error"):
                errors_by_run[run_id].add(answered[run_id])
            answered[run_id] += 1
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
            errors_by_run[link.run_id],
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
    calls = [(c["name"], canonical(c.get("input") or {})) for c in data.get("tool_calls") or ()]
    effectful = [
        (c["name"], canonical(c.get("input") or {}))
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
    )


def _lane(
    name: str,
    run_id: Any,
    run: Run | None,
    calls: list[tuple[str, str]],
    answered_errors: set[int],
    scores: list[float] | None,
    divergence: dict[str, Any] | None,
    observed: Lane,
) -> Lane:
    if run is None:
        return Lane(
            name,
            str(run_id),
            "pruned",
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
    effectful = [c for i, c in enumerate(calls) if c[0] in effectful_names and i not in answered_errors]
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
        diverged=divergence,
    )
    lane.same_calls = calls == observed.calls
    lane.first_divergence = None if lane.same_calls else _first_difference(calls, observed.calls)
    lane.same_outcome = run.status == observed.status and effectful == observed.effectful
    return lane


def _first_difference(a: list[Any], b: list[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _summary(name: str, lanes: list[Lane]) -> LaneSummary:
    finished = [lane for lane in lanes if lane.finished]
    agree = sum(1 for lane in finished if lane.agrees)
    low, high = wilson(agree, len(finished))
    costs = [lane.cost_usd for lane in finished]
    seconds = [lane.seconds for lane in finished if lane.seconds is not None]
    scores = [lane.judge_score for lane in finished if lane.judge_score is not None]
    total_cost = sum(costs, Decimal(0))
    return LaneSummary(
        lane=name,
        runs=len(lanes),
        finished=len(finished),
        agree=agree,
        agreement=agree / len(finished) if finished else None,
        low=low,
        high=high,
        diverged=sum(1 for lane in finished if lane.diverged),
        cost_usd=total_cost,
        mean_cost_usd=(total_cost / len(costs)).quantize(Decimal("0.000001")) if costs else None,
        tokens=sum(lane.tokens for lane in finished),
        median_seconds=statistics.median(seconds) if seconds else None,
        mean_judge_score=round(statistics.fmean(scores), 4) if scores else None,
    )


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float | None, float | None]:
    """The Wilson score interval of a proportion (95 % by default); (None, None) for no trials."""
    if n == 0:
        return None, None
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


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
