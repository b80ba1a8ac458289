"""A wait closed by its deadline or its decision while the sweep is late or a request is being delivered: a
signal that beat the sweep is accepted, and a request for a wait decided meanwhile is not sent.

Each test is a guarantee of DESIGN.md §2, shown by a deterministic interleaving (hooks, monkeypatched seams,
threads with their own connections joined before the next act; no sleeps for timing). Each assertion message names
the guarantee. Where the obvious fix is to refuse the operator's action, the test accepts that refusal
(InvalidTransitionError) too.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import pytest

from durable_agents import api, clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.errors import InvalidTransitionError, WaitClosedError
from durable_agents.models import RunStatus
from durable_agents.testing import drive

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


# --- Deadlines ------------------------------------------------------------------------------------------------------


def test_signal__one_that_arrives_after_the_timeout_is_accepted_if_the_sweep_is_late():
    """Round 1 made decide_wait refuse a decision past the deadline (on the database clock) and apply the policy.
    send_signal was left out: it closes the open signal wait whatever its deadline. A payment confirmation an hour
    past the step's timeout (on_timeout="fail") is accepted until the sweep gets to the wait, and the run goes on
    as if it came in time: the declared policy depends on the sweep's timing."""
    run = api.start("signal_flow", {})
    assert advance(run.id) is Outcome.WAITING
    clock.advance(timedelta(hours=2))  # an hour past the timeout; the sweep has not run yet
    with contextlib.suppress(InvalidTransitionError, WaitClosedError):  # refusing the late signal is a fix
        api.send_signal(run.id, "payment.confirmed", {"amount": "10.00"}, by="bank")
    run = drive(run.id)
    assert run.status != RunStatus.COMPLETED, (
        "guarantee 4/9 (deadlines on the database's clock; a deadline applies its declared policy): a signal an hour "
        "past its timeout (on_timeout='fail') was accepted and the run completed"
    )


# --- Notifications vs waits closing -----------------------------------------------------------------------------


def test_deliver__a_request_for_a_wait_decided_after_the_skip_check_is_still_sent():
    """deliver() reads the wait (open: send), then claims the row with an UPDATE that does not look at the wait
    again, then sends. An approver deciding in between gets "Approval needed" for a request already decided —
    the very message the skip rule exists to withhold. The claim is the place to re-check: it is fenced on
    the row's attempts and due time, not on its wait being open."""
    from django.core import mail

    from durable_agents.engine import outbox
    from durable_agents.models import Wait
    from durable_agents.testing import deliver_notifications

    run = api.start("approve_charge", {"order_id": "NT-1"})
    assert advance(run.id) is Outcome.COMMITTED and advance(run.id) is Outcome.WAITING
    wait = Wait.objects.get(run=run, kind="approval")
    original = outbox._skip_reason

    def decided_right_after_the_check(effect, notifier):
        reason = original(effect, notifier)
        outbox._skip_reason = original
        api.decide(wait.pk, True, by="alice")  # the approver acted from the admin meanwhile
        return reason

    outbox._skip_reason = decided_right_after_the_check
    try:
        deliver_notifications()
    finally:
        outbox._skip_reason = original
    sent = [m.subject for m in mail.outbox if m.subject.startswith("Approval needed")]
    assert not sent, (
        "guarantee 9/8 (a request is sent only while its wait is open; notifications skipped when pointless): "
        f"{sent} went out after wait {wait.pk} was approved by alice"
    )
