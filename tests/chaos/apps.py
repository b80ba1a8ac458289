"""Instrumentation for chaos workers: count every execution and every commit of every step, in a side table.

Loaded only by worker subprocesses (tests/chaos/settings.py), after `durable_agents` registered the workflows:

* each step of the instrumented workflows (DURABLE_CHAOS_RECORD, default "refund_agent") first inserts an
  `Execution` row in autocommit, flagged `after_commit` if the step's checkpoint was already committed —
  a committed step executing again is the broken guarantee the chaos tests look for;
* every fenced step commit (the `step_committed` signal, sent once the checkpoint committed) inserts an
  `Execution` row named `commit:<step_id>`: two of them for one step would be a step committed twice;
* every request of the "anthropic" participant carries the sending process's pid in a header
  (`x-chaos-pid`), so a request the fake saw after its turn was journaled is attributed to the process
  that sent it;
* DURABLE_CHAOS_STREAM=1 makes the "anthropic" participant stream, so mid-stream errors are exercised;
* DURABLE_CHAOS_BATCH=1 sends the instrumented workflows' model calls through the Message Batches API
  (`delivery="batch"`), with the kill points of batch_points.py;
* DURABLE_CHAOS_TRACES=<dir> (with the example project's SDK on: OTEL_TRACES_EXPORTER, `celery -A project`) also
  writes every span each pool process ends to <dir>/spans-<pid>.jsonl, one JSON object a line, as it ends (the
  SDK's SimpleSpanProcessor and ConsoleSpanExporter): what a SIGKILL cannot take back.

The workflows under test are not changed: their step functions are wrapped, and the wrapper calls them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import anthropic
from django.apps import AppConfig

from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.conf import settings

COMMIT_PREFIX = "commit:"
PID_HEADER = "x-chaos-pid"


class ChaosConfig(AppConfig):
    name = "tests.chaos"
    label = "chaos"

    def ready(self) -> None:
        from durable_agents.signals import step_committed
        from durable_agents.workflows import Batch, registry

        batched = os.environ.get("DURABLE_CHAOS_BATCH") == "1"
        for name in filter(None, os.environ.get("DURABLE_CHAOS_RECORD", "refund_agent").split(",")):
            for version in registry.versions(name):
                definition = registry.get(name, version)
                steps = tuple(dataclasses.replace(s, fn=_recorded(s.fn)) if s.fn else s for s in definition.steps)
                changes: dict[str, Any] = {"steps": steps, **({"delivery": Batch()} if batched else {})}
                registry.register(dataclasses.replace(definition, **changes), replace=True)
        if batched:
            from tests.chaos import batch_points

            batch_points.install()
        step_committed.connect(_record_commit, dispatch_uid="chaos-record-commit")
        if os.environ.get("DURABLE_CHAOS_TRACES"):
            from celery.signals import worker_process_init

            worker_process_init.connect(_trace_to_file, weak=False, dispatch_uid="chaos-trace-to-file")
        from durable_agents.agents.participants import participants

        participants.register("anthropic", _SignedParticipant(stream=os.environ.get("DURABLE_CHAOS_STREAM") == "1"))


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


def _trace_to_file(**kwargs: Any) -> None:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    from project import tracing

    provider = tracing.configure(tracing.WORKER, celery=True)
    if provider is None:
        raise RuntimeError("DURABLE_CHAOS_TRACES needs the example project's SDK on: set OTEL_TRACES_EXPORTER")
    path = os.path.join(os.environ["DURABLE_CHAOS_TRACES"], f"spans-{os.getpid()}.jsonl")
    out = open(path, "a", buffering=1)  # noqa: SIM115 - the process's life long; each line reaches the OS as written
    exporter = ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")
    provider.add_span_processor(SimpleSpanProcessor(exporter))


class _SignedParticipant(AnthropicParticipant):
    """The real Anthropic participant; each process's client sends its pid, so the fake knows who asked."""

    @property
    def client(self) -> Any:
        # A prefork child inherits the parent's objects: one client per process, built in the process.
        if getattr(self, "_pid", None) != os.getpid():
            self._pid = os.getpid()
            self._client = anthropic.Anthropic(
                max_retries=0,
                timeout=float(settings.MODEL_TIMEOUT_SECONDS),
                default_headers={PID_HEADER: str(os.getpid())},
            )
        return self._client
