"""Cohorts and replays as an operator lists them, and how far a replay's runs have got (for durable_replay).

Example::

    from durable_agents import replay_status

    replay_status.progress(replay.id)   # {"runs": 40, "finished": 12, "lanes": {"baseline": {...}, ...}}
"""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Count

from durable_agents.models import Cohort, Replay, ReplayRun, Run
from durable_agents.replays import get_cohort, get_replay
from durable_agents.states import FINISHED_RUN_STATUSES

LISTED = 100


def progress(replay_id: uuid.UUID | str) -> dict[str, Any]:
    """The replay's runs, and how many have finished, in all and by lane. A pruned replay run counts as finished:
    nothing of it is left to wait for."""
    made = get_replay(replay_id)
    links = list(ReplayRun.objects.filter(replay=made).values_list("lane", "run_id"))
    unfinished = set(
        Run.objects.filter(pk__in=ReplayRun.objects.filter(replay=made).values("run_id"))
        .exclude(status__in=FINISHED_RUN_STATUSES)
        .values_list("id", flat=True)
    )
    lanes: dict[str, dict[str, int]] = {}
    for lane, run_id in links:
        counts = lanes.setdefault(lane, {"runs": 0, "finished": 0})
        counts["runs"] += 1
        counts["finished"] += run_id not in unfinished
    return {
        "replay": str(made.id),
        "runs": len(links),
        "finished": sum(c["finished"] for c in lanes.values()),
        "lanes": dict(sorted(lanes.items())),
    }


def list_cohorts(limit: int = LISTED) -> list[dict[str, Any]]:
    """The newest cohorts: name, description, how many recordings and replays each has, when it was made."""
    cohorts = Cohort.objects.annotate(
        n_recordings=Count("recordings", distinct=True), n_replays=Count("replays", distinct=True)
    ).order_by("-created_at", "-id")[:limit]
    return [
        {
            "name": c.name,
            "description": c.description,
            "recordings": c.n_recordings,
            "replays": c.n_replays,
            "created_at": c.created_at.isoformat(),
        }
        for c in cohorts
    ]


def list_replays(cohort: str | None = None, limit: int = LISTED) -> list[dict[str, Any]]:
    """The newest replays (of `cohort`, if named): id, cohort, candidate, lanes, runs finished, who, when."""
    replays = Replay.objects.select_related("cohort").order_by("-created_at", "-id")
    if cohort:
        replays = replays.filter(cohort=get_cohort(cohort))
    chosen = list(replays[:limit])
    links = list(ReplayRun.objects.filter(replay__in=chosen).values_list("replay_id", "lane", "run_id"))
    unfinished = set(
        Run.objects.filter(pk__in=ReplayRun.objects.filter(replay__in=chosen).values("run_id"))
        .exclude(status__in=FINISHED_RUN_STATUSES)
        .values_list("id", flat=True)
    )
    by_replay: dict[Any, dict[str, Any]] = {}
    for replay_id, lane, run_id in links:
        counts = by_replay.setdefault(replay_id, {"lanes": set(), "runs": 0, "finished": 0})
        counts["lanes"].add(lane)
        counts["runs"] += 1
        counts["finished"] += run_id not in unfinished
    out = []
    for made in chosen:
        counts = by_replay.get(made.id, {"lanes": set(), "runs": 0, "finished": 0})
        out.append(
            {
                "id": str(made.id),
                "cohort": made.cohort.name,
                "candidate": made.candidate,
                "lanes": sorted(counts["lanes"]),
                "runs": counts["runs"],
                "finished": counts["finished"],
                "budget_usd": str(made.budget_usd) if made.budget_usd is not None else None,
                "created_by": made.created_by,
                "created_at": made.created_at.isoformat(),
            }
        )
    return out


__all__ = ["list_cohorts", "list_replays", "progress"]
