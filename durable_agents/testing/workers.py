"""Real `celery worker` subprocesses for tests and the demo, and polling helpers that wait on the database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from durable_agents.models import FINISHED_RUN_STATUSES, Run

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = "") -> T:
    """Poll `predicate` until it returns something truthy; raise TimeoutError naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what or predicate}")
        time.sleep(interval)


def wait_for_run(run_id: uuid.UUID | str, statuses: str | Iterable[str] = "completed", *, timeout: float = 60.0) -> Any:
    """Wait until the run reaches one of `statuses`; returns the Run. Fails fast if it ends elsewhere."""
    wanted = {statuses} if isinstance(statuses, str) else set(statuses)

    def reached() -> Any:
        run = Run.objects.get(pk=run_id)
        if run.status in wanted:
            return run
        if run.status in FINISHED_RUN_STATUSES:
            raise AssertionError(f"run {run_id} ended {run.status} (error: {run.error}), expected {sorted(wanted)}")
        return None

    return wait_for(reached, timeout=timeout, what=f"run {run_id} to become {'/'.join(sorted(wanted))}")


def celery_app_for(env: Mapping[str, str]) -> str:
    """The Celery app (`celery -A APP`) of a worker with environment `env`: DURABLE_CELERY_APP, else the top
    package of DJANGO_SETTINGS_MODULE, where Celery's Django layout puts it (`proj/settings.py`, `proj/celery.py`).

    Example::

        celery_app_for({"DJANGO_SETTINGS_MODULE": "mysite.settings.test"})   # "mysite"
    """
    if env.get("DURABLE_CELERY_APP"):
        return env["DURABLE_CELERY_APP"]
    if not env.get("DJANGO_SETTINGS_MODULE"):
        raise ValueError(
            "which Celery app should the worker start? Set DJANGO_SETTINGS_MODULE (the app is looked for in its "
            "top package), DURABLE_CELERY_APP, or pass app= (what `celery -A` takes)"
        )
    return env["DJANGO_SETTINGS_MODULE"].split(".", 1)[0]


class WorkerProcess:
    """A real `celery worker` subprocess in its own process group, so SIGKILL takes all of it.

    `app` is what `celery -A` takes; by default it follows the environment (`celery_app_for`).

    Usage::

        worker = WorkerProcess(env={"DATABASE_URL": url, "CELERY_BROKER_URL": broker}).start()
        worker.kill()          # SIGKILL, like an OOM kill or a lost machine
        worker.stop()          # graceful
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        inherit_env: bool = True,
        app: str | None = None,
        pool: str = "solo",
        concurrency: int = 1,
        beat: bool = False,
        name: str | None = None,
        log_path: str | Path | None = None,
        cwd: str | Path | None = None,
        extra_args: Iterable[str] = (),
    ) -> None:
        self.name = name or f"worker-{uuid.uuid4().hex[:8]}"
        self.env = {**(os.environ if inherit_env else {}), **(env or {})}
        self.cwd = str(cwd or Path.cwd())
        self.log_path = Path(log_path) if log_path else None
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app or celery_app_for(self.env),
            "worker",
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--hostname",
            f"{self.name}@%h",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *extra_args,
        ]
        if beat:
            schedule = Path(self.env.get("DURABLE_VAR_DIR", "/tmp")) / f"beat-{self.name}"
            self.args += ["--beat", "--schedule", str(schedule)]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            self.args, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "worker not started"
        return self.process.pid

    def owns(self, lease_owner: str) -> bool:
        """True if a run's lease_owner (host:pid) is this worker or one of its pool processes."""
        pid = lease_owner.rsplit(":", 1)[-1]
        return pid.isdigit() and int(pid) in self.pids()

    def pids(self) -> set[int]:
        if self.process is None:
            return set()
        out = subprocess.run(["pgrep", "-g", str(self.pid)], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()} | {self.pid}

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children), and reap it."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
