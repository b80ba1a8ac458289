"""durable_schedules [list | pause NAME | resume NAME | trigger NAME | delete NAME] [--as USER] [--json]: the
schedules (and where code declares them), pausing or resuming one (who did is kept on the schedule), starting one's
run now (the console's "Trigger now"), and deleting one made with api.schedule (one declared in code is refused: the
next sweep would bring it back).
"""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import CommandError

from durable_agents import api, operations
from durable_agents.management.commands._base import USER_MISTAKE, DurableCommand, add_actor_argument

ORIGINS = {"setting": 'declared in DURABLE_AGENTS["SCHEDULES"]', "workflow": "declared on its workflow (cron)"}


class Command(DurableCommand):
    help = (
        "List schedules (next slot, last run, paused, overlap policy), pause or resume one by name, or trigger one: "
        "start its run now with its input (its slots keep their times), or delete one made with api.schedule "
        "(a schedule declared in code is removed by removing its declaration)."
    )

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument(
            "action", nargs="?", default="list", choices=["list", "pause", "resume", "trigger", "delete"]
        )
        parser.add_argument("name", nargs="?", help="the schedule's name (for pause, resume, trigger and delete)")
        # Pause, resume and trigger record who acted; list and delete record nothing and ignore it.
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        action, name = options["action"], options["name"]
        if action == "list":
            self._list(options["json"])
            return
        if not name:
            raise CommandError(
                f"{action} needs a schedule's name: durable_schedules {action} NAME", returncode=USER_MISTAKE
            )
        if action == "trigger":
            self._trigger(name, options["actor"], options["json"])
            return
        if action == "delete":
            api.unschedule(name)  # ScheduleDeclaredError for a declared one: exit 2, saying what to do
            if options["json"]:
                self.emit_json({"name": name, "deleted": True})
            else:
                self.stdout.write(f"schedule {name} deleted; the runs it started stay")
            return
        verb = api.pause_schedule if action == "pause" else api.resume_schedule
        schedule = verb(name, actor=options["actor"])
        if options["json"]:
            self.emit_json(
                {
                    "name": schedule.name,
                    "paused": schedule.paused,
                    "paused_changed_by": schedule.paused_changed_by,
                    "next_slot": schedule.next_slot,
                }
            )
        else:
            state = "paused" if schedule.paused else f"active, next slot {schedule.next_slot.isoformat()}"
            by = f" (by {schedule.paused_changed_by})" if schedule.paused_changed_by else ""
            self.stdout.write(f"schedule {schedule.name}: {state}{by}")

    def _trigger(self, name: str, actor: str, as_json: bool) -> None:
        # A fresh token: each command starts a run (the console's button reuses its page's, against double posts).
        run = api.trigger_schedule(name, actor=actor, token=uuid.uuid4().hex)
        if as_json:
            self.emit_json({"schedule": name, "run": str(run.pk), "workflow": run.workflow})
        else:
            self.stdout.write(f"schedule {name} started run {run.pk} ({run.workflow})")

    def _list(self, as_json: bool) -> None:
        schedules = operations.list_schedules()
        if as_json:
            self.emit_json(schedules)
            return
        if not schedules:
            self.stdout.write(
                'no schedules; declare one in DURABLE_AGENTS["SCHEDULES"] or with workflow(..., schedule=cron(...))'
            )
        for row in schedules:
            state = f"paused by {row['paused_changed_by'] or '?'}" if row["paused"] else f"next {row['next_slot']}"
            last = f"last run {row['last_run']}" if row["last_run"] else "no run yet"
            overlap = f"overlap {row['overlap']}"
            if row["overlap_skipped"]:
                overlap += f" ({row['overlap_skipped']} skipped while the last run was live)"
            error = f" — cannot start: {row['last_error']}" if row["last_error"] else ""
            origin = ORIGINS.get(row["declared"] or "", "made with api.schedule")
            self.stdout.write(
                f"{row['name']}  {row['workflow']}  {row['cron']} ({row['timezone']}, {row['missed']})  "
                f"{state}  {last}  {overlap}  {origin}{error}"
            )
