"""durable_demo: refund agents on real workers, one SIGKILLed mid-run; exit 0 only if every run ended as expected."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from project.refunds.demo import run_demo


class Command(BaseCommand):
    help = (
        "The crash demo (wrapped by scripts/demo): refund agents on real celery workers, one worker SIGKILLed "
        "mid-run, a refund approved after a pause. Exit 0 only if every run ended as expected."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--timeout", type=float, default=180.0, help="give up after this many seconds (180)")
        parser.add_argument(
            "--approve-after", type=float, default=3.0, help="seconds the manager takes to approve the big refund (3)"
        )
        parser.add_argument(
            "--stand-in",
            action="store_true",
            help="Claude's default model played by the strict stand-in of the Messages API (the real SDK, offline)",
        )
        parser.add_argument(
            "--batch",
            action="store_true",
            help="the reviewer's turns in Message Batches at half price, against the stand-in (implies --stand-in)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        passed = run_demo(
            self.stdout.write,
            timeout=options["timeout"],
            approve_after=options["approve_after"],
            stand_in=options["stand_in"],
            batch=options["batch"],
        )
        if not passed:
            raise CommandError("not every run ended as expected; see the summary above", returncode=1)
