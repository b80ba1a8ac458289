"""durable_runs [--status S] [--workflow W] [--stuck] [--older-than 2h] [--search field=value] [--limit N]
[--replays | --lane LANE | --replay ID] [--json]: list runs.

Each row says where the run is (steps numbered from 1, as in the admin) and, for a waiting run, the id of its
open wait, which `durable_decide` takes. Replay runs (durable_replay) are left out, and counted, unless
`--replays`, `--lane` or `--replay` asks for them; a replay run's row names its lane.
"""

from __future__ import annotations

from typing import Any

from durable_agents import operations
from durable_agents.durations import parse_duration
from durable_agents.management.commands._base import DurableCommand, step_progress
from durable_agents.search import as_text


class Command(DurableCommand):
    help = "List runs, newest first."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("--status")
        parser.add_argument("--workflow")
        parser.add_argument("--stuck", action="store_true", help="expired lease, or no progress for too long")
        parser.add_argument("--older-than", help="created more than this long ago: 90s, 30m, 2h, 3d")
        parser.add_argument(
            "--version-drift", action="store_true", help="active runs pinned to a workflow version no longer registered"
        )
        # Checked by list_runs (1 or more, a bigint), so "-1" or "abc" is one line saying what to give.
        parser.add_argument("--limit", default="100", help="list at most this many runs (100)")
        parser.add_argument("--parent", help="only the child runs of this run (an id or a unique prefix)")
        parser.add_argument(
            "--search",
            action="append",
            default=[],
            help="field=value: runs whose search attribute has this value, e.g. order_id=A-1001 (repeat to AND)",
        )
        parser.add_argument("--replays", action="store_true", help="list replay runs too (durable_replay's)")
        parser.add_argument("--lane", help="only replay runs of this lane: baseline or candidate")
        parser.add_argument("--replay", help="only the runs of this replay (its id, as durable_replay prints it)")

    def handle(self, *args: Any, **options: Any) -> None:
        older = parse_duration(options["older_than"]) if options["older_than"] else None
        filters = {
            "status": options["status"],
            "workflow": options["workflow"],
            "stuck": options["stuck"],
            "older_than": older,
            "version_drift": options["version_drift"],
            "parent": options["parent"],
            "search": operations.search_filters(options["search"]),
            "replays": options["replays"],
            "lane": options["lane"],
            "replay": options["replay"],
        }
        rows = operations.summarize_runs(operations.list_runs(limit=options["limit"], **filters))
        hidden = operations.hidden_replay_runs(**filters)
        note = f"{hidden} replay run{'s' if hidden != 1 else ''} hidden (--replays lists them)" if hidden else ""
        if options["json"]:
            self.emit_json(rows)
            if note:
                self.stderr.write(note)  # the JSON stays a list of runs; a person reading along still learns it
            return
        if not rows:
            self.stdout.write("no runs match")
        for row in rows:
            self.stdout.write(
                f"{row['id']}  {row['workflow']}@{row['version']}  {row['status']:<9}  "
                f"{step_progress(row)}  created {row['created_at']}{_open_wait(row['open_wait'])}"
                f"{_search(row['search'])}{_lane(row['replay_lane'])}"
            )
        if note:
            self.stdout.write(note)


def _open_wait(wait: dict[str, Any] | None) -> str:
    if wait is None:
        return ""
    what = f"{wait['kind']} {wait['name']}" if wait["name"] else wait["kind"]
    return f"  wait {wait['id']} ({what})"


def _lane(lane: str | None) -> str:
    return f"  replay run ({lane} lane)" if lane else ""


def _search(attributes: dict[str, str]) -> str:
    return f"  [{as_text(attributes)}]" if attributes else ""
