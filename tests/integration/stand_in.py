"""Helpers of the tests that run agent, judge and planner steps in this process against the strict stand-in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anthropic

from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants
from durable_agents.models import Run, RunStatus
from durable_agents.testing import drive
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, RecordedRequest, Reply

API_KEY = "sk-ant-test-secret-0123456789"


@contextmanager
def claude_on_the_stand_in() -> Iterator[FakeAnthropic]:
    """The "anthropic" participant of this process: the real SDK pointed at a strict stand-in (call it inside
    `isolated_registries`, which forgets the participant after the test)."""
    with FakeAnthropic() as server:
        client = anthropic.Anthropic(api_key=API_KEY, base_url=server.url, max_retries=0, timeout=5.0)
        participants.register("anthropic", AnthropicParticipant(client=client))
        yield server


def refused(fake: FakeAnthropic) -> list[str]:
    """What the stand-in refused: requests the real API would refuse too."""
    return [r.refused for r in fake.requests if r.refused]


def sent(fake: FakeAnthropic) -> list[RecordedRequest]:
    return [r for r in fake.requests if r.path == "/v1/messages"]


def finish(run_id: Any) -> Run:
    """Drive the run in this process, clearing retry backoffs: the assertions are on outcomes, not time."""
    for _ in range(20):
        Run.objects.filter(pk=run_id).update(wake_at=None)
        run = drive(run_id, max_advances=50)
        if run.status not in (RunStatus.PENDING, RunStatus.RUNNING):
            return run
    return Run.objects.get(pk=run_id)


def is_compaction(request: RecordedRequest) -> bool:
    return "[compaction]" in request.last_user_text


def scripted(*actions: Reply | Fault) -> Callable[[RecordedRequest], Reply | Fault]:
    """Serve `actions` in order to the agent's turns (then "done"); a compaction call (the agent loop's summary
    request) gets a summary and takes no action of the script."""
    queue = list(actions)

    def answer(request: RecordedRequest) -> Reply | Fault:
        if is_compaction(request):
            return Reply.text("Summary: orders looked up so far.")
        return queue.pop(0) if queue else Reply.text("done")

    return answer


def unmarked(value: Any) -> Any:
    """`value` without its cache_control markers, key order kept."""
    if isinstance(value, dict):
        return {k: unmarked(v) for k, v in value.items() if k != "cache_control"}
    return [unmarked(v) for v in value] if isinstance(value, list) else value
