"""Errors as the API means them, seen from a run: a spend limit fails it at once, `x-should-retry` decides between
retry and failure against the status. One-agent runs in-process against the fake Messages API, real SDK, real
Postgres; backoffs are skipped by clearing `wake_at`.
"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test import override_settings

from durable_agents import clock
from durable_agents.models import Event, RateBucket, RunStatus, Turn
from durable_agents.testing.fake_anthropic import Fault, Reply
from tests.integration.test_agent_faults import claude_on_the_fake, run_to_end
from tests.unit.test_model_errors import SPEND_CAP_BODY

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def fake(monkeypatch):
    with claude_on_the_fake(monkeypatch, timeout=5) as server:
        yield server


def test_spend_cap__fails_the_run_once_with_the_cause_and_what_to_do(fake):
    # https://platform.claude.com/docs/en/api/errors : the tier's monthly cap is a 429 (error_code
    # enforced_spend_limit_reached, no retry-after) and "Retrying ... fails until access resumes".
    fake.enqueue(Fault.status(429, SPEND_CAP_BODY), Reply.text("never asked for"))

    run = run_to_end()

    assert run.status == RunStatus.FAILED, run.status
    assert run.error["type"] == "ModelRequestError", run.error
    assert "monthly spend limit" in run.error["message"] and "durable_resume" in run.error["message"], run.error
    assert not Event.objects.filter(run=run, kind="step_retry").exists(), "a spend cap is not retried"
    assert len(fake.requests) == 1, f"the model was asked {len(fake.requests)} times after the spend cap, not once"


def test_spend_cap__refunds_the_shared_reservation(fake):
    # https://platform.claude.com/docs/en/api/rate-limits : a refused call bills nothing, so the tokens reserved for
    # it go back to the shared bucket (ITPM counts what was billed).
    model = settings.DURABLE_AGENTS.get("DEFAULT_MODEL", "claude-sonnet-5-5")
    limits = {model: {"output_tokens_per_minute": 60}}  # a token a second: a reservation moves the TAT by max_tokens
    fake.enqueue(Fault.status(429, SPEND_CAP_BODY))
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "MODEL_RATE_LIMITS": limits}):
        run = run_to_end()
        bucket = RateBucket.objects.get(key__startswith=f"{model}|")
        left = bucket.output_tat - clock.now().timestamp()

    assert run.status == RunStatus.FAILED
    assert left < 5, f"the refused call still holds {left:.0f} s of output tokens in the shared bucket"


def test_x_should_retry__false_fails_an_overloaded_call_at_once(fake):
    # The SDK obeys x-should-retry before the status (anthropic/_base_client.py `_should_retry`); a 529 is otherwise
    # transient: https://platform.claude.com/docs/en/api/errors
    fake.enqueue(Fault.status(529, headers={"x-should-retry": "false"}), Reply.text("never asked for"))

    run = run_to_end()

    assert run.status == RunStatus.FAILED and run.error["type"] == "ModelRequestError", run.error
    assert "x-should-retry: false" in run.error["message"], run.error
    assert len(fake.requests) == 1


def test_x_should_retry__true_retries_a_conflict_and_the_run_completes(fake):
    # https://platform.claude.com/docs/en/api/errors : 409 conflict_error "resolve the conflict, then retry"; with
    # x-should-retry: true the API says a plain retry will do (anthropic/_base_client.py `_should_retry`).
    fake.enqueue(Fault.status(409, headers={"x-should-retry": "true"}), Reply.text("All done."))

    run = run_to_end()

    assert run.status == RunStatus.COMPLETED, run.error
    retries = Event.objects.filter(run=run, kind="step_retry")
    assert [e.detail["error"]["type"] for e in retries] == ["ModelUnavailableError"]
    assert Turn.objects.filter(run=run).count() == 1
