"""Shared model rate limits (agents/rate_limits.py), on both backends: real Postgres, real Redis, real SDK.

Nothing here measures wall time: capacities are exhausted with limits so slow (a request a minute) that the
seconds a busy machine takes cannot refill them, and waits are read on the backends' clocks, shifted with
`clock.advance()`.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.db import connection
from django.test import override_settings

from bench.scale_agent import answer
from durable_agents import api, clock
from durable_agents.agents import rate_limits
from durable_agents.agents.messages import ModelRequest, Usage
from durable_agents.agents.participants import participants
from durable_agents.engine.advance import advance
from durable_agents.errors import ModelUnavailableError
from durable_agents.models import Event, RateBucket, Run, RunStatus, Step, Turn
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, Reply
from tests.integration.conftest import MODEL_QUEUE, ROUTED
from tests.integration.test_agent_faults import claude_on_the_fake
from tests.integration.test_agent_scale import start_conversations, wait_all_completed

pytestmark = pytest.mark.django_db(transaction=True)
API_KEY = "sk-ant-test-secret-rate-0123456789"


@pytest.fixture(params=["postgres", "redis"])
def backend_name(request, broker_url):
    """RATE_LIMIT_BACKEND: Postgres, or the test's Redis database (emptied by broker_url)."""
    yield "postgres" if request.param == "postgres" else broker_url
    clock.reset()


def limited(backend: str, model: str, **limits: float):
    """DURABLE_AGENTS with `limits` (per minute) on `model`, kept in `backend`."""
    durable = {**settings.DURABLE_AGENTS, "MODEL_RATE_LIMITS": {model: limits}, "RATE_LIMIT_BACKEND": backend}
    return override_settings(DURABLE_AGENTS=durable)


def unique_model() -> str:
    return f"claude-test-{uuid.uuid4().hex[:8]}"


def tats(backend: str, bucket: str) -> tuple[float, float, float]:
    """The three buckets' theoretical arrival times, as stored."""
    if backend == "postgres":
        row = RateBucket.objects.get(key=bucket)
        return row.requests_tat, row.input_tat, row.output_tat
    stored = redis.Redis.from_url(backend).hmget(f"durable_agents:rate:{bucket}", "requests", "input", "output")
    return tuple(float(value) for value in stored)  # type: ignore[return-value]


@pytest.fixture
def fake(monkeypatch):
    with claude_on_the_fake(monkeypatch, timeout=5, api_key=API_KEY) as server:
        yield server


def request_for(model: str, max_tokens: int = 64) -> ModelRequest:
    return ModelRequest(
        model=model, max_tokens=max_tokens, system="", tools=(), messages=({"role": "user", "content": "hi"},)
    )


def test_race__30_threads_for_a_bucket_of_5_get_exactly_5_reservations(backend_name):
    model = unique_model()
    granted: list[float] = []
    refused: list[float] = []
    ready = threading.Barrier(30)

    def reserve() -> None:
        try:
            ready.wait()
            waited = rate_limits.backend().reserve(f"{model}|k", (60.0, 0.0, 0.0), burst=300.0, max_wait=0.0)
            (granted if waited is not None else refused).append(waited or 0.0)
        finally:
            connection.close()

    # One request a minute, a burst of five minutes: five go now, the sixth not for a minute.
    with limited(backend_name, model, requests_per_minute=1):
        threads = [threading.Thread(target=reserve) for _ in range(30)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)

    assert len(granted) == 5 and len(refused) == 25, f"{len(granted)} of 30 racing callers got a bucket of 5"


def test_race__waiting_callers_line_up_one_interval_apart(backend_name):
    model = unique_model()
    with limited(backend_name, model, requests_per_minute=1):
        backend = rate_limits.backend()
        waits = [backend.reserve(f"{model}|k", (60.0, 0.0, 0.0), burst=60.0, max_wait=1000.0) for _ in range(4)]
    assert waits[0] == 0.0
    # Each wait is measured from its own reserve: the real time between them shortens the later ones a little.
    assert waits[1:] == pytest.approx([60, 120, 180], abs=5), waits


def test_429__its_retry_after_stops_every_other_caller_until_then(backend_name, fake):
    model = unique_model()
    participant = participants.get("anthropic")
    fake.enqueue(Fault.status(429, "slow down", {"retry-after": "40"}))
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **_limits_of(backend_name, model, 600)}):
        with pytest.raises(ModelUnavailableError) as first:
            participant.respond(request_for(model))
        assert first.value.status == 429

        # Another worker: refused by the limiter, before the API is asked, for as long as the 429 said.
        with pytest.raises(ModelUnavailableError) as other:
            participant.respond(request_for(model))
        assert other.value.status is None
        assert 39 <= other.value.retry_after <= 42, other.value.retry_after
        assert len(fake.requests) == 1, "a call was sent while the API's retry-after ran"

        clock.advance(timedelta(seconds=42))
        assert participant.respond(request_for(model)).stop_reason == "end_turn"
    assert len(fake.requests) == 2


def _limits_of(backend: str, model: str, rpm: float) -> dict[str, object]:
    return {
        "MODEL_RATE_LIMITS": {model: {"requests_per_minute": rpm}},
        "RATE_LIMIT_BACKEND": backend,
        "RATE_LIMIT_MAX_WAIT_SECONDS": 5.0,
    }


