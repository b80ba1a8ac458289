"""durable_resume RUN_ID... [--from-step STEP_ID] [--as USER]: resume runs (all or none), or rerun one from a step."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from durable_agents import api, operations
from durable_agents.management.commands._base import RUN_ID_HELP, USER_MISTAKE, DurableCommand, add_actor_argument


class Command(DurableCommand):
    help = "Resume failed or cancelled runs, re-wake stalled ones, or rerun one from a step."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_ids", nargs="+", metavar="RUN_ID", help=RUN_ID_HELP)
        parser.add_argument("--from-step", help="re-execute from this step (later checkpoints are superseded)")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["from_step"] is not None:
            if len(options["run_ids"]) > 1:
                raise CommandError("--from-step takes exactly one RUN_ID", returncode=USER_MISTAKE)
            run_id = operations.resolve_run_id(options["run_ids"][0])
            results = [api.resume(run_id, options["from_step"], actor=options["actor"])]
        else:
            # All or nothing: every id must exist and be resumable before any run changes.
            results = operations.resume_runs(options["run_ids"], actor=options["actor"])
        if options["json"]:
            self.emit_json([{"id": str(run.id), "status": run.status} for run in results])
        else:
            for run in results:
                self.stdout.write(f"{run.id} {run.status}")
