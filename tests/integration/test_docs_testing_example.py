"""The testing how-to's example, run as it is printed: its files in a user's project, its test on a real worker.

docs/howto/testing.md ("How to test your workflows") includes docs/examples/testing/ verbatim (literalinclude):
the page shows exactly the files this test runs.
"""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.integration.user_project import run_user_tests, write_user_project

pytest_plugins = ["pytester"]

EXAMPLE = ROOT / "docs" / "examples" / "testing"
PAGE = ROOT / "docs" / "howto" / "testing.md"


def test_docs__the_testing_example_passes_in_a_users_project(pytester: pytest.Pytester, monkeypatch):
    write_user_project(
        pytester,
        models=(EXAMPLE / "shop" / "models.py").read_text(),
        workflows=(EXAMPLE / "shop" / "workflows.py").read_text(),
        tests={"test_refund_request.py": (EXAMPLE / "tests" / "test_refund_request.py").read_text()},
    )

    result = run_user_tests(pytester, monkeypatch)

    result.assert_outcomes(passed=1)


def test_docs__the_testing_page_includes_the_example_files():
    page = PAGE.read_text()
    for name in ("shop/models.py", "shop/workflows.py", "tests/test_refund_request.py"):
        assert f"{{literalinclude}} ../examples/testing/{name}" in page, (
            f"docs/howto/testing.md no longer includes docs/examples/testing/{name}, which this test runs"
        )
