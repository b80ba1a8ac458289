"""The API's anthropic-ratelimit-* headers hold the workers before the API has to answer 429: on both shared backends
(real Postgres, real Redis), through the real SDK over real HTTP.

Nothing here measures wall time: the scripted API fixes its `date` header, so a reset "2 s ahead" is exactly 2 s
after the answer; waits are read off the limiter (RATE_LIMIT_MAX_WAIT_SECONDS 0 reports a hold instead of sleeping
through it) and skipped with `clock.advance()`, which shifts both backends' clocks.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import override_settings

from durable_agents import clock
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.errors import ModelUnavailableError
from tests.unit.test_model_errors import ScriptedAPI, ask, message, ratelimit_headers

pytestmark = pytest.mark.django_db(transaction=True)
RATE_LIMITS_DOC = "https://platform.claude.com/docs/en/api/rate-limits"
ANSWERED = 1_800_000_000.0  # the scripted API's `date`: what every reset below is measured from


@pytest.fixture(params=["postgres", "redis"])
def backend_name(request, broker_url):
    """RATE_LIMIT_BACKEND: Postgres, or the test's Redis database (emptied by broker_url)."""
    yield "postgres" if request.param == "postgres" else broker_url
    clock.reset()


def limits(backend: str, **per_model: dict[str, float]):
    """DURABLE_AGENTS with MODEL_RATE_LIMITS `per_model` kept in `backend`; holds are reported, never slept."""
    durable = {
        **settings.DURABLE_AGENTS,
        "MODEL_RATE_LIMITS": per_model or None,
        "RATE_LIMIT_BACKEND": backend,
        "RATE_LIMIT_MAX_WAIT_SECONDS": 0.0,
    }
    return override_settings(DURABLE_AGENTS=durable)


def unique_model() -> str:
    return f"claude-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def api():
    with ScriptedAPI() as server:
        server.date = ANSWERED
        yield server


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_headers__no_requests_left_holds_the_next_call_until_the_reset_without_a_429(backend_name, api, stream):
    # https://platform.claude.com/docs/en/api/rate-limits : anthropic-ratelimit-requests-remaining 0 and a reset
    # (RFC 3339) 2 s after the answer: a call sent now would be refused.
    model = unique_model()
    api.answer(message("first"), headers=ratelimit_headers(50, 0, ANSWERED + 2))
    claude = AnthropicParticipant(client=api.client(), stream=stream)

    with limits(backend_name, **{model: {"requests_per_minute": 600}}):
        asked = time.monotonic()
        claude.respond(ask(model))
        with pytest.raises(ModelUnavailableError) as held:
            claude.respond(ask(model))
        since = time.monotonic() - asked  # the hold ran down by at most this since the answer came
        assert held.value.capacity_wait, "a hold is waiting for capacity, not a failed attempt"
        assert 2.0 - since - 0.05 < held.value.retry_after <= 2.0 + 1.0, (
            f"held {held.value.retry_after:.2f} s for a reset 2 s ahead, {since:.2f} s after the answer"
        )
        assert len(api.requests) == 1, "the held call reached the API"

        clock.advance(timedelta(seconds=3))
        assert claude.respond(ask(model)).content[0]["text"] == "ok"

    assert api.paths() == ["/v1/messages", "/v1/messages"], "no 429 was needed: two calls, both answered"


def test_headers__the_hold_is_shared_with_every_other_worker(backend_name, api):
    # https://platform.claude.com/docs/en/api/rate-limits : the limits are the organization's, so one worker's
    # answer speaks for all; another participant (another client, another worker) is held by the same bucket.
    model = unique_model()
    api.answer(message(), headers=ratelimit_headers(400_000, 0, ANSWERED + 20, name="input-tokens"))
    first, other = AnthropicParticipant(client=api.client()), AnthropicParticipant(client=api.client())

    with limits(backend_name, **{model: {"input_tokens_per_minute": 10_000_000}}):
        first.respond(ask(model))
        with pytest.raises(ModelUnavailableError) as held:
            other.respond(ask(model))

    assert 18 < held.value.retry_after <= 21, held.value.retry_after
    assert len(api.requests) == 1


def test_headers__room_left_holds_nothing(backend_name, api):
    # https://platform.claude.com/docs/en/api/rate-limits : 40 of 50 requests left is no reason to wait.
    model = unique_model()
    api.answer(message(), headers=ratelimit_headers(50, 40, ANSWERED + 12))
    claude = AnthropicParticipant(client=api.client())

    with limits(backend_name, **{model: {"requests_per_minute": 600}}):
        claude.respond(ask(model))
        claude.respond(ask(model))

    assert len(api.requests) == 2


def test_headers__a_model_without_configured_limits_is_held_in_this_process(backend_name, api):
    # https://platform.claude.com/docs/en/api/rate-limits : output-tokens-remaining rounds to the nearest thousand;
    # 0 of 8,000 left with a reset 5 s ahead. The model has no shared bucket, so this process holds it.
    model, limited = unique_model(), unique_model()
    api.answer(message(), headers=ratelimit_headers(8_000, 0, ANSWERED + 5, name="output-tokens"))
    claude = AnthropicParticipant(client=api.client())

    with limits(backend_name, **{limited: {"requests_per_minute": 600}}):
        claude.respond(ask(model))
        with pytest.raises(ModelUnavailableError) as held:
            claude.respond(ask(model))
        claude.respond(ask(limited))  # another model's calls are not held by it

    assert 0 < held.value.retry_after <= 5.0, held.value.retry_after
    assert len(api.requests) == 2


def test_headers__without_a_limiter_nothing_is_held(api):
    # https://platform.claude.com/docs/en/api/rate-limits : without MODEL_RATE_LIMITS there is no limiter to tell.
    model = unique_model()
    api.answer(message(), headers=ratelimit_headers(50, 0, ANSWERED + 30))
    claude = AnthropicParticipant(client=api.client())

    with limits("postgres"):
        claude.respond(ask(model))
        claude.respond(ask(model))

    assert len(api.requests) == 2


def test_headers__the_reset_is_read_on_the_apis_clock_not_this_machines(backend_name, api):
    # https://platform.claude.com/docs/en/api/rate-limits : reset is an absolute time; read against the answer's
    # `date`, a worker whose clock is hours off still holds for the 4 s the API meant.
    model = unique_model()
    api.date = float(int(time.time()) - 6 * 3600)  # the API's clock (whole seconds, as `date` says), 6 h behind
    api.answer(message(), headers=ratelimit_headers(50, 1, api.date + 4))
    claude = AnthropicParticipant(client=api.client())

    with limits(backend_name, **{model: {"requests_per_minute": 600}}):
        asked = time.monotonic()
        claude.respond(ask(model))
        with pytest.raises(ModelUnavailableError) as held:
            claude.respond(ask(model))
        since = time.monotonic() - asked  # the hold ran down by at most this since the answer came

    assert 4.0 - since - 0.05 < held.value.retry_after <= 5.0, (held.value.retry_after, since)
