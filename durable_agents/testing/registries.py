"""The process's registries of workflows, tools and participants, isolated for one test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from durable_agents.agents.participants import participants
from durable_agents.tools import tools
from durable_agents.workflows import registry


@contextmanager
def isolated_registries() -> Iterator[None]:
    """Register workflows, tools and participants for the block only: all three registries are as they were after.

    What a block registers lives in this process only: worker subprocesses load the workflows of your apps'
    `workflows` modules, so a workflow registered here is one to run with `drive`. Example::

        with isolated_registries():
            workflow("scratch", steps=[call("only", lambda ctx: {"ok": True})])
            assert drive(api.start("scratch").id).status == "completed"
    """
    with registry.isolated(), tools.isolated(), participants.isolated():
        yield
