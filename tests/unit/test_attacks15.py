"""Attacks on issue 15's checks: configurations the checks passed, after which no run ever progresses again."""

from __future__ import annotations

import pytest
from django.core.checks import ERROR, run_checks
from django.test import override_settings


def durable_messages() -> list:
    return [m for m in run_checks(tags=["durable_agents"]) if m.id]


def ids() -> list[str]:
    return sorted(m.id for m in durable_messages())


# A worker whose accept_content lacks JSON refuses every durable message ("ContentDisallowed: Refusing to
# deserialize untrusted content of type json") and drops it; beat's sweep is JSON too, so nothing wakes the runs.
@pytest.mark.parametrize("accept", [["msgpack"], ("yaml",), "msgpack", ["application/x-msgpack"], {"msgpack"}])
def test_check_serializer__workers_that_refuse_json_are_an_error(accept):
    with override_settings(CELERY_ACCEPT_CONTENT=accept):
        refused = [m for m in durable_messages() if m.id == "durable_agents.E008"]
    assert refused, f"CELERY_ACCEPT_CONTENT={accept!r} makes workers refuse every durable_agents message, unreported"
    assert refused[0].level >= ERROR and "json" in refused[0].hint


@pytest.mark.parametrize("accept", [{"json", "pickle"}, frozenset({"pickle", "json"})])
def test_check_serializer__pickle_in_a_set_is_a_warning(accept):
    """Celery takes any iterable for accept_content: a set that accepts pickle is as dangerous as a list."""
    with override_settings(CELERY_ACCEPT_CONTENT=accept):
        assert ids() == ["durable_agents.W002"], f"CELERY_ACCEPT_CONTENT={accept!r} accepts pickle, unreported"


@pytest.mark.parametrize("accept", [["json"], ("json", "msgpack"), ["application/json"], {"json"}])
def test_check_serializer__workers_that_accept_json_pass(accept):
    with override_settings(CELERY_ACCEPT_CONTENT=accept):
        assert ids() == []
