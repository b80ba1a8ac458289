"""The pytest plugin: fixtures for testing workflows on real `celery worker` processes, a fake Messages API,
in-process runs and registries a test can add to.

Installed with durable_agents, it is loaded by pytest itself (the `durable_agents` entry point of group
`pytest11`); from a source checkout, `-p durable_agents.testing.pytest_plugin` (not both: pytest refuses one
module registered under two names). It needs pytest-django, and
settings that read the database from DATABASE_URL (dj-database-url) and the broker from CELERY_BROKER_URL:
that is how worker subprocesses are pointed at the test database and broker. Example::

    @pytest.mark.django_db(transaction=True)
    def test_refund__completes_on_a_worker(start_worker, fake_anthropic):
        fake_anthropic.enqueue(Reply.tool_use("lookup_order", {"order_id": "A-1"}), Reply.text("Done."))
        start_worker()
        run = api.start("refund_agent", {"order_id": "A-1"})
        assert wait_for_run(run.id, "completed").status == "completed"

Fixtures:

broker_url            the test settings' CELERY_BROKER_URL; a Redis broker's database is emptied first
worker_env            environment pointing a worker at this test's database and broker (a transactional test)
start_worker          start_worker(beat=False, pool="solo", env={...}) → a running WorkerProcess, SIGKILLed after
fake_anthropic        a running FakeAnthropic; this process and the test's workers send Messages API calls to it
drive                 `durable_agents.testing.drive`: advance a run in this process until it stops
isolated_registries   workflows, tools and participants registered by the test are forgotten after it

Every test (autouse): engine time moved with `durable_agents.clock.advance` is set back after it, so one test's
lapsed leases and deadlines never reach the next.

Options (ini):

durable_celery_app       the app workers start with (`celery -A APP`); default: $DURABLE_CELERY_APP, else the
                         top package of the settings module (`proj.settings` → `proj`, beside `proj/celery.py`)
durable_worker_settings  DJANGO_SETTINGS_MODULE of the workers; default: the settings of the test process
durable_worker_cwd       where workers start (relative to the rootdir); default: pytest's rootdir

Worker logs go to the test's tmp_path, or to $DURABLE_TEST_ARTIFACTS/<test name>/ when that is set (CI
artifacts); a failed test's report ends with the tail of each of its workers' logs.

Nothing here imports the models at module level: pytest loads this module before pytest-django sets Django
up, so the helpers are reached through `durable_agents.testing`, which loads them on first use.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest
from django.conf import settings
from django.db import connection

from durable_agents import clock, testing
from durable_agents.agents.participants import participants
from durable_agents.testing.fake_anthropic import FakeAnthropic

if TYPE_CHECKING:
    from durable_agents.models import Run
    from durable_agents.testing.workers import WorkerProcess

WORKER_LOGS = pytest.StashKey[list[Path]]()
LOG_TAIL_CHARS = 6000


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("durable_celery_app", "the Celery app worker subprocesses start with (celery -A APP)")
    parser.addini("durable_worker_settings", "DJANGO_SETTINGS_MODULE of worker subprocesses (default: this process's)")
    parser.addini("durable_worker_cwd", "the directory worker subprocesses start in (default: the rootdir)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report shows the end of each worker's log: the traceback of a step is often there."""
    report = yield
    if report.failed:
        for path in item.stash.get(WORKER_LOGS, []):
            text = path.read_text(errors="replace") if path.exists() else ""
            report.sections.append((f"worker log {path}", text[-LOG_TAIL_CHARS:] or "(empty)"))
    return report


def database_url(db: dict[str, Any]) -> str:
    """The DATABASE_URL (dj-database-url's format) of a connection's settings, e.g. the test database's."""
    engine = db["ENGINE"].rsplit(".", 1)[-1]
    if engine == "sqlite3":
        if not db["NAME"] or str(db["NAME"]).startswith(("file:memorydb", ":memory:")):
            pytest.fail(
                "worker_env: the SQLite test database is in memory, where no worker can reach it; give it a file "
                "(DATABASES['default']['TEST']['NAME'])",
                pytrace=False,
            )
        return f"sqlite:///{db['NAME']}"
    scheme = {"postgresql": "postgres", "mysql": "mysql"}.get(engine, engine)
    user = quote(db.get("USER") or "", safe="")
    password = quote(db.get("PASSWORD") or "", safe="")
    credentials = f"{user}:{password}@" if password else f"{user}@" if user else ""
    host = db.get("HOST") or "127.0.0.1"
    port = f":{db['PORT']}" if db.get("PORT") else ""
    return f"{scheme}://{credentials}{host}{port}/{quote(str(db['NAME']), safe='')}"


