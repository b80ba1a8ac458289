"""Public test helpers: real worker processes, waiting for runs, and a fake Anthropic Messages API.

Example::

    from durable_agents.testing import WorkerProcess, wait_for_run

    with WorkerProcess(env={"DATABASE_URL": url}) as worker:
        run = api.start("noop", {"steps": 3})
        wait_for_run(run.id, "completed")

The names are loaded on first use: pytest imports this package's plugin (`pytest_plugin`) before pytest-django
has set Django up, and most helpers import the models.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_agents.testing.registries import isolated_registries
    from durable_agents.testing.runs import deliver_notifications, drive
    from durable_agents.testing.workers import WorkerProcess, wait_for, wait_for_run

__all__ = ["WorkerProcess", "deliver_notifications", "drive", "isolated_registries", "wait_for", "wait_for_run"]

_MODULES = {
    "WorkerProcess": "durable_agents.testing.workers",
    "deliver_notifications": "durable_agents.testing.runs",
    "drive": "durable_agents.testing.runs",
    "isolated_registries": "durable_agents.testing.registries",
    "wait_for": "durable_agents.testing.workers",
    "wait_for_run": "durable_agents.testing.workers",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)
