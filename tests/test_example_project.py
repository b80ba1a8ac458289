"""The example project's tests (tests/conftest.py EXAMPLE_TESTS), in a pytest session of their own on its settings.

That session was started beside this one when collection ended (tests/example_session.py); this test, run last,
waits for it and shows its report.
"""

from __future__ import annotations

import pytest

from tests.conftest import EXAMPLE_SESSION, EXAMPLE_SETTINGS, EXAMPLE_TESTS, is_example_session


@pytest.mark.timeout(3600)  # the chaos suite: each of its tests has the usual timeout in that session
def test_example_project__its_tests_pass_on_its_own_settings(pytestconfig: pytest.Config) -> None:
    if is_example_session():
        pytest.skip("this session runs the example project's tests itself")
    session = pytestconfig.stash.get(EXAMPLE_SESSION, None)
    assert session is not None, "the example session was not started when collection ended (tests/conftest.py)"

    session.wait()
    # Its report goes to this test's output (shown when it fails, or with -s), and stays in its file.
    print(session.report())
    assert session.passed, (
        f"the example project's tests failed (exit {session.process.returncode}); its report is in this test's "
        f"output and in {session.log_path}. Run them alone: DATABASE_URL={session.env['DATABASE_URL']} "
        f"CELERY_BROKER_URL={session.env['CELERY_BROKER_URL']} python -m pytest --ds {EXAMPLE_SETTINGS} "
        + " ".join(EXAMPLE_TESTS)
    )
