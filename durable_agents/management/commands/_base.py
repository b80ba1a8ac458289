"""Shared plumbing for the durable_* commands: --json output and domain errors as exit code 2."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from django.core.management.base import BaseCommand, CommandError
from django.core.serializers.json import DjangoJSONEncoder

from durable_agents.errors import DurableAgentsError

USER_MISTAKE = 2
# Every command that takes a run id resolves it with operations.resolve_run_id, so the admin's short ids work.
RUN_ID_HELP = "a run's id, or its first 6 or more characters (as the admin and durable_runs show them)"
# Who acts, when --as is not given: what the history of a command-line action has always said.
DEFAULT_ACTOR = "cli"
ACTOR_HELP = f"who is acting, recorded as the actor in the history (default: {DEFAULT_ACTOR})"


class DurableCommand(BaseCommand):
    """A command whose domain errors become a one-line message on stderr and exit code 2."""

    json_option = True

    def add_arguments(self, parser: Any) -> None:
        if self.json_option:
            parser.add_argument("--json", action="store_true", help="print machine-readable JSON")

    def execute(self, *args: Any, **options: Any) -> Any:
        actor = options.get("actor")
        if isinstance(actor, str) and not actor.strip():
            # The history would say the action was taken by no one: name who acts, or leave --as out.
            raise CommandError(
                f"--as names who is acting, got {actor!r}; give a name, or leave --as out ({DEFAULT_ACTOR!r})",
                returncode=USER_MISTAKE,
            )
        try:
            return super().execute(*args, **options)
        except DurableAgentsError as exc:
            raise CommandError(str(exc), returncode=USER_MISTAKE) from exc

    def emit_json(self, data: Any) -> None:
        self.stdout.write(json.dumps(data, indent=2, cls=DjangoJSONEncoder))


def add_actor_argument(parser: Any) -> None:
    """`--as USER`: every command that changes state and records who did it takes it, from here (one name, one
    help text, one default); read it as `options["actor"]`. `parser` may be an argument group."""
    parser.add_argument("--as", dest="actor", metavar="USER", default=DEFAULT_ACTOR, help=ACTOR_HELP)


def usage_errors_on_one_line(parser: Any) -> Any:
    """`parser` with argparse's own mistakes (an unknown option, a missing value, a bad number) as the command's:
    one line on stderr and exit code 2, without the usage block."""

    def error(message: str) -> NoReturn:
        text = f"{message}; `manage.py {parser.prog.split()[-1]} --help` lists the options"
        if parser.called_from_command_line:
            parser.exit(USER_MISTAKE, f"CommandError: {text}\n")
        raise CommandError(text, returncode=USER_MISTAKE)

    parser.error = error
    return parser


def step_progress(summary: dict[str, Any]) -> str:
    """Where a run is in its plan, numbered from 1 as the admin numbers steps: "step 2/3", "3/3 steps done"."""
    if summary["step_number"] is None:
        return f"{summary['steps']}/{summary['steps']} steps done"
    return f"step {summary['step_number']}/{summary['steps']}"


def parse_json_option(text: str | None, what: str, example: str = "--input '{\"steps\": 3}'") -> Any:
    """The option's JSON value; invalid JSON, and the NaN/Infinity that json.loads accepts, are exit code 2."""
    if text is None:
        return None
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise CommandError(
            f"{what} is not valid JSON ({exc.msg} at character {exc.pos}); e.g. {example}",
            returncode=USER_MISTAKE,
        ) from exc
    except _NotJSONError as exc:
        raise CommandError(
            f"{what} is not valid JSON: {exc} is not a JSON number; use null, a finite number or a string",
            returncode=USER_MISTAKE,
        ) from None


class _NotJSONError(ValueError):
    """json.loads met NaN, Infinity or -Infinity (Python extensions to JSON that Postgres refuses)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJSONError(name)
