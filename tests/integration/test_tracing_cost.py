"""Tracing costs a step no query: the run's trace context comes with the claim (hotpath.RUN_FIELDS), and a step
attempt's span is made from it in memory, on or off."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents import api
from durable_agents.engine.advance import advance

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
