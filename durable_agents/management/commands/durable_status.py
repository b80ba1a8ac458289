"""durable_status [--json]: is the system healthy? The last sweep and its lag, live workers, runs by status,
stuck runs, how busy each worker is, the broker's queues and the oldest runnable run's wait, and a one-line verdict
naming the likely cause ("is celery beat up?", "the worker ... is saturated", "workers are behind").

Exit code 0 when healthy, 1 when not (for scripts and probes), 2 on a usage mistake.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from durable_agents.health import Health, ago, system_health
from durable_agents.management.commands._base import DurableCommand

UNHEALTHY = 1


class Command(DurableCommand):
    help = "Show the system's health: the sweep, live workers, runs by status, stuck runs and a verdict."

    def handle(self, *args: Any, **options: Any) -> None:
        health = system_health()
        if options["json"]:
            self.emit_json(health.as_dict())
        else:
            self._print(health)
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
