"""durable_prune [--dry-run] [--batch-size N] [--workflow NAME] [--older-than AGE] [--pause S] [--duty-cycle F]
[--stop-after DURATION] [--json]: one pass."""

from __future__ import annotations

from typing import Any

from durable_agents import retention
from durable_agents.display import when_text
from durable_agents.management.commands._base import DurableCommand


class Command(DurableCommand):
    help = "Delete finished runs older than DURABLE_AGENTS['RETENTION'] allows (archived first if configured)."

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("--dry-run", action="store_true", help="count the runs that would go; change nothing")
        parser.add_argument("--batch-size", help="runs per transaction (default: RETENTION_BATCH)")
        parser.add_argument("--workflow", help="only runs of this workflow")
        parser.add_argument("--pause", help="least seconds between batches (default: RETENTION_PAUSE_SECONDS)")
        parser.add_argument(
            "--duty-cycle",
            help="share of the time the pass may work, 0.01 to 1 (flat out) (default: RETENTION_DUTY_CYCLE)",
        )
        parser.add_argument(
            "--stop-after", help="start no batch after this long, e.g. 2h (begins anywhere; passes cover it all)"
        )
        parser.add_argument(
            "--older-than", help="instead of the policy: finished runs unchanged for this long, e.g. 90d"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        report = retention.prune(
            dry_run=options["dry_run"],
            batch_size=options["batch_size"],
            workflow=options["workflow"],
            older_than=options["older_than"],
            pause_seconds=options["pause"],
            duty_cycle=options["duty_cycle"],
            stop_after=options["stop_after"],
        )
        if options["json"]:
            self.emit_json(report.as_dict())
        elif report.busy:
            until = when_text(report.held_until) or "now"
            self.stdout.write(
                f"another prune pass holds the lease: {report.held_by}, until {until} unless it renews it; nothing "
                "done (a pass that died leaves it to lapse then: run this again after)"
            )
        elif report.dry_run:
            self.stdout.write(f"would delete {report.selected} runs")
            for key, count in sorted(report.counts.items()):
                self.stdout.write(f"  {key}: {count}")
        else:
            archived = f", {len(report.archives)} archives written" if report.archives else ""
            self.stdout.write(
                f"deleted {report.deleted} runs in {report.batches} batches, kept {report.skipped} that were busy "
                f"or changed{archived}; rested {report.rested:.1f} s between batches"
            )
            if report.lost:
                self.stdout.write(
                    "stopped: this pass was held up past its lease and another pass took it over; it goes on from here"
                )
            elif report.stopped:
                self.stdout.write("stopped at --stop-after; older runs may be left for the next pass")
