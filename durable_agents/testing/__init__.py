"""Public test helpers: real worker processes, waiting for runs, and a fake Anthropic Messages API.

Example::

    from durable_agents.testing import WorkerProcess, wait_for_run

    with WorkerProcess(env={"DATABASE_URL": url}) as worker:
        run = api.start("noop", {"steps": 3})
        wait_for_run(run.id, "completed")
"""

from durable_agents.testing.runs import deliver_notifications, drive
from durable_agents.testing.workers import WorkerProcess, wait_for, wait_for_run

__all__ = ["WorkerProcess", "deliver_notifications", "drive", "wait_for", "wait_for_run"]
