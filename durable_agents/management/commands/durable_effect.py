"""durable_effect KEY --applied [--result JSON] | --failed [--reason TEXT] [--as USER]: record an unknown outcome."""

from __future__ import annotations

from typing import Any

from durable_agents import api
from durable_agents.errors import InvalidInputError
from durable_agents.management.commands._base import DurableCommand, add_actor_argument, parse_json_option


class Command(DurableCommand):
    help = (
        "Record what happened to an effect whose outcome is unknown (it needs attention): --applied, with the "
        "receiving system's result, or --failed (it did not happen: a resumed run calls it again under its key). "
        "A run that stopped on it then resumes from there."
    )

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("key", help="the effect's idempotency key (durable_show RUN_ID lists them)")
        outcome = parser.add_mutually_exclusive_group(required=True)
        outcome.add_argument("--applied", action="store_true", help="the receiving system applied it")
        outcome.add_argument("--failed", action="store_true", help="the receiving system did not apply it")
        parser.add_argument("--result", help="with --applied: what the receiving system returned, as JSON")
        parser.add_argument("--reason", default="", help="how you know (recorded in the run's history)")
        parser.add_argument("--no-resume", action="store_true", help="record only; do not resume a stopped run")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["result"] is not None and not options["applied"]:
            raise InvalidInputError("--result goes with --applied: an effect that did not happen has no result")
        result = parse_json_option(options["result"], "--result")
        effect = api.resolve_effect(
            options["key"],
            options["applied"],
            result=result,
            actor=options["actor"],
            reason=options["reason"],
            resume=not options["no_resume"],
        )
        run = api.get(effect.run_id)
        if options["json"]:
            self.emit_json(
                {"key": effect.idempotency_key, "status": effect.status, "run": str(run.id), "run_status": run.status}
            )
        else:
            self.stdout.write(f"effect {effect.idempotency_key} recorded {effect.status}; run {run.id} is {run.status}")
