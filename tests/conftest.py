"""The test suite's two sessions, and the fixtures of durable_agents' pytest plugin.

The library's tests run on tests/settings.py, which knows nothing of the example project (project/). The
example project's tests (EXAMPLE_TESTS) need its `refunds` app installed in the test process, and Django reads
its settings once per process: so they run in a pytest session of their own, on tests/example_settings.py; this
session does not collect them. `python -m pytest` runs both: when tests/test_example_project.py's test is selected,
the example session starts as soon as collection ends and runs beside this one (tests/example_session.py says what
keeps them apart), and that test, moved last, waits for it. To run some of them directly:
`python -m pytest --ds tests.example_settings tests/chaos/test_sigkill.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from django.apps import apps

from durable_agents.testing import pytest_plugin
from tests import example_session

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
EXAMPLE_TESTS = (
    "tests/chaos",
    "tests/e2e/test_demo.py",
    "tests/e2e/test_otlp_export.py",
    "tests/e2e/test_sqlite_smoke.py",
    "tests/integration/test_durable_replay_command.py",
    "tests/integration/test_refund_agent.py",
    "tests/integration/test_replay_admission.py",
    "tests/integration/test_replay_lab.py",
    "tests/integration/test_replay_lab_edges.py",
    "tests/integration/test_secret_key.py",
)
EXAMPLE_SETTINGS = "tests.example_settings"
EXAMPLE_PROJECT_TEST = TESTS / "test_example_project.py"
EXAMPLE_SESSION = pytest.StashKey[example_session.ExampleSession]()


def is_example_session() -> bool:
    """True in the session of the example project's tests (its settings install project.refunds)."""
    return apps.is_installed("project.refunds")


def is_example_test(path: Path) -> bool:
    return any(path == ROOT / test or (ROOT / test) in path.parents for test in EXAMPLE_TESTS)


def require_example_session() -> None:
    """Stop, saying how to run them, when the example project's tests are asked for on the library's settings."""
    if not is_example_session():
        raise pytest.UsageError(
            f"the example project's tests run on its own settings: add --ds {EXAMPLE_SETTINGS} "
            "(a plain `python -m pytest` runs them through tests/test_example_project.py)"
        )


def pytest_configure(config: pytest.Config) -> None:
    # Installed, durable_agents brings the plugin in by its `pytest11` entry point; from a checkout it is not,
    # so it is registered here, under the same name. pluggy refuses one module under two names.
    if not config.pluginmanager.is_registered(pytest_plugin):
        config.pluginmanager.register(pytest_plugin, "durable_agents")
    asked = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    if any(is_example_test(path) for path in asked):
        require_example_session()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not is_example_session() and is_example_test(collection_path):
        return True
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The test that waits for the example session goes last: every other test runs while that session does."""
    waiting = [item for item in items if item.path == EXAMPLE_PROJECT_TEST]
    items[:] = [item for item in items if item.path != EXAMPLE_PROJECT_TEST] + waiting


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the example project's session now, beside this one, if its test is selected (not for a subset)."""
    config = session.config
    if config.option.collectonly or is_example_session():
        return
    if not any(item.path == EXAMPLE_PROJECT_TEST for item in session.items):
        return
    artifacts = os.environ.get("DURABLE_TEST_ARTIFACTS")
    log_path = (
        Path(artifacts) / "example-session.log"
        if artifacts
        else Path(tempfile.mkstemp(prefix="durable-example-session-", suffix=".log")[1])
    )
    config.stash[EXAMPLE_SESSION] = example_session.ExampleSession(
        example_session.example_args(config, EXAMPLE_TESTS, EXAMPLE_SETTINGS),
        example_session.example_environ(os.environ),
        cwd=ROOT,
        log_path=log_path,
        markexpr=config.getoption("markexpr"),
    ).start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Ended before its test waited for it (--maxfail, Ctrl-C): interrupted, so it kills its workers and drops its
    # test database.
    running = session.config.stash.get(EXAMPLE_SESSION, None)
    if running is not None:
        running.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    running = config.stash.get(EXAMPLE_SESSION, None)
    if running is not None:
        terminalreporter.write_line(f"example project's session: {running.outcome()} (report: {running.log_path})")


@pytest.fixture
def manage(worker_env) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `manage.py ARGS` in a subprocess with the workers' environment (this test's database and settings)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=worker_env, capture_output=True, text=True, timeout=120
        )

    return run
