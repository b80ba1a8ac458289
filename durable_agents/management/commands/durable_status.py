"""durable_status [--json]: is the system healthy? The last sweep and its lag, live workers, runs by status,
stuck runs, how busy each worker is, the broker's queues and the oldest runnable run's wait, the Message Batches in
flight (the turns in them and queued for the next, the oldest batch's age), and a one-line verdict naming the likely
cause ("is celery beat up?", "the worker ... is saturated", "workers are behind").

Exit code 0 when healthy, 1 when not (for scripts and probes), 2 on a usage mistake.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import CommandError

from durable_agents.engine.batches import in_flight_summary
from durable_agents.health import Health, ago, system_health
from durable_agents.management.commands._base import DurableCommand

UNHEALTHY = 1


class Command(DurableCommand):
    help = "Show the system's health: the sweep, live workers, runs by status, stuck runs and a verdict."

    def handle(self, *args: Any, **options: Any) -> None:
        health = system_health()
        batches = _batches(in_flight_summary(), health.presence.now)
        if options["json"]:
            self.emit_json({**health.as_dict(), "batches": batches})
        else:
            self._print(health)
            self.stdout.write(_batches_line(batches))
        if not health.ok:
            # stderr and exit code 1: a probe or script sees it without parsing the report.
            raise CommandError(f"unhealthy: {health.verdict}", returncode=UNHEALTHY)

    def _print(self, health: Health) -> None:
        p = health.presence
        if p.last_sweep is None:
            self.stdout.write("last sweep: never")
        else:
            self.stdout.write(f"last sweep: {p.last_sweep.isoformat()} ({ago(p.sweep_lag or 0.0)} ago)")
        self.stdout.write(f"live workers: {len(p.live_workers)}")
        for worker in p.live_workers:
            queues = ",".join(worker.queues) or "-"
            busy = f"  {worker.load.text}" if worker.load is not None else ""
            self.stdout.write(
                f"  {worker.hostname} pid {worker.pid}  queues {queues}  last seen {ago(worker.seconds_ago)} ago{busy}"
            )
        counts = "  ".join(f"{status} {n}" for status, n in (health.by_status or {}).items())
        self.stdout.write(f"runs: {counts}")
        self.stdout.write(f"stuck runs: {health.stuck}")
        backlog = health.backlog
        if backlog is not None:
            if backlog.queued is None:
                self.stdout.write(f"queued messages: unknown ({backlog.unknown_why})")
            else:
                self.stdout.write(f"queued messages: {'  '.join(f'{q} {n}' for q, n in backlog.queued.items())}")
            if backlog.growing:
                grew = "  ".join(f"{q} {n:,}, up from {before:,}" for q, n, before in backlog.growing)
                self.stdout.write(f"growing since the sweep's pass before: {grew}")
            oldest = backlog.oldest_runnable_seconds
            self.stdout.write(f"oldest runnable run waiting: {'none' if oldest is None else ago(oldest)}")
        self.stdout.write(f"verdict: {health.verdict}")


def _batches(summary: dict[str, Any], now: datetime) -> dict[str, Any]:
    """engine.batches.in_flight_summary() as --json gives it: counts, and the oldest batch's and queued turn's ages."""

    def age(moment: datetime | None) -> float | None:
        return None if moment is None else round(max(0.0, (now - moment).total_seconds()), 1)

    oldest, queued_at = summary["oldest_batch_at"], summary["oldest_queued_at"]
    return {
        "in_flight": summary["batches"],
        "turns_in_flight": summary["turns"],
        "turns_queued": summary["queued"],
        "oldest_batch_at": oldest.isoformat() if oldest else None,
        "oldest_batch_seconds": age(oldest),
        "oldest_queued_at": queued_at.isoformat() if queued_at else None,
        "oldest_queued_seconds": age(queued_at),
    }


def _batches_line(batches: dict[str, Any]) -> str:
    """One line: message batches in flight: 2 (5 turns in them, 3 queued for the next); oldest made 12 min ago."""
    in_batches = batches["turns_in_flight"] - batches["turns_queued"]
    line = (
        f"message batches in flight: {batches['in_flight']} ({in_batches} turn{'s' * (in_batches != 1)} in them, "
        f"{batches['turns_queued']} queued for the next)"
    )
    if batches["oldest_batch_seconds"] is not None:
        line += f"; oldest made {ago(batches['oldest_batch_seconds'])} ago"
    if batches["oldest_queued_seconds"] is not None:
        line += f"; oldest queued turn {ago(batches['oldest_queued_seconds'])} ago"
    return line
