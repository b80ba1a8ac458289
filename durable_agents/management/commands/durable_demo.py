"""durable_demo: start runs on real workers, SIGKILL one mid-run, and show that every run still completes."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from durable_agents.demo import run_demo


class Command(BaseCommand):
    help = "Run the crash demo (wrapped by scripts/demo). Exit 0 only if every run ended as expected."

    def handle(self, *args: Any, **options: Any) -> None:
        if not run_demo(self.stdout.write):
            raise CommandError("not every run completed; see var/demo/worker-*.log", returncode=1)
