"""Services the chaos tests own and break: a Redis server, a Postgres cluster, a RabbitMQ vhost, and a waker
that publishes the test process's wake-ups to one of them.

Each test starts its own Redis and Postgres on free ports, so stopping them never touches the machine's
instances (other test sessions use those). RabbitMQ is the machine's; each session gets a vhost of its own,
deleted afterwards.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from django.apps import apps


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A local port where every connection is refused while the block runs: bound, never listening. Held, it cannot
    be handed to another process meanwhile (a server of a second test session on this machine), as a port found
    free and let go could be."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def is_listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def _wait(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


# --- Redis ----------------------------------------------------------------------------------------------------


class RedisServer:
    """A throwaway `redis-server` on a free port, no persistence: a restart loses every message."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed")
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(self.ping, f"redis-server on port {self.port}")
        return self

    def ping(self) -> bool:
        with contextlib.suppress(redis.RedisError):
            return bool(redis.Redis(port=self.port, socket_timeout=1).ping())
        return False

    def flushall(self) -> None:
        redis.Redis(port=self.port).flushall()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # like a crash: no shutdown save (there is none anyway)
            self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --- Postgres ---------------------------------------------------------------------------------------------------


def postgres_bin() -> Path | None:
    """The bin directory of the newest installed PostgreSQL server, if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    pg_ctl = shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl else None


class PostgresCluster:
    """A throwaway Postgres cluster in a temp dir on a free port (trust auth, user postgres).

    initdb refuses to run as root, so as root every server command runs as the `postgres` user.
    """

    def __init__(self, bin_dir: Path) -> None:
        self.bin = bin_dir
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="durable-chaos-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.restarts = 0

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr or result.stdout}")
        return result

    def start(self) -> PostgresCluster:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self._pg_ctl("start")
        return self

    def _pg_ctl(self, action: str, *extra: str) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "60", action, *extra)

    def stop(self, mode: str = "fast") -> None:
        self._pg_ctl("stop", "-m", mode)

    def restart(self, down_seconds: float = 0.0) -> None:
        """Stop (fast: every connection is cut), stay down `down_seconds`, start again."""
        self.stop()
        time.sleep(down_seconds)
        self._pg_ctl("start")
        self.restarts += 1

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(mode="immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()


# --- RabbitMQ ---------------------------------------------------------------------------------------------------

RABBIT_HOST, RABBIT_PORT = "127.0.0.1", 5672


def require_rabbitmq() -> None:
    """Skip the test when RabbitMQ cannot be used here — or fail it under scripts/test (DURABLE_TEST_ALL_SERVICES),
    which starts RabbitMQ: a skip there would hide a missing service."""
    why = ""
    if not is_listening(RABBIT_HOST, RABBIT_PORT):
        why = f"RabbitMQ is not listening on {RABBIT_HOST}:{RABBIT_PORT}"
    elif shutil.which("rabbitmqctl") is None:
        why = "rabbitmqctl is not installed (needed to create a vhost for the test)"
    if why and os.environ.get("DURABLE_TEST_ALL_SERVICES"):
        pytest.fail(f"{why}; scripts/test starts it (rabbitmq-server -detached)")
    if why:
        pytest.skip(why)


@contextlib.contextmanager
def rabbit_vhost() -> Iterator[str]:
    """A fresh vhost for guest; yields its broker URL and deletes it (queues and all) afterwards."""
    name = f"durable_chaos_{uuid.uuid4().hex[:8]}"

    def ctl(*args: str) -> None:
        subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)

    ctl("add_vhost", name)
    try:
        ctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBIT_HOST}:{RABBIT_PORT}/{name}"
    finally:
        ctl("delete_vhost", name)


# --- Publishing the test process's wake-ups to another broker -----------------------------------------------------

WAKE_BROKER_ENV = "DURABLE_CHAOS_WAKE_BROKER"


@cache
def _publisher(url: str) -> Celery:
    app = Celery("durable-chaos-publisher", broker=url, set_as_current=False)
    if url.startswith("amqp"):
        # The same queue and exchange the workers declare, publisher confirms: a quorum queue on the example project's
        # topic exchange (project/settings.py), or on tests/settings.py's (Celery's direct one, unless the test sets
        # DURABLE_TEST_EXCHANGE_TYPE). A message sent to an exchange the queue is not bound to is dropped.
        app.conf.task_default_queue_type = "quorum"
        app.conf.broker_transport_options = {"confirm_publish": True}
        example_project = apps.is_installed("project.refunds")
        exchange_type = "topic" if example_project else os.environ.get("DURABLE_TEST_EXCHANGE_TYPE")
        if exchange_type:
            app.conf.task_default_exchange = "durable_agents"
            app.conf.task_default_exchange_type = exchange_type
    return app


def wake(run_id: str, countdown: float | None = None, queue: str | None = None) -> None:
    """A DURABLE_AGENTS['WAKER'] for the test process: send `durable_agents.advance` to the broker named by
    the DURABLE_CHAOS_WAKE_BROKER environment variable (the broker the test's workers consume from)."""
    routed = {"queue": queue} if queue else {}
    url = os.environ[WAKE_BROKER_ENV]
    publisher = _publisher(url)
    # Celery takes the CELERY_BROKER_URL environment variable (the test's own Redis) over an app's `broker=`
    # (celery/app/utils.py Settings.broker_url): the connection names the broker itself.
    with publisher.connection_for_write(url) as connection:
        publisher.send_task(
            "durable_agents.advance", args=(str(run_id),), countdown=countdown or None, connection=connection, **routed
        )
