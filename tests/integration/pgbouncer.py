"""PgBouncer for the tests: a real pooler in transaction mode in front of the test's Postgres, on a free port.

Debian's `pgbouncer` package (scripts/test installs it when missing). A missing binary fails the test that asked
for it, saying what to install: a test skipped for a missing service would hide that nothing was proven.

Transaction mode is the one that breaks session state: a client holds a server connection for one transaction
only, then any other client may get it (https://www.pgbouncer.org/features.html, "Transaction pooling"). By default
PgBouncer hands out the server connection released last (LIFO, `server_round_robin = 0`), so one client alone
keeps landing on the same one: the tests make others hold it when it matters.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

INSTALL = (
    "pgbouncer is not installed: `apt-get install -y pgbouncer` (Debian's package; scripts/test installs it when "
    "missing). The pooler tests prove the engine behind PgBouncer in transaction mode and are never skipped."
)
START_ATTEMPTS = 3  # a free port can be taken by another process between finding it and PgBouncer binding it
START_SECONDS = 30.0


def pgbouncer_binary() -> str:
    """The pgbouncer executable; fails the test with what to install if there is none."""
    found = shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(path, os.X_OK)), None
    )
    if found is None:
        pytest.fail(INSTALL, pytrace=False)
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PgBouncer:
    """A PgBouncer process in front of Postgres at `host:port`, every database (`*`), `pool_mode` transaction.

    Usage::

        with PgBouncer(host="127.0.0.1", port=5432, user="postgres", password="") as bouncer:
            psycopg.connect(bouncer.url("mydb"))
    """

    def __init__(self, *, host: str, port: int, user: str, password: str, pool_mode: str = "transaction") -> None:
        self.upstream = (host, port)
        self.user, self.password, self.pool_mode = user, password, pool_mode
        self.port = 0
        self.dir = Path(tempfile.mkdtemp(prefix="durable-pgbouncer-"))
        self.log = self.dir / "pgbouncer.log"
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        """A libpq URL to `database` through this PgBouncer."""
        password = f":{self.password}" if self.password else ""
        return f"postgresql://{self.user}{password}@127.0.0.1:{self.port}/{database}"

    def logins(self, database: str) -> int:
        """Client logins PgBouncer accepted to `database`: proof that a process went through it, not around it."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text.count(f"login attempt: db={database} ")

    def start(self) -> PgBouncer:
        binary = pgbouncer_binary()
        # PgBouncer refuses to run as root (CI runs as root): it then drops to the `postgres` user, who must read
        # its files.
        as_root = os.geteuid() == 0
        if as_root:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.fail(
                    "PgBouncer will not run as root, and there is no `postgres` user to run it as", pytrace=False
                )
        self.dir.chmod(0o755)
        for _ in range(START_ATTEMPTS):
            self.port = free_port()
            self._write_config()
            log = open(self.log, "ab")  # noqa: SIM115 - the child writes it; closed below
            try:
                self.process = subprocess.Popen(
                    [binary, *(["-u", "postgres"] if as_root else []), str(self.dir / "pgbouncer.ini")],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            finally:
                log.close()
            if self._ready():
                return self
        self.stop()
        pytest.fail(f"PgBouncer did not start; its log:\n{self._tail()}", pytrace=False)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _write_config(self) -> None:
        host, port = self.upstream
        users = self.dir / "users.txt"
        users.write_text(f'"{self.user}" "{self.password}"\n')
        (self.dir / "pgbouncer.ini").write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={host} port={port}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    # trust: PgBouncer asks clients for nothing, and logs in to Postgres with the auth_file's password.
                    "auth_type = trust",
                    f"auth_file = {users}",
                    f"pool_mode = {self.pool_mode}",
                    "default_pool_size = 20",
                    "max_client_conn = 200",
                    "",
                ]
            )
        )
        for path in (users, self.dir / "pgbouncer.ini"):
            path.chmod(0o644)

    def _ready(self) -> bool:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False  # e.g. the port was taken meanwhile: another port
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=5) as probe:
                    probe.execute("SELECT 1")
                return True
            except psycopg.OperationalError:
                time.sleep(0.1)  # polling a starting process: no event to wait on
        return False

    def _tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log)"
