"""durable_start WORKFLOW [--input JSON] [--key KEY] [--version N] [--concurrency-key KEY [--concurrency-limit N]]
[--json]: start a run, print its id."""

from __future__ import annotations

from typing import Any

from durable_agents import api
from durable_agents.management.commands._base import DurableCommand, parse_json_option


class Command(DurableCommand):
    help = "Start a run of WORKFLOW and print its id."

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        # --version means the workflow version here, not Django's version: let ours replace the base one.
        return super().create_parser(prog_name, subcommand, conflict_handler="resolve", **kwargs)

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("workflow")
        parser.add_argument("--input", help="the run input as JSON, e.g. '{\"steps\": 3}'")
        parser.add_argument("--key", help="idempotency key: starting twice with one key returns the first run")
        parser.add_argument("--version", dest="workflow_version", type=int, help="workflow version (default: latest)")
        parser.add_argument(
            "--concurrency-key",
            help="at most --concurrency-limit runs with this key in flight (default: the workflow's)",
        )
        parser.add_argument("--concurrency-limit", type=int, help="runs of the key in flight at once (default: 1)")

    def handle(self, *args: Any, **options: Any) -> None:
        run_input = parse_json_option(options["input"], "--input")
        run = api.start(
            options["workflow"],
            run_input,
            idempotency_key=options["key"],
            version=options["workflow_version"],
            concurrency_key=options["concurrency_key"],
            concurrency_limit=options["concurrency_limit"],
        )
        if options["json"]:
            self.emit_json({"id": str(run.id), "status": run.status})
        else:
            self.stdout.write(str(run.id))
