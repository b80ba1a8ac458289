"""The replay lab on the refund example: recorded runs replayed with a candidate, nothing applied, lanes compared.

The recording is a real run of `refund_agent` (the scripted participant plays the model, in this process); its replay
runs execute the same workflow version in this process too (`api.replay_here`), as CI without workers would.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from durable_agents import api
from durable_agents.models import Event, Replay, ReplayRun, Run, RunStatus, Turn, Wait
from durable_agents.testing import wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic
from project.refunds.script import stand_in_reply
from tests.integration.refund_recordings import CASE, GREEDY, recorded, shop, world  # noqa: F401 - shop: a fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("shop")]

CANDIDATE_MODEL = "claude-opus-5-5"


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


@pytest.fixture
def fake(worker_env):
    """The strict stand-in plays Claude's default model on the workers: signed thinking blocks, the API's rules."""
    with FakeAnthropic(responder=stand_in_reply) as server:
        worker_env.update(server.environ())
        yield server
        refused = [r.refused for r in server.requests if r.refused]
        assert not refused, f"the stand-in refused what the workers sent (the real API would too): {refused}"


def thinking_signatures(blocks: list[dict[str, Any]]) -> set[str]:
    return {block["signature"] for block in blocks if block.get("type") == "thinking" and block.get("signature")}


def test_replay_on_a_worker__a_claude_recording_replays_on_another_model_without_sending_a_recorded_thinking_block(
    start_worker, fake
):
    """Thinking blocks are bound to the account and model that wrote them: a replay never sends a recorded one (each
    lane's conversation is its own from the first turn), so nothing depends on the candidate accepting them."""
    start_worker()
    source = wait_for_run(api.start("refund_agent", CASE["A-1001"].run_input).id, "completed", timeout=120)
    recorded = set().union(*(thinking_signatures(t.content) for t in Turn.objects.filter(run=source)))
    assert recorded, "the stand-in answers with signed thinking blocks, as the default model does"
    before = world()

    replay = api.replay(runs=[source.id], candidate={"model": CANDIDATE_MODEL})
    links = {link.lane: link.run_id for link in ReplayRun.objects.filter(replay=replay)}
    for run_id in links.values():
        wait_for_run(run_id, "completed", timeout=120)

    def sent(run_id: Any) -> list[Any]:
        return [r for step in ("resolve", "review_email") for r in fake.requests_for(f"{run_id}:{step}")]

    for run_id in links.values():
        for request in sent(run_id):
            for message in request.body["messages"]:
                content = message["content"] if isinstance(message["content"], list) else []
                assert not thinking_signatures(content) & recorded, "a replay sent a recorded thinking block"
    assert {r.body["model"] for r in sent(links["candidate"])} == {CANDIDATE_MODEL}
    assert {r.body["model"] for r in sent(links["baseline"])} == {r.body["model"] for r in sent(source.id)}
    assert world() == before
    report = api.replay_report(replay.id)
    assert report.lanes["baseline"].agree == report.lanes["candidate"].agree == 1
