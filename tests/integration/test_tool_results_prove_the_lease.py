"""A turn's tool results are written by one statement that also proves and extends the lease (engine/turnpath.py), and
the model call after them takes that proof as its own (agents/loop.py): what the statement writes, and what it must not.

Each test stops the `peeker` agent inside its tool (a crash mid-tool: turn 0 journaled, its results not written) and
takes the run's lease as a fresh worker would, then sends the statement itself.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connections, transaction
from django.db.models import F
from django.utils import timezone

from durable_agents import api
from durable_agents.engine import turnpath
from durable_agents.engine.advance import advance
from durable_agents.engine.lease import Claim
from durable_agents.models import Run, Turn
from durable_agents.testing.runs import take_lease
from tests.integration.interleavings import until_blocked_on_a_lock
from tests.testapp.trust import HOOKS

pytestmark = pytest.mark.django_db(transaction=True)

LEASE = ("lease_token", "lease_owner", "lease_expires_at")


def _crash(ctx: object) -> None:
    raise KeyboardInterrupt


def a_tool_turn_without_results() -> tuple[Run, Turn, Claim]:
    """A run whose worker died inside turn 0's tool, taken over by a new claim."""
    run = api.start("peeker", {})
    HOOKS["in_peek"] = _crash
    try:
        with pytest.raises(KeyboardInterrupt):
            advance(run.id)
    finally:
        HOOKS.clear()
    turn = Turn.objects.get(run=run, index=0)
    assert turn.tool_results is None
    Run.objects.filter(pk=run.id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
    claim = take_lease(run.id)
    assert claim is not None
    return run, turn, claim


def lease_of(run: Run) -> tuple:
    return Run.objects.filter(pk=run.id).values_list(*LEASE).get()


def test_written__the_lease_is_extended_and_the_spend_comes_back_as_the_row_has_it():
    run, turn, claim = a_tool_turn_without_results()
    Run.objects.filter(pk=run.id).update(input_tokens=F("input_tokens") + 7, token_budget=1234)
    # Run out already but not taken over (the lease is still this claim's): the statement extends it from now.
    marker = timezone.now() - timedelta(hours=1)
    Run.objects.filter(pk=run.id).update(lease_expires_at=marker)

    spent = turnpath.write_tool_results(turn.pk, [{"type": "tool_result", "content": "paid"}], claim)

    row = Run.objects.get(pk=run.id)
    assert spent is not None
    assert spent.tokens == row.input_tokens + row.output_tokens + row.cache_write_tokens + row.cache_read_tokens
    assert (spent.cost_usd, spent.token_budget) == (row.cost_usd, 1234)
    assert row.lease_expires_at > marker + timedelta(minutes=59), "the lease was not extended"
    assert Turn.objects.get(pk=turn.pk).tool_results == [{"type": "tool_result", "content": "paid"}]


def test_a_turn_with_its_results_already__nothing_written_and_the_lease_not_extended():
    # Found by attack: the run's update ran whether or not the turn was written, so "not written" (reported as a lost
    # lease) came with a lease extended by LEASE_SECONDS.
    run, turn, claim = a_tool_turn_without_results()
    assert turnpath.write_tool_results(turn.pk, [{"first": 1}], claim) is not None
    marker = timezone.now() + timedelta(hours=1)
    Run.objects.filter(pk=run.id).update(lease_expires_at=marker)

    assert turnpath.write_tool_results(turn.pk, [{"second": 2}], claim) is None

    assert Run.objects.get(pk=run.id).lease_expires_at == marker
    assert Turn.objects.get(pk=turn.pk).tool_results == [{"first": 1}]


def test_a_zombie__writes_nothing_and_leaves_the_new_holder_s_lease_as_it_was():
    run, turn, zombie = a_tool_turn_without_results()
    Run.objects.filter(pk=run.id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
    assert take_lease(run.id) is not None
    held = lease_of(run)

    assert turnpath.write_tool_results(turn.pk, [{"z": 1}], zombie) is None

    assert lease_of(run) == held
    assert Turn.objects.get(pk=turn.pk).tool_results is None


@pytest.mark.parametrize("case", ["released", "another owner"])
def test_the_same_token_without_its_lease__writes_nothing_and_extends_nothing(case):
    # Stricter than the token alone (the fence before): a lease released, or held by another process, is not ours.
    run, turn, claim = a_tool_turn_without_results()
    if case == "released":
        Run.objects.filter(pk=run.id).update(lease_expires_at=None)
    else:
        Run.objects.filter(pk=run.id).update(lease_owner="celery@elsewhere:9")
    held = lease_of(run)

    assert turnpath.write_tool_results(turn.pk, [{"x": 1}], claim) is None

    assert lease_of(run) == held
    assert Turn.objects.get(pk=turn.pk).tool_results is None


@pytest.mark.parametrize("taken_over", [True, False], ids=["takeover-commits", "takeover-rolls-back"])
def test_a_takeover_holding_the_run_row__the_write_waits_and_follows_its_outcome(taken_over):
    run, turn, claim = a_tool_turn_without_results()
    locked, finish = threading.Event(), threading.Event()

    def take_over() -> None:
        try:
            with transaction.atomic():
                Run.objects.filter(pk=run.id).update(
                    lease_token=F("lease_token") + 1,
                    lease_owner="celery@new:1",
                    lease_expires_at=timezone.now() + timedelta(minutes=10),
                )
                locked.set()
                finish.wait(30)
                transaction.set_rollback(not taken_over)
        finally:
            connections.close_all()

    written: dict[str, object] = {}

    def write() -> None:
        try:
            written["spent"] = turnpath.write_tool_results(turn.pk, [{"r": 1}], claim)
        finally:
            connections.close_all()

    taker = threading.Thread(target=take_over)
    taker.start()
    assert locked.wait(30)
    writer = threading.Thread(target=write)
    writer.start()
    # The write is queued behind the takeover's row lock (not merely not started yet) before the takeover ends.
    until_blocked_on_a_lock(writer, "SET tool_results")
    finish.set()
    taker.join(30)
    writer.join(30)

    results = Turn.objects.get(pk=turn.pk).tool_results
    if taken_over:
        assert written["spent"] is None and results is None
        assert Run.objects.get(pk=run.id).lease_owner == "celery@new:1"
    else:
        assert written["spent"] is not None and results == [{"r": 1}]
