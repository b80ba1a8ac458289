"""Tracing costs a step no query: the run's trace context comes with the claim (hotpath.RUN_FIELDS), and a step
attempt's span is made from it in memory, on or off."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance, advance_slice

pytestmark = pytest.mark.django_db(transaction=True)


def _queries_per_step(steps: int = 3) -> list[int]:
    run = api.start("noop", {"steps": steps})
    counts = []
    for _ in range(steps):
        with CaptureQueriesContext(connection) as captured:
            advance(run.id)
        counts.append(len(captured.captured_queries))
    return counts


def test_tracing_cost__a_step_makes_the_same_queries_traced_or_not(spans, settings):
    traced = _queries_per_step()
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TRACING": False}
    untraced = _queries_per_step()

    assert traced == untraced, f"tracing added queries to a step: {traced} traced, {untraced} untraced"
    assert len(spans.named("step tick")) == 3


def test_tracing_cost__an_eager_slice_draws_each_step_under_the_run_span_at_one_statement_a_step(spans, settings):
    """Several steps in one task (engine/eager.py): an attempt span each, every one the run span's child (none under
    the step before it), and still one statement a step."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 50}
    run = api.start("noop", {"steps": 5})
    with CaptureQueriesContext(connection) as captured:
        assert advance_slice(run.id) == Outcome.COMPLETED

    assert len(captured.captured_queries) == 6, "the first claim, then each commit claims the next"
    root = spans.one("run noop")
    attempts = spans.named("step tick")
    assert [s.attributes["durable_agents.step.id"] for s in attempts] == [f"tick-{n}" for n in range(1, 6)]
    assert {s.parent.span_id for s in attempts} == {root.context.span_id}
    assert spans.orphans() == []