def test_long_wait__parks_the_step_with_the_limiters_retry_after_and_the_run_completes(backend_name, fake):
    """Two model calls a minute apart, waits of at most 5 s in-process: the second call parks the step."""
    model = settings.DURABLE_AGENTS.get("DEFAULT_MODEL", "claude-sonnet-5-5")
    fake.enqueue(
        Reply.tool_use("lookup_order", {"order_id": "A-1"}, id="t1"),
        Reply.text("Charged."),
    )
    durable = {**settings.DURABLE_AGENTS, **_limits_of(backend_name, model, 1), "DEFAULT_MODEL": model}
    with override_settings(DURABLE_AGENTS=durable):
        run = api.start("agent_charge", {"message": "Charge A-1"})
        advance(run.id)
        run.refresh_from_db()
        assert not run.is_finished and run.wake_at is not None, (run.status, run.error)
        parked_for = (run.wake_at - clock.now()).total_seconds()
        assert parked_for >= 50, f"the step was retried {parked_for:.0f} s later, before the limit had room"
        assert Turn.objects.filter(run_id=run.id).count() == 1, "the first answer is journaled before the park"
        assert run.attempt == 0, "waiting for capacity is not a failed attempt"
        kinds = list(Event.objects.filter(run_id=run.id).values_list("kind", flat=True))
        assert "capacity_wait" in kinds and "step_retry" not in kinds, kinds

        for _ in range(10):
            clock.advance(timedelta(seconds=61))
            Run.objects.filter(pk=run.id).update(wake_at=None)
            advance(run.id)
            run.refresh_from_db()
            if run.is_finished:
                break
    assert run.status == RunStatus.COMPLETED, run.error
    assert Step.objects.get(run_id=run.id, kind="agent").attempts == 1, "one attempt, however long it queued"
    assert [fake.count(r.conversation, r.turn) for r in fake.requests] == [1, 1], "a model call was asked twice"
    assert list(Turn.objects.filter(run_id=run.id).values_list("index", flat=True).order_by("index")) == [0, 1]


def test_usage__corrects_the_input_estimate_and_refunds_unused_output(backend_name):
    model = unique_model()
    request = request_for(model, max_tokens=50).as_kwargs()
    # A token a second in each bucket: a TAT moves by one second per token.
    with limited(backend_name, model, input_tokens_per_minute=60, output_tokens_per_minute=60):
        limiter = rate_limits.RateLimiter(rate_limits.backend())
        reservation = limiter.acquire(model, API_KEY, request, 50)
        assert reservation is not None
        before = tats(backend_name, reservation.bucket)
        limiter.settle(
            reservation, Usage(input_tokens=reservation.input_tokens + 70, cache_write_tokens=30, output_tokens=10)
        )
        after = tats(backend_name, reservation.bucket)
    assert after[1] - before[1] == pytest.approx(100, abs=0.01), "the input beyond the estimate is debited"
    assert after[2] - before[2] == pytest.approx(-40, abs=0.01), "the 40 unused of max_tokens 50 are refunded"


def test_fingerprint__buckets_name_the_key_by_a_hash_never_the_key(backend_name, fake):
    model = unique_model()
    with limited(backend_name, model, requests_per_minute=600):
        participants.get("anthropic").respond(request_for(model))
    print_ = rate_limits.fingerprint(API_KEY)
    assert print_ != API_KEY and API_KEY not in print_ and len(print_) == rate_limits.FINGERPRINT_CHARS
    if backend_name == "postgres":
        names = list(RateBucket.objects.values_list("key", flat=True))
    else:
        names = [key.decode() for key in redis.Redis.from_url(backend_name).keys("durable_agents:rate:*")]
    assert [name for name in names if model in name] and all(API_KEY not in name for name in names)
    assert any(name.endswith(f"{model}|{print_}") for name in names)


# -- real workers ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_limiter", [True, False], ids=["limiter", "no-limiter"])
def test_workers__20_conversations_against_an_api_of_5_requests_a_second(
    with_limiter, routed, start_worker, broker_url
):
    """The fake answers 429 beyond 5 requests a second: with the limiter (4 a second, in Postgres) it never has to."""
    redis.Redis.from_url(broker_url).delete("bench_scale:applied")
    limits = {"MODEL_RATE_LIMITS": {"*": {"requests_per_minute": 240}}} if with_limiter else {}
    with FakeAnthropic(responder=answer, requests_per_second=5) as fake:
        env = {**fake.environ(), "DURABLE_TEST_SETTINGS": json.dumps({**ROUTED, **limits})}
        start_worker(
            pool="gevent",
            concurrency=40,
            env=env,
            extra_args=["--queues", MODEL_QUEUE, "--include", "bench.scale_agent"],
        )
        start_worker(beat=True, env=env, extra_args=["--include", "bench.scale_agent"])
        ids = start_conversations(20)
        wait_all_completed(ids, timeout=240)
        rate_limited = fake.rate_limited
    assert Turn.objects.filter(run_id__in=ids).count() == 40, "each model call is journaled once"
    if with_limiter:
        assert rate_limited == 0, f"the API answered {rate_limited} 429s to calls the limiter let through"
    else:
        assert rate_limited > 0, "without the limiter, 20 conversations at once must exceed 5 requests a second"
