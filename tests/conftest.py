"""The test suite's two sessions, and the fixtures of durable_agents' pytest plugin.

The library's tests run on tests/settings.py, which knows nothing of the example project (project/). The
example project's tests (EXAMPLE_TESTS) need its `refunds` app installed in the test process, and Django reads
its settings once per process: so they run in a pytest session of their own, on tests/example_settings.py,
which tests/test_example_project.py starts; this session does not collect them. `python -m pytest` runs both.
To run some of them directly: `python -m pytest --ds tests.example_settings tests/chaos/test_sigkill.py`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from django.apps import apps

from durable_agents.testing import pytest_plugin

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


@pytest.fixture
def manage(worker_env) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `manage.py ARGS` in a subprocess with the workers' environment (this test's database and settings)."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=ROOT, env=worker_env, capture_output=True, text=True, timeout=120
        )

    return run
