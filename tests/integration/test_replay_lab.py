"""The replay lab on the refund example: recorded runs replayed with a candidate, nothing applied, lanes compared.

The recording is a real run of `refund_agent` (the scripted participant plays the model, in this process); its replay
runs execute the same workflow version in this process too (`api.replay_here`), as CI without workers would.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from durable_agents import api
from durable_agents.agents.participants import ModelRequest, ScriptedParticipant, participants
from durable_agents.models import Effect, Event, Replay, ReplayRun, Run, RunStatus, Wait
from durable_agents.testing import drive
from project.refunds import script
from project.refunds.models import OutboundEmail, Refund
from project.refunds.seed import CASES, seed_shop

pytestmark = pytest.mark.django_db(transaction=True)

CASE = {case.number: case for case in CASES}
GREEDY = "refund-script-greedy"


def greedy(request: ModelRequest) -> list[dict[str, Any]]:
    """The refund script, except that it refunds one euro more than the customer is owed."""
    blocks = script.play(request)
    for block in blocks:
        if block.get("type") == "tool_use" and block["name"] == "issue_refund":
            block["input"] = {**block["input"], "amount": f"{Decimal(block['input']['amount']) + 1:.2f}"}
    return blocks


@pytest.fixture(autouse=True)
def shop(monkeypatch):
    monkeypatch.setattr(script, "THINK_SECONDS", 0)
    seed_shop()
    participants.register(GREEDY, ScriptedParticipant(greedy, name=GREEDY))
    yield


def recorded(number: str) -> Run:
    run = api.start("refund_agent", CASE[number].run_input)
    run = drive(run.id)
    if run.status == RunStatus.WAITING:
        wait = Wait.objects.get(run=run, status="open")
        api.decide(wait.pk, True, by="manager")
        run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    return run


def world() -> tuple[int, int, int, int]:
    """What a replay must never add to: refunds, emails, effects and waits."""
    return Refund.objects.count(), OutboundEmail.objects.count(), Effect.objects.count(), Wait.objects.count()


def test_replay__a_candidate_that_would_refund_another_amount_refunds_nothing_and_emails_no_one():
    runs = [recorded("A-1001"), recorded("A-1002")]  # A-1002's refund waited for a manager's approval
    before = world()

    replay = api.replay(runs=[r.id for r in runs], candidate={"participant": GREEDY})
    report = api.replay_here(replay.id)

    assert world() == before, "a replay applied an effect, sent an email or opened a wait"
    replay_runs = Run.objects.filter(pk__in=ReplayRun.objects.filter(replay=replay).values("run_id"))
    assert {r.replay_lane for r in replay_runs} == {"baseline", "candidate"}
    assert report.finished
    baseline, candidate = report.lanes["baseline"], report.lanes["candidate"]
    assert (baseline.agree, baseline.finished) == (2, 2), "the recorded script asked again must agree with itself"
    assert candidate.agree == 0 and candidate.diverged == 2
    for case in report.cases:
        lane = case.lanes["candidate"]
        assert lane.status == RunStatus.FAILED and lane.diverged["tool"] == "issue_refund"
        assert lane.first_divergence == 1, "lookup_order matched; issue_refund (another amount) is the divergence"
    passed, why = report.verdict(fail_under=0.95)
    assert not passed and "under 95.0%" in why


def test_replay__an_approval_is_answered_as_it_was_recorded_and_reaches_no_one():
    run = recorded("A-1002")
    waits = Wait.objects.count()

    report = api.replay_here(api.replay(runs=[run.id], lanes=("baseline",)).id)

    assert Wait.objects.count() == waits
    [case] = report.cases
    assert case.lanes["baseline"].agrees, case.lanes["baseline"]
    assert case.lanes["baseline"].status == RunStatus.COMPLETED


def test_replay__a_stub_answers_a_call_the_recording_never_made_and_still_applies_nothing():
    run = recorded("A-1001")
    before = world()
    stub = {"refund_id": 0, "amount": "35.90", "currency": "EUR", "status": "issued"}

    replay = api.replay(
        runs=[run.id], lanes=("candidate",), candidate={"participant": GREEDY}, stubs={"issue_refund": stub}
    )
    report = api.replay_here(replay.id)

    assert world() == before
    lane = report.cases[0].lanes["candidate"]
    assert lane.diverged["tool"] == "issue_refund" and lane.diverged["answered"] == "stub"
    assert not lane.same_outcome, "the stub's refund is not the recorded one"
    answered = Event.objects.filter(run_id=lane.run_id, kind="replay_answered", detail__stub=True)
    assert answered.count() == 1


def test_replay__an_exported_cohort_imported_elsewhere_replays_the_same():
    run = recorded("A-1001")
    cohort = api.save_cohort("november", runs=[run.id])
    lines = list(api.export_cohort(cohort.name))
    assert [json.loads(line)["schema"] for line in lines] == ["durable_agents.recording/1"]

    api.import_cohort("november-copy", lines)
    report = api.replay_here(api.replay(cohort="november-copy", lanes=("baseline",)).id)

    assert report.lanes["baseline"].agree == 1
    assert Replay.objects.get(pk=report.replay_id).cohort.name == "november-copy"
