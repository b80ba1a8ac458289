"""`drive` inside a test's transaction (pytest-django's `db`): keyed runs are admitted in-process, since the commit
that would admit them never comes; where a run cannot be driven, the error names the run or worker in the way."""

from __future__ import annotations

from datetime import timedelta

import pytest

from durable_agents import api, clock
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease

pytestmark = pytest.mark.django_db  # the plain `db` fixture: the test's transaction never commits


def test_drive__a_keyed_run_under_the_db_fixture_completes():
    run = api.start("keyed", {"customer": "c-1"})
    assert drive(run.id).status == "completed", "drive must admit a keyed run whose admission waits for a commit"


def test_drive__the_next_keyed_run_is_admitted_once_the_holder_finished():
    first = api.start("keyed", {"customer": "c-2"})
    second = api.start("keyed", {"customer": "c-2"})
    assert drive(first.id).status == "completed"
    assert drive(second.id).status == "completed", "the holder's finish hands the key on only on commit"


def test_drive__a_run_queued_behind_a_holder_names_the_holder():
    first = api.start("keyed_approval", {"customer": "c-3"})
    second = api.start("keyed_approval", {"customer": "c-3"})
    assert drive(first.id).status == "waiting", "the first run holds the key while it waits for its approval"
    with pytest.raises(AssertionError) as raised:
        drive(second.id)
    message = str(raised.value)
    assert str(first.id) in message, f"the error must name the run holding the key: {message}"
    assert "'c-3'" in message and "drive the holder" in message, message
    assert "lease" not in message, f"no lease is involved; the error must not blame one: {message}"


def test_drive__a_lease_held_elsewhere_names_its_owner_and_expiry():
    run = api.start("noop", {"steps": 1})
    claim = take_lease(run.id)
    assert claim is not None
    with pytest.raises(AssertionError) as raised:
        drive(run.id)
    message = str(raised.value)
    assert claim.owner in message, f"the error must name the lease's owner: {message}"
    assert "until" in message and "clock.advance" in message, f"the error must say how to lapse the lease: {message}"


def test_drive__a_lapsed_lease_is_taken_over():
    run = api.start("noop", {"steps": 1})
    assert take_lease(run.id) is not None
    clock.advance(timedelta(hours=1))
    assert drive(run.id).status == "completed"


@pytest.mark.django_db(transaction=True)
def test_drive__in_a_transactional_test_a_queued_run_names_its_holder():
    first = api.start("keyed_approval", {"customer": "c-4"})
    second = api.start("keyed_approval", {"customer": "c-4"})
    assert drive(first.id).status == "waiting"
    with pytest.raises(AssertionError, match=f"held by run\\(s\\) {first.id}; drive the holder first"):
        drive(second.id)
