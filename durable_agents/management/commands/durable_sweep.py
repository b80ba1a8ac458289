"""durable_sweep [--json]: one sweep pass (what celery beat runs every few seconds)."""

from __future__ import annotations

from typing import Any

from durable_agents.management.commands._base import DurableCommand
from durable_agents.operations import sweep


class Command(DurableCommand):
    help = "Re-wake lost runs, settle cancellations and start due schedule slots, once."

    def handle(self, *args: Any, **options: Any) -> None:
        report = sweep()
        if options["json"]:
            self.emit_json(report.as_dict())
        else:
            self.stdout.write(
                f"woken {report.woken}, cancelled {report.cancelled}, notifications enqueued {report.notifications}, "
                f"scheduled runs started {report.scheduled}, admitted {report.admitted}"
            )
