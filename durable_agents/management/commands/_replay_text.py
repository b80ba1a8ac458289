"""durable_replay's text output: a replay's report (a line per lane, the verdict, the runs that changed most), and
the lists of cohorts and replays."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from django.urls import NoReverseMatch, reverse

from durable_agents.engine.replaying import canonical
from durable_agents.replays import Case, Lane, LaneSummary, Report

CHANGED_SHOWN = 10
CALL_CHARS = 120


def case_path(replay_id: str, recording_id: int) -> str | None:
    """The admin's side-by-side view of one case (None where the admin is not installed)."""
    try:
        return f"{reverse('admin:index')}durable_agents/replay/{replay_id}/case/{recording_id}/"
    except NoReverseMatch:
        return None


def report_json(report: Report, fail_under: float | None) -> dict[str, Any]:
    """Report.as_json, each of the runs that changed most with the admin path of its side-by-side view."""
    data = report.as_json(fail_under)
    for case in data["changed_most"]:
        case["admin_path"] = case_path(report.replay_id, case["recording"])
    return data


def report_lines(report: Report, fail_under: float | None) -> list[str]:
    lines = [f"replay {report.replay_id} of cohort {report.cohort!r}: {len(report.cases)} recordings; {_who(report)}"]
    observed = report.lanes.get("observed")
    for summary in report.lanes.values():
        lines.append(_lane_line(summary, observed))
    if fail_under is None:
        lines.append("verdict: none asked (--fail-under 0.95 gives one)")
    else:
        passed, why = report.verdict(fail_under)
        lines.append(f"verdict: {'passed' if passed else 'FAILED'}: {why}")
    lane = "candidate" if "candidate" in report.lanes else "baseline"
    changed = report.changed_most(CHANGED_SHOWN, lane=lane)
    if not changed:
        agreeing = "agrees with the recording on every finished run" if report.finished else "changed nothing so far"
        lines.append(f"no run changed: the {lane} lane {agreeing}")
        return lines
    lines.append(f"changed most ({lane} lane against the recording):")
    for case in changed:
        lines.extend(_case_lines(report, case, lane))
    return lines


def _who(report: Report) -> str:
    if not report.candidate:
        return "no candidate (baseline only)"
    parts = [f"{k} {_brief(v, 60)}" for k, v in report.candidate.items()]
    return "candidate: " + ", ".join(parts)


def _lane_line(summary: LaneSummary, observed: LaneSummary | None) -> str:
    head = f"  {summary.lane:<10}"
    if summary.finished < summary.runs:
        head += f" {summary.finished}/{summary.runs} finished so far;"
    if summary.lane == "observed":
        agreement = f" {summary.runs} recordings"
    elif summary.agreement is None:
        agreement = " agree -"
    else:
        agreement = (
            f" agree {summary.agree}/{summary.finished} ({summary.agreement:.1%}, "
            f"95% interval {summary.low:.1%}–{summary.high:.1%})  diverged {summary.diverged}"
        )
    cost = f"  cost ${summary.cost_usd:.6f}"
    if observed is not None and summary.lane != "observed":
        cost += f" ({_signed(summary.cost_usd - observed.cost_usd)} vs observed)"
    median = f"{summary.median_seconds:.2f} s" if summary.median_seconds is not None else "-"
    judge = f"{summary.mean_judge_score:.2f}" if summary.mean_judge_score is not None else "-"
    return f"{head}{agreement}{cost}  tokens {summary.tokens}  median {median}  judge mean {judge}"


def _signed(amount: Decimal) -> str:
    return f"{'+' if amount >= 0 else '-'}${abs(amount):.6f}"


