"""Instrumentation for chaos workers: count every execution and every commit of every step, in a side table.

Loaded only by worker subprocesses (tests/chaos/settings.py), after `durable_agents` registered the workflows:

* each step of the instrumented workflows (DURABLE_CHAOS_RECORD, default "refund_agent") first inserts an
  `Execution` row in autocommit, flagged `after_commit` if the step's checkpoint was already committed —
  a committed step executing again is the broken guarantee the chaos tests look for;
* every fenced step commit (the `step_committed` signal, sent once the checkpoint committed) inserts an
  `Execution` row named `commit:<step_id>`: two of them for one step would be a step committed twice;
* every request of the "anthropic" participant first inserts an `Execution` row named `ask:<step_id>:<turn>`
  with the asking process's pid, after the engine proved the lease and right before the request leaves: a
  request the fake saw after its turn was journaled is then attributed to the process that sent it;
* DURABLE_CHAOS_STREAM=1 makes the "anthropic" participant stream, so mid-stream errors are exercised.

The workflows under test are not changed: their step functions are wrapped, and the wrapper calls them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

from django.apps import AppConfig

COMMIT_PREFIX = "commit:"
ASK_PREFIX = "ask:"


class ChaosConfig(AppConfig):
    name = "tests.chaos"
    label = "chaos"

    def ready(self) -> None:
        from durable_agents.signals import step_committed
        from durable_agents.workflows import registry

        for name in filter(None, os.environ.get("DURABLE_CHAOS_RECORD", "refund_agent").split(",")):
            for version in registry.versions(name):
                definition = registry.get(name, version)
                steps = tuple(dataclasses.replace(s, fn=_recorded(s.fn)) if s.fn else s for s in definition.steps)
                registry.register(dataclasses.replace(definition, steps=steps), replace=True)
        step_committed.connect(_record_commit, dispatch_uid="chaos-record-commit")
        from durable_agents.agents.claude import AnthropicParticipant
        from durable_agents.agents.participants import participants

        model = AnthropicParticipant(stream=os.environ.get("DURABLE_CHAOS_STREAM") == "1")
        participants.register("anthropic", _RecordedParticipant(model))


def _recorded(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(fn)
    def step(ctx: Any) -> Any:
        from tests.testapp.workflows import record_execution

        record_execution(ctx)
        return fn(ctx)

    return step


def _record_commit(sender: Any, run_id: Any, step_id: str, attempt: int, **kwargs: Any) -> None:
    from tests.testapp.models import Execution

    Execution.objects.create(run_id=run_id, step_id=f"{COMMIT_PREFIX}{step_id}", pid=os.getpid(), attempt=attempt)


class _RecordedParticipant:
    """The real Anthropic participant, recording each request (pid, step, turn) just before it is sent."""

    name = "anthropic"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def respond(self, request: Any) -> Any:
        from tests.testapp.models import Execution

        run_id, _, step_id = str(request.metadata.get("user_id", "")).partition(":")
        turn = request.turn if request.purpose == "turn" else 0
        Execution.objects.create(run_id=run_id, step_id=f"{ASK_PREFIX}{step_id}:{turn}", pid=os.getpid(), attempt=0)
        return self.inner.respond(request)
