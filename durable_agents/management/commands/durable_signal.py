"""durable_signal RUN_ID NAME [--payload JSON] [--as USER]: send a signal to a run."""

from __future__ import annotations

from typing import Any

from durable_agents import api, operations
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, add_actor_argument, parse_json_option


class Command(DurableCommand):
    help = "Send signal NAME (with an optional JSON payload) to a run; it wakes a run waiting for it."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_id", help=RUN_ID_HELP)
        parser.add_argument("name")
        parser.add_argument("--payload", help="JSON payload, e.g. '{\"paid\": true}'")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        payload = parse_json_option(options["payload"], "--payload")
        run_id = operations.resolve_run_id(options["run_id"])
        wait = api.send_signal(run_id, options["name"], payload, by=options["actor"])
        if options["json"]:
            self.emit_json({"wait": wait.pk, "run": str(wait.run_id), "delivered": wait.step_id is not None})
        else:
            self.stdout.write(f"signal {options['name']} delivered to run {wait.run_id}")
