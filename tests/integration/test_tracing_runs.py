"""One OpenTelemetry trace per run: the run's span is stored in its row, and every attempt, child run and drawn span
hangs under it, whichever process runs it; a start that does not commit exports nothing; a faulty SDK never fails a
step.

The rules checked are the W3C Trace Context format of the stored `traceparent` (version 00, 32-hex trace id, 16-hex
parent id, 2-hex flags; all-zero ids are invalid) and OpenTelemetry's parent/link model: a span has at most one
parent, in its own trace, and links to spans of other traces (the Celery task span, a fork's source).
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import transaction
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanProcessor

from durable_agents import api, clock
from durable_agents.engine import transitions
from durable_agents.models import Run
from durable_agents.testing import drive
from tests.integration.key_races import key_race

pytestmark = pytest.mark.django_db(transaction=True)

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def test_run_trace__the_run_span_is_the_root_and_every_attempt_its_child(spans):
    run = drive(api.start("noop", {"steps": 2}).id)

    assert TRACEPARENT.match(run.trace_context), run.trace_context
    root = spans.one("run noop")
    assert root.parent is None
    assert f"{root.context.trace_id:032x}-{root.context.span_id:016x}" in run.trace_context
    attempts = spans.named("step tick")
    assert [s.attributes["durable_agents.step.id"] for s in attempts] == ["tick-1", "tick-2"]
    for attempt in attempts:
        assert attempt.parent.span_id == root.context.span_id
        assert attempt.context.trace_id == root.context.trace_id
        assert attempt.attributes["durable_agents.run.id"] == str(run.id)
        assert attempt.attributes["durable_agents.step.attempt"] == 1
        assert attempt.attributes["durable_agents.lease.token"] >= 1
    assert [s.attributes["durable_agents.step.outcome"] for s in attempts] == ["committed", "completed"]
    assert spans.orphans() == []


def test_run_trace__a_start_inside_a_request_span_joins_that_trace(spans):
    tracer = trace.get_tracer("a web framework")
    with tracer.start_as_current_span("POST /refunds") as request:
        started = api.start("noop", {"steps": 1})
    drive(started.id)

    root = spans.one("run noop")
    assert root.parent.span_id == request.get_span_context().span_id
    assert {s.context.trace_id for s in spans.all} == {request.get_span_context().trace_id}


def test_run_trace__an_attempt_under_a_task_span_is_the_runs_child_linked_to_the_task(spans):
    """A Celery task span (opentelemetry-instrumentation-celery) is current when a worker advances: the attempt
    stays in the run's trace, under the run's span, and links to the task span instead of becoming its child."""
    run = api.start("noop", {"steps": 1})
    tracer = trace.get_tracer("celery")
    with tracer.start_as_current_span("run/durable_agents.advance") as task:
        drive(run.id)

    attempt = spans.one("step tick")
    assert attempt.parent.span_id == spans.one("run noop").context.span_id
    assert [link.context.span_id for link in attempt.links] == [task.get_span_context().span_id]


def test_run_trace__a_start_rolled_back_exports_no_run_span(spans):
    with pytest.raises(RuntimeError), transaction.atomic():
        api.start("noop", {"steps": 1})
        raise RuntimeError("the request failed after starting the run")

    assert not Run.objects.exists()
    assert spans.named("run ") == []


def test_run_trace__a_start_with_a_used_idempotency_key_keeps_the_first_trace(spans):
    first = api.start("noop", {"steps": 1}, idempotency_key="order-1")
    again = api.start("noop", {"steps": 1}, idempotency_key="order-1")

    assert again.id == first.id
    assert Run.objects.get(pk=first.id).trace_context == first.trace_context
    assert len(spans.named("run noop")) == 1


def test_run_trace__children_are_in_their_parents_trace_under_the_step_that_started_them(spans):
    parent = api.start("fan_collect", {"items": [{"item": 1}, {"item": 2}]})
    drive(parent.id)
    for child in Run.objects.filter(parent_id=parent.id):
        drive(child.id)
    drive(parent.id)

    fan_attempts = [s for s in spans.named("step fan") if s.attributes["durable_agents.run.id"] == str(parent.id)]
    children = spans.named("run child_work")
    assert len(children) == 2
    assert {c.parent.span_id for c in children} <= {a.context.span_id for a in fan_attempts}
    assert {s.context.trace_id for s in spans.all} == {spans.one("run fan_collect").context.trace_id}
    assert spans.orphans() == []


def test_run_trace__a_fork_is_a_trace_of_its_own_linked_to_its_source(spans):
    source = drive(api.start("noop", {"steps": 2}).id)
    fork = drive(api.fork(source.id, "tick-2").id)

    source_span, fork_span = spans.named("run noop")
    assert fork_span.context.trace_id != source_span.context.trace_id
    assert [link.context.span_id for link in fork_span.links] == [source_span.context.span_id]
    assert fork_span.attributes["durable_agents.run.id"] == str(fork.id)
    fork_attempts = [s for s in spans.named("step") if s.attributes["durable_agents.run.id"] == str(fork.id)]
    assert fork_attempts and all(s.parent.span_id == fork_span.context.span_id for s in fork_attempts)


def test_run_trace__a_run_started_before_tracing_was_on_is_traced_under_its_run_id(spans, settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACING": False}
    run = api.start("noop", {"steps": 2})
    assert Run.objects.get(pk=run.id).trace_context == ""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACING": True}
    drive(run.id)

    attempts = spans.named("step tick")
    assert len(attempts) == 2
    assert {s.context.trace_id for s in attempts} == {run.id.int}
    assert len({s.parent.span_id for s in attempts}) == 1


def test_run_trace__an_attempt_whose_worker_died_is_drawn_from_the_database_times(spans):
    """A SIGKILLed worker never ends its attempt's span: the takeover draws it, from the claim to the lease's
    expiry, failed with `worker_lost`, beside the attempt that took over."""
    run = api.start("noop", {"steps": 1})
    claimed = transitions.claim_run(run.id)
    assert claimed is not None
    now = clock.now()
    Run.objects.filter(pk=run.id).update(
        claimed_at=now - timedelta(seconds=31), lease_expires_at=now - timedelta(seconds=1), lease_owner="dead:1"
    )
    drive(run.id)

    lost, took_over = sorted(spans.named("step tick"), key=lambda s: s.attributes["durable_agents.step.attempt"])
    assert lost.attributes["durable_agents.step.outcome"] == "worker_lost"
    assert lost.attributes["durable_agents.worker"] == "dead:1"
    assert lost.status.status_code == trace.StatusCode.ERROR
    assert lost.end_time - lost.start_time == 30 * 10**9
    assert took_over.attributes["durable_agents.step.attempt"] == lost.attributes["durable_agents.step.attempt"] + 1
    assert took_over.attributes["durable_agents.step.outcome"] == "completed"
    assert lost.parent.span_id == took_over.parent.span_id == spans.one("run noop").context.span_id


class Faulty(SpanProcessor):
    """An application's span processor that raises on every start and end (the API lets it)."""

    def on_start(self, span, parent_context=None):
        raise ValueError("a broken processor")

    def on_end(self, span):
        raise ValueError("a broken processor")


