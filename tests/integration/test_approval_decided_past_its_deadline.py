"""An approval decided after its deadline but before the sweep has acted on it is accepted.

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
from durable_agents.errors import InvalidTransitionError
from durable_agents.models import RunStatus, Wait
from durable_agents.testing import drive

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("hooks_cleared")]


def test_decide__an_approval_after_its_deadline_passed_is_accepted_if_the_sweep_is_late():
    """decide_wait checks only that the wait is open, never its deadline (on the database clock). Until the
    sweep gets to it, an approval past a "fail" deadline is accepted and the run goes on: the declared
    deadline policy depends on the sweep's timing."""
    run = api.start("deadline_fail", {})
    assert advance(run.id) is Outcome.WAITING
    wait = Wait.objects.get(run=run)
    clock.advance(timedelta(hours=2))  # an hour past the deadline; the sweep has not run yet
    with contextlib.suppress(InvalidTransitionError):  # refusing a decision past the deadline is a fix
        api.decide(wait.pk, True, by="late-approver")
    run = drive(run.id)
    assert run.status != RunStatus.COMPLETED, (
        "guarantee 4/9 (deadlines on the database's clock; a deadline applies its declared policy): an approval "
        "an hour past a 'fail' deadline was accepted and the run completed"
    )
