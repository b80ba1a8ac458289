"""Resolving an effect of unknown outcome while its run's saga is in flight or finished: the operator's
answer is what the saga acts on, and a shipment that landed is never hidden.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import contextlib

import pytest

from durable_agents import api
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import Effect, EffectStatus, RunStatus
from durable_agents.testing import drive
from durable_agents.testing.receiver import IdempotentReceiver
from tests.testapp.trust import HOOKS

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


@pytest.fixture
def carrier():
    with IdempotentReceiver() as receiver:
        yield receiver


# --- Operators and effects of unknown outcome ---------------------------------------------------------------


def test_resolve_effect__not_applied_while_the_call_is_in_flight_hides_a_landed_shipment(carrier):
    """resolve_effect does not look at the run's lease: an operator records `failed` while the worker's call is
    in flight; the call lands, _applied_txn's APPLY (pending→applied) matches 0 rows and is ignored, the step
    commits on the landed result, and the effect stays `failed`. A later cancel(compensate) plans nothing for
    it: the shipment is never called back."""

    def operator_records_not_applied(ctx):
        HOOKS.pop("after_ship")
        key = Effect.objects.get(run_id=ctx.run_id, tool="ship").idempotency_key
        with contextlib.suppress(InvalidTransitionError):  # refusing while a worker holds the run is a fix
            api.resolve_effect(key, False, actor="ops", reason="carrier shows nothing yet", resume=False)

    HOOKS["after_ship"] = operator_records_not_applied  # the carrier accepted the shipment; its answer is coming
    run = api.start("ship_then_hold", {"order_id": "RE-1", "url": carrier.url})
    assert advance(run.id) is Outcome.COMMITTED
    api.cancel(run.id, "customer cancelled", compensate=True)
    run = drive(run.id)
    paths = [r.path for r in carrier.requests]
    assert paths.count("/unship") == 1, (
        "guarantee 2/9: the shipment landed (the step committed on its answer) but the effect is recorded "
        f"{Effect.objects.get(run=run, tool='ship').status}; the saga never undid it: {paths}"
    )


def test_resolve_effect__applied_after_the_saga_finished_leaves_it_half_done(carrier, settings):
    """A saga stopped on an unknown outcome; the operator recorded `failed` and the saga finished (cancelled).
    The operator later learns it landed and records `applied` (RESOLVE allows failed→applied): accepted, the
    run stays `cancelled` and refuses resume (compensated), and nothing will ever call the shipment back."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "EFFECT_MAX_INVOCATIONS": 1}

    def lost_answer(ctx):
        HOOKS.pop("after_ship")
        raise ConnectionResetError("the connection broke after the carrier accepted the shipment")

    HOOKS["after_ship"] = lost_answer
    run = api.start("ship_then_hold", {"order_id": "RE-2", "url": carrier.url})
    assert advance(run.id) is Outcome.RETRY
    api.cancel(run.id, "customer cancelled", compensate=True)
    run = drive(run.id)
    assert run.status == RunStatus.FAILED, "the saga stops: the outcome cannot be learned in 1 invocation"
    key = Effect.objects.get(run=run, tool="ship").idempotency_key
    api.resolve_effect(key, False, actor="ops", reason="carrier portal shows nothing")
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    try:
        api.resolve_effect(key, True, result={"shipped": True}, actor="ops", reason="carrier found it after all")
    except InvalidTransitionError:
        return  # refusing to change the record of a finished saga is a fix (with a pointer to what to do)
    run = drive(run.id)
    effect = Effect.objects.get(idempotency_key=key)
    assert effect.status != EffectStatus.APPLIED or run.status not in (RunStatus.CANCELLED, RunStatus.COMPLETED), (
        "guarantee 9 (never silently half-done): an effect recorded applied on a run that ended cancelled by its "
        "saga; nothing will undo it and the run cannot be resumed"
    )