def test_run_trace__a_faulty_sdk_never_fails_a_start_or_a_step(spans):
    provider = trace.get_tracer_provider()
    faulty = Faulty()
    provider._active_span_processor._span_processors += (faulty,)
    try:
        run = api.start("noop", {"steps": 2})
        done = drive(run.id)
    finally:
        processors = provider._active_span_processor._span_processors
        provider._active_span_processor._span_processors = tuple(p for p in processors if p is not faulty)

    assert done.status == "completed"


def test_run_trace__two_starts_racing_on_one_idempotency_key_export_one_run_span(spans):
    """Neither start sees the other's run; the loser's insert waits on the key for the winner, which commits, and it
    returns the winner's run. That run has one span (the winner's): the loser's would be a second `run` span of the
    same run."""
    with key_race("noop", {"steps": 1}, "race-1") as race:
        loser = api.start("noop", {"steps": 1}, idempotency_key="race-1")

    assert race.waited_on and loser.id == race.winner.id, "the racing start should have won the key"
    assert len(spans.named("run noop")) == 1, [dict(s.attributes) for s in spans.named("run noop")]
    (root,) = spans.named("run noop")
    assert root.context.trace_id == int(Run.objects.get(pk=loser.id).trace_context[3:35], 16)
    (reused,) = spans.named("reuse run noop")
    assert reused.attributes["durable_agents.run.id"] == str(loser.id), "the loser's caller sees the run it found"
