"""durable_export RUN_ID [--output FILE]: one run's full record as JSON lines (the retention archive's format)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from durable_agents import retention
from durable_agents.management.commands._base import RUN_ID_HELP, USER_MISTAKE, DurableCommand


class Command(DurableCommand):
    help = "Write one run with its steps, turns, effects, waits, events and payloads as JSON lines."
    json_option = False  # the output is JSON lines already

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("run_id", help=RUN_ID_HELP)
        parser.add_argument("--output", help="write to this file instead of stdout")

    def handle(self, *args: Any, **options: Any) -> None:
        data = retention.export_run(options["run_id"])
        if not options["output"]:
            self.stdout.write(data.decode(), ending="")
            return
        try:
            with open(options["output"], "wb") as handle:
                handle.write(data)
        except OSError as exc:
            raise CommandError(
                f"cannot write {options['output']!r}: {exc.strerror}; give a writable path", returncode=USER_MISTAKE
            ) from None
