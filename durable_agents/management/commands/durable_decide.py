"""durable_decide WAIT_ID --approve|--reject [--comment TEXT] [--as USER]: decide an open wait."""

from __future__ import annotations

from typing import Any

from durable_agents import api
from durable_agents.management.commands._base import DurableCommand, add_actor_argument


class Command(DurableCommand):
    help = "Approve or reject an open wait; the run wakes up and takes that path."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("wait_id", help="the open wait's id (the admin's Waits page and durable_show list them)")
        choice = parser.add_mutually_exclusive_group(required=True)
        choice.add_argument("--approve", action="store_true", help="take the approved path")
        choice.add_argument("--reject", action="store_true", help="take the rejected path")
        parser.add_argument("--comment", default="", help="why (recorded with the decision)")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        wait = api.decide(
            options["wait_id"], options["approve"], by=options["actor"], comment=options["comment"], via="cli"
        )
        if options["json"]:
            self.emit_json({"id": wait.pk, "run": str(wait.run_id), "status": wait.status, "by": wait.decided_by})
        else:
            self.stdout.write(f"wait {wait.pk} {wait.status} by {wait.decided_by}; run {wait.run_id} resumes")
