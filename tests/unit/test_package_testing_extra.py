"""The package's `testing` extra is what the documentation says it is."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The pages that sell the extra: the install guide lists it, the testing guide is about it.
PAGES = (ROOT / "docs" / "howto" / "install.md", ROOT / "docs" / "howto" / "testing.md")


def test_package__the_testing_extra_is_what_the_docs_say_it_is():
    """The docs sell `durable-agents[testing]` as "the pytest plugin": the wheel must declare its pytest11 entry
    point, or no page may promise one."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = pyproject["project"].get("entry-points", {}).get("pytest11", {})
    for page in PAGES:
        text = page.read_text()
        if plugins:
            assert "pytest plugin" in text, f"{page.relative_to(ROOT)} no longer says what the testing extra is for"
        else:
            assert "pytest plugin" not in text, f"{page.relative_to(ROOT)} promises a pytest plugin the package lacks"
