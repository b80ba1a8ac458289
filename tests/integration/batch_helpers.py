"""What the batch delivery tests share: the "anthropic" participant and the batcher on a fresh fake Messages API
with its batches endpoints, workflows defined for one test, and a run driven to its end with the batcher in this
process."""

from __future__ import annotations

import anthropic
import pytest

from durable_agents.agents import batcher
from durable_agents.engine.advance import advance
from durable_agents.models import Run
from durable_agents.workflows import registry, workflow
from tests.integration.test_agent_faults import API_KEY, claude_on_the_fake

MODEL = "claude-sonnet-5-5"
FAST = {"BATCH_WINDOW_SECONDS": 0, "BATCH_POLL_SECONDS": 0.001, "BATCH_POLL_MAX_SECONDS": 0.001}


@pytest.fixture
def batch_fake(monkeypatch, settings):
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, **FAST}
    with claude_on_the_fake(monkeypatch, timeout=5) as server:
        yield server


@pytest.fixture
def batched_workflows():
    names = []

    def define(name, steps, **options):
        names.append(name)
        return workflow(name, steps=steps, replace=True, **options)

    yield define
    for name in names:
        registry.unregister(name)


def client_of(fake) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=API_KEY, base_url=fake.url, max_retries=0, timeout=5)


def settle(fake, run_id, *, passes: int = 20) -> Run:
    """Advance the run while it can go; let the batcher send and collect while it waits; until it finishes."""
    client = client_of(fake)
    for _ in range(passes):
        run = Run.objects.get(pk=run_id)
        while run.status in ("pending", "running"):
            Run.objects.filter(pk=run_id).update(wake_at=None)
            advance(run_id)
            run.refresh_from_db()
        if run.is_finished:
            return run
        batcher.run_pass(client)
        batcher.run_pass(client)
    raise AssertionError(f"run {run_id} still {Run.objects.get(pk=run_id).status}")
