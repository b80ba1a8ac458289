"""COUNT_TOKENS: a conversation's first request is reserved in the shared rate limit by the API's count of its prompt
(messages.count_tokens) instead of ~4 characters a token; any failure of the count falls back to the estimate. On
both shared backends, through the real SDK over real HTTP.

What was reserved is read the way another worker sees it: while the first call is held in flight by the scripted
API, a second caller is refused for as long as the first one's input tokens take (a token a second). Nothing is
timed: the limiter reports the wait (RATE_LIMIT_MAX_WAIT_SECONDS 0) instead of sleeping it.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from durable_agents import clock
from durable_agents.agents import rate_limits
from durable_agents.agents.budget import PromptSize, estimate_prompt
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.messages import ModelRequest, estimate_tokens
from durable_agents.errors import ModelUnavailableError
from tests.unit.test_model_errors import API_KEY, ScriptedAPI, ask, error_body

pytestmark = pytest.mark.django_db(transaction=True)
TOKEN_COUNTING_DOC = "https://platform.claude.com/docs/en/build-with-claude/token-counting"
COUNTED = 500  # what the scripted count_tokens says the first prompt holds: far from its ~30-token estimate


@pytest.fixture(params=["postgres", "redis"])
def backend_name(request, broker_url):
    yield "postgres" if request.param == "postgres" else broker_url
    clock.reset()


def settings_for(backend: str, model: str, *, count_tokens: bool):
    """A token a second of input for `model` (a TAT moves one second per token), COUNT_TOKENS as asked."""
    durable = {
        **settings.DURABLE_AGENTS,
        "MODEL_RATE_LIMITS": {model: {"input_tokens_per_minute": 60}},
        "RATE_LIMIT_BACKEND": backend,
        "RATE_LIMIT_MAX_WAIT_SECONDS": 0.0,
        "COUNT_TOKENS": count_tokens,
    }
    return override_settings(DURABLE_AGENTS=durable)


def reserved_while_in_flight(api: ScriptedAPI, claude: AnthropicParticipant, request: ModelRequest) -> float:
    """Seconds (= input tokens) another caller must wait while `request` is in flight: what it reserved."""
    answered: list[Any] = []

    def call() -> None:
        try:
            answered.append(claude.respond(request))
        finally:
            connection.close()

    api.hold.clear()
    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert api.arrived.wait(timeout=30), "the first call never reached the API"
        with pytest.raises(ModelUnavailableError) as refused:
            rate_limits.limiter().acquire(request.model, API_KEY, {"messages": []}, 1)  # type: ignore[union-attr]
    finally:
        api.hold.set()
        caller.join(timeout=30)
    assert answered, "the first call failed"
    return float(refused.value.retry_after or 0.0)


def test_count_tokens__the_first_request_is_reserved_by_the_apis_count(backend_name):
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : count_tokens takes the same inputs as a
    # message and answers {"input_tokens": N}; free, with a requests-per-minute limit of its own.
    model = f"claude-test-{uuid.uuid4().hex[:8]}"
    with ScriptedAPI() as api, settings_for(backend_name, model, count_tokens=True):
        api.count({"input_tokens": COUNTED})
        claude = AnthropicParticipant(client=api.client())
        waited = reserved_while_in_flight(api, claude, ask(model))
        paths = api.paths()

    assert COUNTED - 10 < waited <= COUNTED + 1, f"another caller waited {waited:.0f} s: {COUNTED} tokens were counted"
    assert paths == ["/v1/messages/count_tokens", "/v1/messages"], paths


@pytest.mark.parametrize(
    ("count_tokens", "count_answer"),
    [
        (True, (529, error_body("overloaded_error", "Overloaded"))),
        (True, (429, error_body("rate_limit_error", "count_tokens requests per minute"))),
        (False, None),
    ],
    ids=["count-529", "count-429", "disabled"],
)
def test_count_tokens__a_failed_or_disabled_count_reserves_the_estimate(backend_name, count_tokens, count_answer):
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : a count may be refused (its own rate
    # limit); the turn goes on with the ~4-characters-a-token estimate.
    model = f"claude-test-{uuid.uuid4().hex[:8]}"
    request = ask(model)
    estimate = rate_limits.estimate_input_tokens(request.as_kwargs())
    with ScriptedAPI() as api, settings_for(backend_name, model, count_tokens=count_tokens):
        if count_answer:
            api.count(count_answer[1], status=count_answer[0])
        waited = reserved_while_in_flight(api, AnthropicParticipant(client=api.client()), request)
        paths = api.paths()

    assert estimate - 10 < waited <= estimate + 1, f"waited {waited:.0f} s, the estimate is {estimate} tokens"
    assert paths.count("/v1/messages") == 1, "the turn was answered despite the count"
    assert paths.count("/v1/messages/count_tokens") == (1 if count_tokens else 0), paths


def test_count_tokens__later_turns_are_not_counted(backend_name):
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : each count is a round trip; after the
    # first turn the billed usage of each answer corrects the shared bucket, so later turns keep the estimate.
    model = f"claude-test-{uuid.uuid4().hex[:8]}"
    later = ModelRequest(
        model=model,
        max_tokens=64,
        system="",
        tools=(),
        messages=(
            {"role": "user", "content": "Refund A-1"},
            {"role": "assistant", "content": "Which amount?"},
            {"role": "user", "content": "All of it."},
        ),
    )
    with ScriptedAPI() as api, settings_for(backend_name, model, count_tokens=True):
        api.count({"input_tokens": COUNTED})
        AnthropicParticipant(client=api.client()).respond(later)
        paths = api.paths()

    assert paths == ["/v1/messages"], paths


def test_count_tokens__a_model_without_limits_is_not_counted(backend_name):
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : a count nobody reserves is a wasted call.
    with ScriptedAPI() as api, settings_for(backend_name, "claude-limited-only", count_tokens=True):
        api.count({"input_tokens": COUNTED})
        AnthropicParticipant(client=api.client()).respond(ask("claude-test-unlimited"))
        paths = api.paths()

    assert paths == ["/v1/messages"], paths


def test_estimate_prompt__the_first_turn_may_ask_the_api():
    # https://platform.claude.com/docs/en/build-with-claude/token-counting : the budget guard's first turn has
    # nothing measured; a caller may pass the participant's count, and keeps the estimate when it cannot say.
    request = ask()
    kwargs, messages = request.as_kwargs(), list(request.messages)
    with ScriptedAPI() as api:
        api.count({"input_tokens": COUNTED})
        api.count(error_body("rate_limit_error", "slow down"), status=429)
        claude = AnthropicParticipant(client=api.client())
        counted = estimate_prompt(kwargs, messages, None, count=lambda: claude.count_tokens(request))
        refused = estimate_prompt(kwargs, messages, None, count=lambda: claude.count_tokens(request))
        measured = estimate_prompt(kwargs, messages, PromptSize(900, 1), count=lambda: claude.count_tokens(request))
        paths = api.paths()

    assert counted == COUNTED
    assert refused == estimate_tokens(kwargs), "a refused count falls back to the estimate"
    assert measured == 900 + estimate_tokens(messages[0:]), "a measured prompt is not counted again"
    assert paths == ["/v1/messages/count_tokens"] * 2, paths
