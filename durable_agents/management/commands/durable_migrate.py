"""durable_migrate RUN_ID --version N [--replan] [--as USER]: move a run to another workflow version."""

from __future__ import annotations

from typing import Any

from durable_agents import api, operations
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, add_actor_argument


class Command(DurableCommand):
    help = "Move a run to a registered version of its workflow (e.g. one parked on version drift)."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        # --version is the workflow version here, not Django's.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_id", help=RUN_ID_HELP)
        parser.add_argument(
            "--version",
            dest="workflow_version",
            type=int,
            required=True,
            help="the registered workflow version to move the run to",
        )
        parser.add_argument("--replan", action="store_true", help="take the new version's plan for what is left")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        run_id = operations.resolve_run_id(options["run_id"])
        run = api.migrate(run_id, options["workflow_version"], replan=options["replan"], actor=options["actor"])
        if options["json"]:
            self.emit_json({"id": str(run.id), "version": run.workflow_version, "status": run.status})
        else:
            self.stdout.write(f"{run.id} now on {run.workflow}@{run.workflow_version} ({run.status})")
