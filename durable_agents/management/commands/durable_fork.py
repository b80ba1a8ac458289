"""durable_fork RUN_ID --at-step STEP [--input JSON] [--as USER]: a new run from another's checkpoints."""

from __future__ import annotations

from typing import Any

from durable_agents import api, operations
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, add_actor_argument, parse_json_option


class Command(DurableCommand):
    help = "Start a new run that copies RUN_ID's checkpoints before --at-step, optionally with new input."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_id", help=RUN_ID_HELP)
        parser.add_argument("--at-step", required=True, help="the first step the fork executes again")
        parser.add_argument("--input", help="new run input as JSON (default: the source's input)")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        new_input = parse_json_option(options["input"], "--input")
        source = operations.resolve_run_id(options["run_id"])
        fork = api.fork(source, options["at_step"], input=new_input, actor=options["actor"])
        if options["json"]:
            self.emit_json({"id": str(fork.id), "forked_from": source, "status": fork.status})
        else:
            self.stdout.write(str(fork.id))
