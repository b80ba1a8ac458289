"""Recorded refund runs for the replay lab's example tests: the shop, a run recorded in this process, a candidate
that refunds another amount, and what a replay must never add to."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from durable_agents import api
from durable_agents.agents.participants import ModelRequest, ScriptedParticipant, participants
from durable_agents.models import Effect, Run, RunStatus, Wait
from durable_agents.testing import drive
from project.refunds import script
from project.refunds.models import OutboundEmail, Refund
from project.refunds.seed import CASES, seed_shop

CASE = {case.number: case for case in CASES}
GREEDY = "refund-script-greedy"


def greedy(request: ModelRequest) -> list[dict[str, Any]]:
    """The refund script, except that it refunds one euro more than the customer is owed."""
    blocks = script.play(request)
    for block in blocks:
        if block.get("type") == "tool_use" and block["name"] == "issue_refund":
            block["input"] = {**block["input"], "amount": f"{Decimal(block['input']['amount']) + 1:.2f}"}
    return blocks


@pytest.fixture
def shop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded shop, the script answering at once, and the greedy candidate registered."""
    monkeypatch.setattr(script, "THINK_SECONDS", 0)
    seed_shop()
    participants.register(GREEDY, ScriptedParticipant(greedy, name=GREEDY))


def recorded(number: str = "A-1001", participant: str | None = None) -> Run:
    """A refund run recorded in this process (a manager approves what waits), completed."""
    run = api.start("refund_agent", CASE[number].run_input)
    if participant:
        api.swap_participant(run.id, participant)
    run = drive(run.id)
    while run.status == RunStatus.WAITING:
        api.decide(Wait.objects.get(run=run, status="open").pk, True, by="manager")
        run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    return run


def world() -> tuple[int, int, int, int]:
    """What a replay must never add to: refunds, emails, effects and waits."""
    return Refund.objects.count(), OutboundEmail.objects.count(), Effect.objects.count(), Wait.objects.count()
