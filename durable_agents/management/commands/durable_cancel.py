"""durable_cancel RUN_ID... [--reason TEXT] [--as USER]: cancel runs, all or none."""

from __future__ import annotations

from typing import Any

from durable_agents import operations
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, add_actor_argument


class Command(DurableCommand):
    help = "Cancel runs: at once if no worker holds them, otherwise at the end of the running step."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_ids", nargs="+", metavar="RUN_ID", help=RUN_ID_HELP)
        parser.add_argument("--reason", default="", help="why (recorded in the history)")
        parser.add_argument("--compensate", action="store_true", help="first undo applied effects, newest first (saga)")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        # All or nothing: every id must exist and be cancellable before any run changes.
        results = operations.cancel_runs(
            options["run_ids"], reason=options["reason"], compensate=options["compensate"], actor=options["actor"]
        )
        if options["json"]:
            self.emit_json([{"id": str(run.id), "status": run.status} for run in results])
        else:
            for run in results:
                state = run.status if run.is_finished else f"{run.status} (cancel requested)"
                if run.finish_as:
                    state = f"{run.status} (compensating, then {run.finish_as})"
                self.stdout.write(f"{run.id} {state}")
