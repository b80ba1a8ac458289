"""durable_cancel RUN_ID... [--reason TEXT] [--as USER]: cancel runs."""

from __future__ import annotations

from typing import Any

from durable_agents import api
from durable_agents.management.commands._base import DurableCommand


class Command(DurableCommand):
    help = "Cancel runs: at once if no worker holds them, otherwise at the end of the running step."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_ids", nargs="+", metavar="RUN_ID")
        parser.add_argument("--reason", default="", help="why (recorded in the history)")
        parser.add_argument("--compensate", action="store_true", help="first undo applied effects, newest first (saga)")
        parser.add_argument("--as", dest="actor", default="cli", help="who is acting (recorded in the history)")

    def handle(self, *args: Any, **options: Any) -> None:
        for run_id in options["run_ids"]:
            api.get(run_id)  # every id must exist before any run changes: a typo leaves nothing half-done
        results = [
            api.cancel(run_id, options["reason"], compensate=options["compensate"], actor=options["actor"])
            for run_id in options["run_ids"]
        ]
        if options["json"]:
            self.emit_json([{"id": str(run.id), "status": run.status} for run in results])
        else:
            for run in results:
                state = run.status if run.is_finished else f"{run.status} (cancel requested)"
                if run.finish_as:
                    state = f"{run.status} (compensating, then {run.finish_as})"
                self.stdout.write(f"{run.id} {state}")
