"""A model API's Retry-After is never shortened by the jitter, stays within the cap, and an infinite one is capped
rather than ignored.
"""

from __future__ import annotations

from django.test import override_settings

from durable_agents.engine.advance import _delay
from durable_agents.engine.retry import Failure
from durable_agents.workflows import RetryPolicy


def _throttled(retry_after: float | None) -> Failure:
    return Failure(True, "ModelUnavailableError", "model API 429", "ask", retry_after=retry_after)


# -- retry-after jitter ------------------------------------------------------------------------------------


@override_settings(DURABLE_AGENTS={"RETRY_AFTER_JITTER": 0.0, "RETRY_AFTER_MAX_SECONDS": 600.0})
def test_retry_after__an_infinite_retry_after_without_jitter_is_capped_not_ignored():
    """`retry-after: 1e999` (float('inf'): claude.retry_after and retry._seconds both let it through). Before
    bacfaa3 it was capped at RETRY_AFTER_MAX_SECONDS; now inf * uniform(0, 0) is NaN, min(NaN, cap) is NaN and
    max(policy, NaN) is the policy's short backoff: the run hammers a service that asked it to go away."""
    policy = RetryPolicy(max_attempts=5, backoff=0.05, backoff_max=0.5)
    delay = _delay(policy, 1, _throttled(float("inf")))
    assert delay == 600.0, f"retry-after inf gave a delay of {delay!r}, not the cap (600)"


@override_settings(DURABLE_AGENTS={"RETRY_AFTER_JITTER": float("nan")})
def test_retry_after__is_never_shortened_whatever_the_jitter_setting():
    """RETRY_AFTER_JITTER NaN (e.g. read from a malformed env var): max(nan, 0.0) is nan, so the spread is NaN and
    the delay falls back to the policy's backoff — shorter than the retry-after the service asked for."""
    policy = RetryPolicy(max_attempts=5, backoff=0.05, backoff_max=0.5)
    delay = _delay(policy, 1, _throttled(5.0))
    assert delay >= 5.0, f"a retry-after of 5 s became a delay of {delay!r} s"


def test_retry_after__jitter_stays_within_retry_after_and_the_cap():
    """Held: never below retry-after, never above min(2 x retry-after, cap), for finite and huge values."""
    policy = RetryPolicy(max_attempts=5, backoff=0.05, backoff_max=0.5)
    for asked in (0.001, 1.0, 5.0, 599.0, 1e300, 1.7e308):
        for _ in range(200):
            delay = _delay(policy, 1, _throttled(asked))
            assert min(asked, 600.0) <= delay <= max(0.5, min(2 * asked, 600.0)), (asked, delay)
    for odd in (None, float("nan"), -1.0, 0.0, float("-inf")):
        assert 0 <= _delay(policy, 1, _throttled(odd)) <= 0.5 * 1.5, odd
