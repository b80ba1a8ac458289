"""durable_budget RUN_ID [--tokens N] [--cost USD] [--as USER]: set (raise) a run's spending limits."""

from __future__ import annotations

from typing import Any

from durable_agents import api, operations
from durable_agents.management.commands._base import RUN_ID_HELP, DurableCommand, add_actor_argument


class Command(DurableCommand):
    help = "Set a run's token and/or cost budget; resume it afterwards if it stopped on its budget."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("run_id", help=RUN_ID_HELP)
        # Parsed by set_budget, not argparse: "1e20" or a number past the column gets its own one-line error.
        parser.add_argument("--tokens", help="total tokens the run may spend, across resumes (a whole number)")
        parser.add_argument("--cost", help="total USD the run may spend, e.g. 2.50")
        add_actor_argument(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        run_id = operations.resolve_run_id(options["run_id"])
        run = api.set_budget(run_id, tokens=options["tokens"], cost_usd=options["cost"], actor=options["actor"])
        if options["json"]:
            self.emit_json(
                {"id": str(run.id), "token_budget": run.token_budget, "cost_budget_usd": run.cost_budget_usd}
            )
        else:
            self.stdout.write(f"{run.id} budget: {run.token_budget} tokens, ${run.cost_budget_usd}")
