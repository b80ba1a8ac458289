"""The system checks refuse configurations after which no run would ever progress: workers that refuse the
durable tasks' JSON, durations too long for a timestamp, limits beyond SQL bigint, queues Celery will not create, a
sweep routed away from the workers; configurations that work pass.
"""

from __future__ import annotations

import pytest
from django.core.checks import ERROR, run_checks
from django.test import override_settings
from kombu import Queue

from durable_agents.conf import SETTINGS


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


SECONDS = sorted(name for name, setting in SETTINGS.items() if name.endswith("_SECONDS"))


# Each passed the checks (finite, above 0) and breaks at run time: IDLE_RESWEEP_SECONDS=1e300 raises OverflowError in
# every sweep (no lost run is woken again), LEASE_SECONDS=1e300 in every claim (no run advances),
# NOTIFY_RETRY_SECONDS=1e12 "timestamp out of range" in every sweep, SWEEP_BATCH=10**19 "bigint out of range".
@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("value", [1e300, 1e12])
def test_check_settings__a_duration_too_long_for_a_timestamp_is_an_error(name, value):
    with override_settings(DURABLE_AGENTS={name: value}):
        assert ids() == ["durable_agents.E003"], f"{name}={value:g} passed the checks; no timestamp is that far"


@pytest.mark.parametrize("name", ["SWEEP_BATCH", "ADMIN_EXACT_COUNT_LIMIT"])
def test_check_settings__a_limit_beyond_sql_bigint_is_an_error(name):
    with override_settings(DURABLE_AGENTS={name: 10**19}):
        assert ids() == ["durable_agents.E003"], f"{name}=10**19 passed the checks; Postgres refuses it as a LIMIT"


# Every duration may be years long, but those bounded lower on purpose (RETENTION_PAUSE_SECONDS: at most an hour,
# the prune holds its lock as it rests).
DECADE = 10 * 365 * 24 * 3600.0
SECONDS_OF_YEARS = [name for name in SECONDS if SETTINGS[name].at_most is None or SETTINGS[name].at_most >= DECADE]


@pytest.mark.parametrize("name", SECONDS_OF_YEARS)
def test_check_settings__a_duration_of_years_passes(name):
    with override_settings(DURABLE_AGENTS={name: DECADE}):
        assert ids() == []


# With CELERY_TASK_CREATE_MISSING_QUEUES off, Celery refuses to send to an undeclared queue (QueueNotFound): every
# wake-up fails ("could not wake run ...; the sweep will"), the sweep's fails the same way, and no run progresses.
@pytest.mark.parametrize("name", ["QUEUE", "MODEL_QUEUE", "NOTIFY_QUEUE"])
def test_check_queues__a_queue_celery_will_not_create_is_an_error(name):
    hardened = {"CELERY_TASK_CREATE_MISSING_QUEUES": False, "CELERY_TASK_QUEUES": [Queue("celery")]}
    with override_settings(DURABLE_AGENTS={name: "durable"}, **hardened):
        missing = [m for m in durable_messages() if m.id == "durable_agents.E009"]
    assert missing, f"{name}='durable' is missing from CELERY_TASK_QUEUES, unreported: Celery will not send there"
    assert "durable" in missing[0].msg and "CELERY_TASK_QUEUES" in missing[0].hint


@pytest.mark.parametrize(
    "overrides",
    [
        {"CELERY_TASK_CREATE_MISSING_QUEUES": False, "CELERY_TASK_QUEUES": [Queue("celery"), Queue("durable")]},
        {"CELERY_TASK_CREATE_MISSING_QUEUES": False, "CELERY_TASK_QUEUES": {"durable": {}, "celery": {}}},
        {"CELERY_TASK_CREATE_MISSING_QUEUES": True, "CELERY_TASK_QUEUES": [Queue("celery")]},
        {},
    ],
)
def test_check_queues__a_declared_queue_or_one_celery_creates_passes(overrides):
    with override_settings(DURABLE_AGENTS={"MODEL_QUEUE": "durable", "NOTIFY_QUEUE": "durable"}, **overrides):
        assert ids() == []


SWEEP_ENTRY = {"task": "durable_agents.sweep", "schedule": 5.0, "options": {"expires": 30}}


@pytest.mark.parametrize(
    "overrides",
    [
        {"CELERY_TASK_ROUTES": {"durable_agents.*": {"queue": "durable"}}},
        {"CELERY_TASK_ROUTES": {"durable_agents.sweep": "durable"}},
        {"CELERY_TASK_ROUTES": ({"durable_agents.sweep": {"queue": Queue("durable")}},)},
        {"CELERY_BEAT_SCHEDULE": {"s": {**SWEEP_ENTRY, "options": {"queue": Queue("durable")}}}},
    ],
)
def test_check_sweep_schedule__a_sweep_routed_to_queue_by_the_products_routes_passes(overrides):
    """Beat sends the sweep over the product's routes when its entry names no queue: routed to QUEUE, it is where
    the durable workers are, and W008 is a false alarm (so is a kombu Queue in the entry's options)."""
    configured = {"DURABLE_AGENTS": {"QUEUE": "durable"}, "CELERY_BEAT_SCHEDULE": {"s": SWEEP_ENTRY}, **overrides}
    with override_settings(**configured):
        assert ids() == [], f"the sweep goes to 'durable' ({overrides}), yet W008 says it goes elsewhere"


def test_check_serializer__accept_content_none_accepts_everything_pickle_too():
    """Celery reads CELERY_ACCEPT_CONTENT = None as "accept any content type": JSON is accepted (no E008), and so
    is pickle (W002)."""
    with override_settings(CELERY_ACCEPT_CONTENT=None):
        assert ids() == ["durable_agents.W002"]
