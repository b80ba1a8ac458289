"""The Anthropic fault matrix at volume: refund_agent runs on real workers while the fake Messages API fails a
share of requests with every transient failure the API has — 429 with retry-after, 500, 502, 529, timeouts,
connection resets, and, for the worker that streams, resets and error events mid-stream.

Every fault must cost exactly one retry (the engine owns retries; the SDK's are off) and nothing else: every
run completes, no effect is repeated, a turn is journaled from the one request that was answered, and a 429's
retry waits at least as long as its retry-after.

Counts scale with DURABLE_CHAOS_SCALE (default 1: 24 runs); full count::

    DURABLE_CHAOS_SCALE=25 scripts/test tests/chaos -k fault_matrix -s
"""

from __future__ import annotations

import itertools
import random
import threading
import zlib
from collections import Counter

import pytest

from durable_agents.models import Event
from durable_agents.testing.fake_anthropic import Fault, RecordedRequest, Reply
from tests.chaos.fleet import Fleet, prefork
from tests.chaos.workload import (
    check,
    describe,
    fault_name,
    make_cases,
    scaled,
    seed,
    start,
    timeout,
    wait_until_finished,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, timeout()]

RUNS = scaled(24)
# Long enough that an answered request never times out on a loaded machine; a timeout fault outlasts it.
CLIENT_TIMEOUT = 3.0
RETRY_AFTER = 1
# At most this many faults for one turn, so no step exhausts its retry policy.
FAULTS_PER_TURN = 2
FAULT_RATE = 0.4

PLAIN = (
    Fault.status(429, headers={"retry-after": str(RETRY_AFTER)}),
    Fault.status(500),
    Fault.status(502),
    Fault.status(529),
    Fault.delay(CLIENT_TIMEOUT + 3, then=Reply.text("too late")),  # the client has timed out by then
    Fault.reset(),
)
STREAMING = (
    Fault.status(429, headers={"retry-after": str(RETRY_AFTER)}),
    Fault.status(529),
    Fault.delay(CLIENT_TIMEOUT + 3, then=Reply.text("too late")),
    Fault.reset(mid_stream=True),
    Fault.stream_error("overloaded_error", "Overloaded", partial_text="I'll look the order up"),
    Fault.stream_error("api_error", "Internal server error"),
)


class Injector:
    """Fails a share of requests (at most FAULTS_PER_TURN per turn), taking the faults in turn from the matrix,
    so every kind is served at volume."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = {False: itertools.cycle(PLAIN), True: itertools.cycle(STREAMING)}

    def __call__(self, request: RecordedRequest) -> Fault | None:
        if request.attempt > FAULTS_PER_TURN:
            return None
        rng = random.Random(zlib.crc32(f"{request.conversation}:{request.turn}:{request.attempt}".encode()))
        if rng.random() >= FAULT_RATE:
            return None
        with self._lock:
            return next(self._next[request.stream])


def test_fault_matrix__every_transient_model_error_costs_one_retry_and_nothing_else(chaos_env, chaos_logs, fake, model):
    model.fault = Injector()
    env = {**chaos_env, "DURABLE_CHAOS_MODEL_TIMEOUT": str(CLIENT_TIMEOUT)}
    cases = make_cases(RUNS, random.Random(5))
    seed(cases)
    with Fleet(env, chaos_logs, [prefork(2, beat=True), prefork(2, DURABLE_CHAOS_STREAM="1")]):
        runs = {start(case): case for case in cases}
        left = wait_until_finished(runs, timeout=300 * max(1.0, RUNS / 24))
        assert not left, f"{len(left)} runs did not finish:\n  {describe(left)}"

    report = check(runs, fake)
    retries = list(Event.objects.filter(run_id__in=list(runs), kind="step_retry"))
    served = Counter((kind, "stream" if stream else "plain") for _conv, _turn, kind, stream in model.faults)
    print(
        f"\nModel fault matrix: {len(runs)} refund_agent runs, {len(model.faults)} faults served "
        f"({dict(sorted(served.items()))}), {len(retries)} retries\n  {report.summary()}"
    )
    report.assert_ok()
    assert {e.detail["error"]["type"] for e in retries} <= {"ModelUnavailableError"}, "only model faults retried"
    assert len(retries) == len(model.faults), "every fault served costs exactly one retry of its step"
    ids = {str(run_id) for run_id in runs}
    twice = {key: n for key, n in model.answered.items() if n != 1 and key[0].split(":")[0] in ids}
    assert not twice, f"turns answered more than once (a retry asked an answered turn again): {twice}"
    # By the status the message starts with: "429" can also stand in a random request id of another error's body.
    waited = [e.detail["delay_seconds"] for e in retries if e.detail["error"]["message"].startswith("model API 429:")]
    assert waited, "no 429 was retried: the matrix serves them at volume"
    assert all(delay >= RETRY_AFTER for delay in waited), f"a 429 retried before its retry-after: {waited}"
    assert {fault_name(f) for f in PLAIN} <= {kind for kind, how in served if how == "plain"}, served
    assert {fault_name(f) for f in STREAMING} <= {kind for kind, how in served if how == "stream"}, served


@pytest.fixture
def streaming_model(monkeypatch):
    """This process's "anthropic" participant streams from a fake server (no worker)."""
    import anthropic

    from durable_agents.agents.claude import AnthropicParticipant
    from durable_agents.agents.participants import participants
    from durable_agents.testing.fake_anthropic import FakeAnthropic

    with FakeAnthropic() as server:
        client = anthropic.Anthropic(api_key="test-key", base_url=server.url, max_retries=0, timeout=2.0)
        previous = participants._participants.get("anthropic")
        participants.register("anthropic", AnthropicParticipant(client=client, stream=True))
        yield server
        participants._participants.pop("anthropic", None)
        if previous is not None:
            participants.register("anthropic", previous)


def test_fault__a_connection_reset_mid_stream_is_retried(streaming_model):
    from durable_agents import api
    from durable_agents.engine.advance import advance
    from durable_agents.models import Run

    streaming_model.enqueue(Fault.reset(mid_stream=True), Reply.text("All done."))
    run = api.start("agent_charge", {"message": "Charge A-1"})
    for _ in range(10):
        Run.objects.filter(pk=run.id).update(wake_at=None)
        advance(run.id)
        run.refresh_from_db()
        if run.is_finished:
            break
    assert run.status == "completed", f"the run ended {run.status}: {run.error}"
    assert Event.objects.get(run=run, kind="step_retry").detail["error"]["type"] == "ModelUnavailableError"
