"""The package's `testing` extra is what the README says it is."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_package__the_testing_extra_is_what_the_readme_says_it_is():
    """README sold `durable-agents[testing]` as "the pytest plugin"; the wheel declares no pytest11 entry point and
    durable_agents has no fixtures: the worker fixtures live in this repository's tests/conftest.py only."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = pyproject["project"].get("entry-points", {}).get("pytest11", {})
    readme = (ROOT / "README.md").read_text()
    if not plugins:
        assert "pytest plugin" not in readme, "README promises a pytest plugin that the package does not ship"
