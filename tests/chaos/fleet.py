"""A fleet of real `celery worker` processes the chaos tests kill: whole workers, or the pool child that holds a
run's lease, by pid.

Workers run the prefork pool: killing a pool child is an OOM kill of the process executing the step (its
parent forks a replacement, Celery re-queues the message: acks_late + reject_on_worker_lost); killing a whole
worker takes its parent, its children and their broker connection (it is restarted, as a supervisor would).
One worker also runs beat (the sweep); it is only ever hit through its pool children, so the sweep stays on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from durable_agents.testing import WorkerProcess

ROOT = Path(__file__).resolve().parents[2]
# Recognisable secrets every chaos worker gets: the secret scan looks for them in every table and log.
API_KEY = f"sk-ant-chaos-SECRET-{uuid.uuid4().hex}"
DJANGO_SECRET_KEY = f"chaos-django-SECRET-{uuid.uuid4().hex}"


class Fleet:
    """Worker processes started from one environment; each spec (`prefork(...)`) holds WorkerProcess keyword
    arguments and extra environment for that worker."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, specs: list[dict[str, Any]]) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.specs = specs
        self.workers: list[WorkerProcess] = []
        self.started = 0

    def start(self) -> Fleet:
        self.workers = [self._spawn(spec) for spec in self.specs]
        return self

    def _spawn(self, spec: dict[str, Any]) -> WorkerProcess:
        log = self.log_dir / f"worker-{self.started:03d}.log"
        self.started += 1
        options = {k: v for k, v in spec.items() if k != "env"}
        env = {**self.env, **spec.get("env", {})}
        return WorkerProcess(env=env, cwd=ROOT, log_path=log, **options).start()

    def pids(self) -> dict[int, int]:
        """Every live process of the fleet → the index of its worker."""
        return {pid: index for index, worker in enumerate(self.workers) for pid in worker.pids()}

    def kill_pid(self, pid: int, sig: int = signal.SIGKILL) -> bool:
        """Signal one process of the fleet (a pool child); False if it was already gone."""
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill_worker(self, index: int) -> list[int]:
        """SIGKILL a whole worker (parent and children) and start a fresh one in its place; returns the pids."""
        worker = self.workers[index]
        pids = sorted(worker.pids())
        worker.kill()
        self.workers[index] = self._spawn(self.specs[index])
        return pids

    def drain(self, timeout: float = 60.0) -> None:
        """Warm-shut every worker down (SIGTERM to its main process, after a SIGCONT to any frozen one): a task in
        flight finishes first — a thawed zombie between its model answer and the record of its billed usage writes
        that record. Celery's warm shutdown "will finish all currently executing tasks before it actually
        terminates" (Celery docs, Workers Guide > Stopping the worker). A worker still up after `timeout` is killed."""
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.signal(signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                worker.kill()

    def stop(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.signal(signal.SIGCONT)
            worker.kill()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_files(self) -> list[Path]:
        return sorted(self.log_dir.glob("worker-*.log"))


def prefork(concurrency: int = 2, *, beat: bool = False, **env: str) -> dict[str, Any]:
    """A worker spec: the prefork pool with `concurrency` children, optionally beat, extra environment."""
    return {"pool": "prefork", "concurrency": concurrency, "beat": beat, "env": env}
