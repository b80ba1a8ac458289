"""durable_schedules [list | pause NAME | resume NAME] [--json]: the schedules, and pausing or resuming one."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from durable_agents import api, operations
from durable_agents.management.commands._base import USER_MISTAKE, DurableCommand


class Command(DurableCommand):
    help = "List schedules (next slot, last run, paused, overlap policy), or pause or resume one by name."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("action", nargs="?", default="list", choices=["list", "pause", "resume"])
        parser.add_argument("name", nargs="?", help="the schedule's name (for pause and resume)")

    def handle(self, *args: Any, **options: Any) -> None:
        action, name = options["action"], options["name"]
        if action == "list":
            self._list(options["json"])
            return
        if not name:
            raise CommandError(
                f"{action} needs a schedule's name: durable_schedules {action} NAME", returncode=USER_MISTAKE
            )
        schedule = api.pause_schedule(name) if action == "pause" else api.resume_schedule(name)
        if options["json"]:
            self.emit_json({"name": schedule.name, "paused": schedule.paused, "next_slot": schedule.next_slot})
        else:
            state = "paused" if schedule.paused else f"active, next slot {schedule.next_slot.isoformat()}"
            self.stdout.write(f"schedule {schedule.name}: {state}")

    def _list(self, as_json: bool) -> None:
        schedules = operations.list_schedules()
        if as_json:
            self.emit_json(schedules)
            return
        if not schedules:
            self.stdout.write("no schedules; define one with durable_agents.api.schedule(...)")
        for row in schedules:
            state = "paused" if row["paused"] else f"next {row['next_slot']}"
            last = f"last run {row['last_run']}" if row["last_run"] else "no run yet"
            overlap = f"overlap {row['overlap']}"
            if row["overlap_skipped"]:
                overlap += f" ({row['overlap_skipped']} skipped while the last run was live)"
            error = f" — cannot start: {row['last_error']}" if row["last_error"] else ""
            self.stdout.write(
                f"{row['name']}  {row['workflow']}  {row['cron']} ({row['timezone']}, {row['missed']})  "
                f"{state}  {last}  {overlap}{error}"
            )
