"""The model worker's parts that need no services: retry spread, the shared Anthropic client, the fake's gate."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from django.test import override_settings

from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.engine.advance import _delay
from durable_agents.engine.retry import Failure
from durable_agents.testing.fake_anthropic import FakeAnthropic
from durable_agents.workflows import RetryPolicy


def _throttled(retry_after: float | None) -> Failure:
    return Failure(True, "ModelUnavailableError", "model API 429", "ask", retry_after=retry_after)


def test_retry_after__is_never_shortened_and_a_thousand_runs_do_not_return_together():
    policy = RetryPolicy(max_attempts=5, backoff=0.5, backoff_max=60)
    delays = [_delay(policy, 1, _throttled(5.0)) for _ in range(1000)]

    assert min(delays) >= 5.0, "a run came back before the service's retry-after"
    assert max(delays) <= 10.0, "RETRY_AFTER_JITTER 1.0 spreads over one more retry-after at most"
    per_second = [sum(1 for d in delays if s <= d < s + 1) for s in range(5, 10)]
    assert max(per_second) < 300, f"the retries bunch up: {per_second} per second"
    assert statistics.pstdev(delays) > 1.0


@override_settings(DURABLE_AGENTS={"RETRY_AFTER_JITTER": 0.0, "RETRY_AFTER_MAX_SECONDS": 7.0})
def test_retry_after__without_jitter_is_exact_and_still_capped():
    policy = RetryPolicy(max_attempts=5, backoff=0.01, backoff_max=0.02)
    assert _delay(policy, 1, _throttled(5.0)) == 5.0
    assert _delay(policy, 1, _throttled(3600.0)) == 7.0
    assert _delay(policy, 1, _throttled(None)) <= 0.02


@override_settings(DURABLE_AGENTS={"MODEL_MAX_CONNECTIONS": 250})
def test_anthropic_client__one_set_per_process_shared_by_threads_and_sized_by_the_setting(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
    participant = AnthropicParticipant()
    barrier = threading.Barrier(16)

    def clients_seen_by_a_thread(_: int) -> list[int]:
        barrier.wait()  # all threads ask for a client at the same moment
        return [id(participant.client) for _ in range(10)]

    with ThreadPoolExecutor(16) as threads:
        clients = {c for seen in threads.map(clients_seen_by_a_thread, range(16)) for c in seen}

    # 250 connections in pools of 50, taken in turn: five clients for the whole process, whichever thread asks.
    assert len(clients) == 5, f"{len(clients)} clients: threads made their own, or the pools are not shared"
    pools = [participant.client._client._transport._pool for _ in range(5)]
    assert {(p._max_connections, p._max_keepalive_connections) for p in pools} == {(100, 50)}
    assert participant.client.max_retries == 0, "the engine owns retries"
    assert participant.remote, "a step gives its database connection back while Claude thinks"


def test_fake__holds_requests_in_flight_until_released():
    with FakeAnthropic() as fake:
        client = fake.client(max_retries=0)
        fake.hold(when=lambda request: request.turn >= 1)
        first = client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert first.content[-1].text == "ok", "a first turn is not held"

        later = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "and?"},
        ]
        with ThreadPoolExecutor(3) as threads:
            answers = [threads.submit(client.messages.create, model="m", max_tokens=5, messages=later) for _ in "abc"]
            assert fake.wait_in_flight(3, timeout=30), "three second turns wait at the gate"
            assert not any(a.done() for a in answers)
            fake.release()
            assert all(a.result(timeout=30).content[-1].text == "ok" for a in answers)
        assert fake.in_flight == 0 and fake.peak_in_flight == 3


def test_fake__latency_delays_every_answer():
    with FakeAnthropic(latency=0.3) as fake:
        client = fake.client(max_retries=0)
        started = time.monotonic()
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - started >= 0.3