def _case_lines(report: Report, case: Case, lane_name: str) -> list[str]:
    lane, observed = case.lanes[lane_name], case.lanes["observed"]
    which = f"run {case.source_run}" if case.source_run else f"case #{case.position + 1} (imported)"
    line = f"  {which}: {lane_name} {lane.status}"
    if lane.status != observed.status:
        line += f", observed {observed.status}"
    if lane.same_calls and not lane.same_outcome:
        line += "; the same calls, another outcome"
    said_divergence = False
    if lane.first_divergence is not None:
        line += f"; first divergence at call {lane.first_divergence + 1}: {_differs(lane, observed)}"
        made = lane.calls[lane.first_divergence] if lane.first_divergence < len(lane.calls) else None
        if lane.diverged and made is not None and _is_call(lane.diverged, made):
            line += f", {_answered(lane.diverged)}"
            said_divergence = True
    lines = [line]
    if lane.diverged and not said_divergence:
        lines.append(f"    {_diverged(lane.diverged)}")
    elif lane.error and not lane.diverged:
        lines.append(f"    error: {_brief(lane.error, 200)}")
    path = case_path(report.replay_id, case.recording_id)
    if path:
        lines.append(f"    side by side: {path}")
    return lines


def _differs(lane: Lane, observed: Lane) -> str:
    """The first call that differs, by the arguments that differ when the tool is the same."""
    i = lane.first_divergence or 0
    made = lane.calls[i] if i < len(lane.calls) else None
    recorded = observed.calls[i] if i < len(observed.calls) else None
    if made is None:
        return f"no call where the recording has {_call(recorded)}" if recorded else "no call"
    if recorded is None:
        return f"{_call(made)}, beyond the recording's {len(observed.calls)} calls"
    if made[0] == recorded[0]:
        now, then = json.loads(made[1]), json.loads(recorded[1])
        if isinstance(now, dict) and isinstance(then, dict):
            keys = sorted(k for k in now.keys() | then.keys() if now.get(k, MISSING) != then.get(k, MISSING))
            changed = ", ".join(f"{k} {_value(now, k)} (recorded {_value(then, k)})" for k in keys)
            return f"{made[0]} with {changed}"
    return f"{_call(made)} where the recording has {_call(recorded)}"


MISSING = object()


def _value(arguments: dict[str, Any], key: str) -> str:
    return _brief(arguments[key], 40) if key in arguments else "absent"


def _call(call: tuple[str, str]) -> str:
    name, arguments = call
    return f"{name} {_brief(arguments, CALL_CHARS)}"


def _is_call(detail: dict[str, Any], call: tuple[str, str]) -> bool:
    return detail.get("tool") == call[0] and canonical(detail.get("input") or {}) == call[1]


def _answered(detail: dict[str, Any]) -> str:
    if detail.get("answered") == "stub":
        return "never recorded: a stub answered it"
    return "never recorded: that run's replay ended there"


def _diverged(detail: dict[str, Any]) -> str:
    if detail.get("tool"):
        return f"diverged: {detail['tool']} {_brief(detail.get('input'), CALL_CHARS)}, {_answered(detail)}"
    return f"diverged: reached step {detail.get('step')!r}, which the recording never completed; the replay ended"


def _brief(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def cohort_lines(cohorts: list[dict[str, Any]]) -> list[str]:
    if not cohorts:
        return ["no cohorts yet (durable_replay --save-cohort NAME --workflow W ..., or --import FILE)"]
    return [
        f"{c['name']}  {c['recordings']} recordings  {c['replays']} replays  created {c['created_at']}"
        + (f"  {_brief(c['description'], 80)}" if c["description"] else "")
        for c in cohorts
    ]


def replay_lines(replays: list[dict[str, Any]]) -> list[str]:
    if not replays:
        return ["no replays yet"]
    lines = []
    for r in replays:
        candidate = ", ".join(f"{k} {_brief(v, 40)}" for k, v in r["candidate"].items()) or "baseline only"
        by = f" by {r['created_by']}" if r["created_by"] else ""
        lines.append(
            f"{r['id']}  cohort {r['cohort']}  {'+'.join(r['lanes'])}  {r['finished']}/{r['runs']} runs finished  "
            f"{candidate}  created {r['created_at']}{by}"
        )
    return lines
