"""The fixtures of durable_agents' pytest plugin (durable_agents/testing/pytest_plugin.py), for this checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_agents.testing import pytest_plugin

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    # Installed, durable_agents brings the plugin in by its `pytest11` entry point; from a checkout it is not,
    # so it is registered here, under the same name. pluggy refuses one module under two names.
    if not config.pluginmanager.is_registered(pytest_plugin):
        config.pluginmanager.register(pytest_plugin, "durable_agents")
