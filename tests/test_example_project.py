"""The example project's tests (tests/conftest.py EXAMPLE_TESTS), in a pytest session of their own on its settings."""

from __future__ import annotations

import os
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import EXAMPLE_SETTINGS, EXAMPLE_TESTS, ROOT, is_example_session

NO_TESTS_COLLECTED = 5


def own_database(url: str) -> str:
    """The same server, another database: each session creates (and drops) its own test database."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"{parts.path}_example"))


@pytest.mark.timeout(3600)  # the chaos suite: each of its tests has the usual timeout in that session
def test_example_project__its_tests_pass_on_its_own_settings(pytestconfig: pytest.Config) -> None:
    if is_example_session():
        pytest.skip("this session runs the example project's tests itself")
    args = [sys.executable, "-m", "pytest", *EXAMPLE_TESTS, "--ds", EXAMPLE_SETTINGS, "-p", "no:cacheprovider", "-q"]
    markexpr = pytestconfig.getoption("markexpr")
    if markexpr:
        args += ["-m", markexpr]
    if pytestconfig.getoption("maxfail"):
        args += ["--maxfail", str(pytestconfig.getoption("maxfail"))]
    env = {**os.environ, "DATABASE_URL": own_database(os.environ["DATABASE_URL"])}

    # Not captured here: the session's report goes to this test's output (shown when it fails, or with -s).
    session = subprocess.run(args, cwd=ROOT, env=env, check=False)

    passed = session.returncode == 0 or (markexpr and session.returncode == NO_TESTS_COLLECTED)
    assert passed, (
        f"the example project's tests failed (exit {session.returncode}); its report is in this test's output. "
        f"Run them alone: DATABASE_URL={env['DATABASE_URL']} python -m pytest --ds {EXAMPLE_SETTINGS} "
        + " ".join(EXAMPLE_TESTS)
    )
