"""durable_swap RUN_ID PARTICIPANT [--as USER]: make another participant answer a run's model turns."""

from __future__ import annotations

from typing import Any

from durable_agents import api, operations
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, add_actor_argument


class Command(DurableCommand):
    help = "Swap the participant (anthropic, or a registered script/function) that answers a run's turns."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_id", help=RUN_ID_HELP)
        parser.add_argument("participant")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        run_id = operations.resolve_run_id(options["run_id"])
        run = api.swap_participant(run_id, options["participant"], actor=options["actor"])
        if options["json"]:
            self.emit_json({"id": str(run.id), "participant": run.participant})
        else:
            self.stdout.write(f"{run.id} now answered by {run.participant}")
