"""The example project's pytest session (EXAMPLE_TESTS in tests/conftest.py), run beside the library's session.

Django reads its settings once per process, so the example project's tests run in a pytest subprocess of their own
(tests/test_example_project.py). It is started when that test is selected, as soon as collection ends, and runs while
the library's tests run; the test, moved to the end of the session, waits for it and shows its report. The wall time
of `python -m pytest` is then about the longer of the two sessions, not their sum.

Two sessions at once share nothing they could break for each other:

* the database: the example session's is the same server's `<name>_example` (its test database `test_<name>_example`);
* the broker: another Redis database of the same server (`redis_database_beside`), or another RabbitMQ vhost, so no
  worker of one session consumes the other's wake-ups, and each session's `broker_url` fixture empties only its own
  (the counters, clocks and rate-limit buckets the tests keep in the broker's Redis database go with it);
* files: a var dir of its own (DURABLE_VAR_DIR: media, beat schedules, the local secret key) and, under CI,
  `$DURABLE_TEST_ARTIFACTS/example/` for its worker logs;
* processes: it runs in a process session of its own, and is interrupted when the library's session ends before
  waiting for it (--maxfail, Ctrl-C) or dies (the kernel sends it SIGINT: PR_SET_PDEATHSIG), so its fixtures still
  kill the workers it started and drop its test database.

DURABLE_TEST_EXAMPLE_BROKER_URL, when set, is the example session's broker instead of the derived one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest

NO_TESTS_COLLECTED = 5
REDIS_DATABASES = 16  # Redis' default `databases`
INTERRUPT_GRACE_SECONDS = 60.0  # for its fixtures to kill their workers and drop the test database
PR_SET_PDEATHSIG = 1


def own_database(url: str) -> str:
    """The same server, another database: each session creates (and drops) its own test database."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"{parts.path}_example"))


def redis_database_beside(number: int) -> int:
    """The Redis database of the example session, given the library session's: the next one (the one before, from
    the last). Example: the suite's default broker, database 15, gives 14; `redis://127.0.0.1:6379/3` gives 4."""
    return number + 1 if number + 1 < REDIS_DATABASES else number - 1


def own_broker(url: str) -> str:
    """A broker of the example session's own on the same server: another Redis database, or another RabbitMQ vhost
    (`<vhost>_example`, created if missing)."""
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        number = int(parts.path.strip("/") or 0)
        return urlunsplit(parts._replace(path=f"/{redis_database_beside(number)}"))
    if parts.scheme.startswith("amqp"):
        vhost = unquote(parts.path[1:]) or "/"
        own = "example" if vhost == "/" else f"{vhost}_example"
        add_rabbitmq_vhost(own, parts.username or "guest")
        return urlunsplit(parts._replace(path="/" + quote(own, safe="")))
    raise pytest.UsageError(
        f"the example project's tests need a broker of their own beside CELERY_BROKER_URL={url}: set "
        "DURABLE_TEST_EXAMPLE_BROKER_URL (a Redis database or a RabbitMQ vhost no other session uses)"
    )


def add_rabbitmq_vhost(name: str, user: str) -> None:
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)

    if name not in ctl("list_vhosts").stdout.split():
        ctl("add_vhost", name)
    ctl("set_permissions", "-p", name, user, ".*", ".*", ".*")


def example_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The example session's environment: this one's, with a database, a broker, a var dir and artifacts of its own."""
    env = {
        **environ,
        "DATABASE_URL": own_database(environ["DATABASE_URL"]),
        "CELERY_BROKER_URL": environ.get("DURABLE_TEST_EXAMPLE_BROKER_URL") or own_broker(environ["CELERY_BROKER_URL"]),
        "DURABLE_VAR_DIR": tempfile.mkdtemp(prefix="durable-tests-example-"),
    }
    if environ.get("DURABLE_TEST_ARTIFACTS"):
        env["DURABLE_TEST_ARTIFACTS"] = str(Path(environ["DURABLE_TEST_ARTIFACTS"]) / "example")
    return env


def example_args(config: pytest.Config, tests: tuple[str, ...], settings: str) -> list[str]:
    """`python -m pytest` of the example project's tests, with this session's -m, --maxfail and --durations."""
    args = [sys.executable, "-m", "pytest", *tests, "--ds", settings, "-p", "no:cacheprovider", "-q"]
    if config.getoption("markexpr"):
        args += ["-m", config.getoption("markexpr")]
    if config.getoption("maxfail"):
        args += ["--maxfail", str(config.getoption("maxfail"))]
    if config.getoption("durations", None) is not None:
        args += [f"--durations={config.getoption('durations')}"]
    return args


def _interrupted_with_parent() -> None:
    """In the child, before exec: SIGINT when the process that started it dies, however it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)


class ExampleSession:
    """The example project's pytest session in a subprocess; its report goes to `log_path`."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, log_path: Path, markexpr: str = "") -> None:
        self.args, self.env, self.cwd, self.log_path, self.markexpr = args, env, cwd, log_path, markexpr
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False

    def __repr__(self) -> str:
        code = self.process.returncode if self.process is not None else None
        return f"<the example project's session, exit {code}, report {self.log_path}>"

    def start(self) -> ExampleSession:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.args,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the terminal reaches this session only; it passes one on
                preexec_fn=_interrupted_with_parent if sys.platform == "linux" else None,
            )
        return self

    def wait(self, timeout: float | None = None) -> int:
        assert self.process is not None, "the example session was not started"
        return self.process.wait(timeout=timeout)

    @property
    def passed(self) -> bool:
        """It exited 0, or collected nothing under a -m that selects none of its tests."""
        assert self.process is not None and self.process.returncode is not None, "the example session still runs"
        code = self.process.returncode
        return code == 0 or bool(self.markexpr and code == NO_TESTS_COLLECTED)

    def report(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def outcome(self) -> str:
        """Its last line ("12 passed in 3.4s"), or that it was stopped or still runs."""
        if self.process is None:
            return "not started"
        if self.process.returncode is None:
            return "still running"
        if self.stopped:
            return f"interrupted, this session ended first (exit {self.process.returncode})"
        lines = [line for line in self.report().splitlines() if line.strip()]
        return lines[-1].strip("= ") if lines else f"exit {self.process.returncode}, no output"

    def stop(self) -> None:
        """Interrupt it (its fixtures kill their workers and drop its test database), then kill what is left."""
        if self.process is None or self.process.poll() is not None:
            return
        self.stopped = True
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=INTERRUPT_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