@pytest.fixture
def broker_url() -> str:
    """The test settings' broker. A Redis broker's database is emptied first, so no message left by an earlier
    test wakes this one's workers: give the tests a Redis database of their own."""
    url = str(settings.CELERY_BROKER_URL)
    if url.startswith(("redis://", "rediss://")):
        import redis

        redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def worker_env(transactional_db: None, broker_url: str, pytestconfig: pytest.Config) -> dict[str, str]:
    """Environment that points a worker subprocess at this test's database and broker; add to it freely.

    Workers see only what is committed, so a test using it runs in real transactions (`transactional_db`).
    """
    # The environment first: under override_settings, settings.SETTINGS_MODULE is None.
    settings_module = (
        pytestconfig.getini("durable_worker_settings")
        or os.environ.get("DJANGO_SETTINGS_MODULE")
        or getattr(settings, "SETTINGS_MODULE", None)
    )
    if not settings_module:
        pytest.fail("worker_env: Django is not configured from a module; set durable_worker_settings", pytrace=False)
    env = {
        "DJANGO_SETTINGS_MODULE": settings_module,
        "DATABASE_URL": database_url(connection.settings_dict),
        "CELERY_BROKER_URL": broker_url,
        "PYTHONUNBUFFERED": "1",
    }
    # Workers import what the tests import: pytest's `pythonpath` ini entries go on theirs too.
    paths = [str(path) for path in pytestconfig.getini("pythonpath")]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@pytest.fixture
def start_worker(
    worker_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: start_worker(beat=False, pool="solo", concurrency=1, env={...}) → a running WorkerProcess.

    Keyword arguments go to WorkerProcess; `env` adds to `worker_env` (e.g. DURABLE_VAR_DIR: a machine with a
    disk of its own). `beat=True` also runs the sweep that recovers runs of killed workers. Every worker is
    SIGKILLed at teardown, before the database is flushed.
    """
    config = request.config
    cwd = config.rootpath / (config.getini("durable_worker_cwd") or ".")
    app = config.getini("durable_celery_app")
    artifacts = (
        Path(os.environ["DURABLE_TEST_ARTIFACTS"]) / request.node.name
        if os.environ.get("DURABLE_TEST_ARTIFACTS")
        else tmp_path
    )
    artifacts.mkdir(parents=True, exist_ok=True)
    logs = request.node.stash.setdefault(WORKER_LOGS, [])
    started: list[WorkerProcess] = []

    def start(*, env: dict[str, str] | None = None, **kwargs: Any) -> WorkerProcess:
        if app:
            kwargs.setdefault("app", app)
        kwargs.setdefault("cwd", cwd)
        kwargs.setdefault("log_path", artifacts / f"worker-{len(started)}.log")
        worker = testing.WorkerProcess(env={**worker_env, **(env or {})}, **kwargs)
        started.append(worker.start())
        if worker.log_path is not None:
            logs.append(worker.log_path)
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def fake_anthropic(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropic]:
    """A running FakeAnthropic (stopped after the test): Messages API calls of this process's "anthropic"
    participant and of the test's workers go to it. Script it with `enqueue(...)` or a `responder`.

    The workers get its address in `worker_env` (and in this process's environment, which they inherit).
    """
    with FakeAnthropic() as fake, participants.isolated():
        for name, value in fake.environ().items():
            monkeypatch.setenv(name, value)
        # The "anthropic" participant keeps its client: made afresh, it reads the fake's address.
        participants.unregister("anthropic")
        if "worker_env" in request.fixturenames:
            request.getfixturevalue("worker_env").update(fake.environ())
        yield fake


@pytest.fixture
def drive(db: None) -> Callable[..., Run]:
    """`durable_agents.testing.drive`: advance a run in this process, without a broker or worker, until it
    completes, fails or waits. Example: `assert drive(api.start("noop", {"steps": 3}).id).status == "completed"`.

    Under this fixture's `db` the test's transaction never commits, so a run with a concurrency key, admitted on
    commit, is admitted by `drive` itself; a run queued behind another run of its key fails naming that run.
    """
    return testing.drive


@pytest.fixture(autouse=True)
def _engine_clock_set_back() -> Iterator[None]:
    yield
    clock.reset()


@pytest.fixture
def isolated_registries() -> Iterator[None]:
    """Workflows, tools and participants the test registers are forgotten after it (in this process only:
    workers know the workflows of your apps' `workflows` modules, so run a test's own workflow with `drive`)."""
    with testing.isolated_registries():
        yield
