"""The replay lab's edges on the refund example: forks, judges asking a person, crashes mid-step, parallel and
refused calls, prompts that call tools, budgets — each replay applying nothing."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

from durable_agents import api, clock
from durable_agents.agents.participants import ModelRequest, ScriptedParticipant, participants
from durable_agents.engine.lease import lease_seconds
from durable_agents.errors import DurableAgentsError
from durable_agents.models import Event, ReplayRun, Run, RunStatus, Step, Turn, Wait
from durable_agents.testing import drive
from project.refunds import script
from project.refunds.models import OutboundEmail, Refund
from tests.integration.refund_recordings import CASE, recorded, shop, world  # noqa: F401 - shop: a fixture

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("shop")]

STRICT = "refund-script-strict-judge"
FLAKY = "refund-script-crashes-once"
PARALLEL = "refund-script-parallel"
DECIMAL = "refund-script-decimal-amount"
crashed: dict[str, bool] = {}


class WorkerKilled(BaseException):
    """Nothing after it runs in the step: as a SIGKILL between the model's answer and the step's commit."""


def strict_judge(request: ModelRequest) -> list[dict[str, Any]]:
    """The refund script, but its reviewer fails every email (deterministically)."""
    if any(tool["name"] == "submit_verdict" for tool in request.tools):
        return [
            {
                "type": "tool_use",
                "id": f"toolu_v_{request.turn}",
                "name": "submit_verdict",
                "input": {"passed": False, "score": 0.2, "reasons": "too terse"},
            }
        ]
    return script.play(request)


def crashes_once(request: ModelRequest) -> list[dict[str, Any]]:
    """The refund script; in a replay run its agent's third turn dies once (a worker lost mid-step)."""
    if request.turn == 2 and not crashed.get("done") and crashed.get("armed"):
        crashed["done"] = True
        raise WorkerKilled("worker lost mid-step")
    return script.play(request)


def parallel(request: ModelRequest) -> list[dict[str, Any]]:
    """The refund script, but the first turn asks lookup_order twice in one response (parallel tool calls)."""
    blocks = script.play(request)
    if request.turn == 0:
        extra = [dict(b, id=b["id"] + "b") for b in blocks if b.get("type") == "tool_use"]
        blocks = blocks + extra
    return blocks


def decimal_amount(request: ModelRequest) -> list[dict[str, Any]]:
    """The refund script, but the amount is a number (35.9), not the string the recording holds ("35.90")."""
    blocks = script.play(request)
    for block in blocks:
        if block.get("type") == "tool_use" and block["name"] == "issue_refund":
            block["input"] = {**block["input"], "amount": float(Decimal(block["input"]["amount"]))}
    return blocks


@pytest.fixture(autouse=True)
def participants_of_the_edges():
    for name, fn in ((STRICT, strict_judge), (FLAKY, crashes_once), (PARALLEL, parallel), (DECIMAL, decimal_amount)):
        participants.register(name, ScriptedParticipant(fn, name=name))
    crashed.clear()
    yield


def lane_run(replay, lane: str) -> Run:
    return Run.objects.get(pk=ReplayRun.objects.get(replay=replay, lane=lane).run_id)


def test_fork_of_a_replay_run_refunds_nothing_and_emails_no_one():
    run = recorded("A-1001")
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    api.replay_here(replay.id)
    replayed = lane_run(replay, "baseline")
    before = world()
    try:
        fork = api.fork(replayed.id, "resolve")
    except DurableAgentsError:
        return
    fork = drive(fork.id)
    while fork.status == RunStatus.WAITING:
        api.decide(Wait.objects.get(run=fork, status="open").pk, True, by="manager")
        fork = drive(fork.id)
    assert world() == before, (
        f"forked from a replay run, run {fork.id} (replay_lane={fork.replay_lane!r}) is a real run: "
        f"refunds {before[0]}->{Refund.objects.count()}, emails {before[1]}->{OutboundEmail.objects.count()}"
    )


def test_the_baseline_lane_asks_the_recorded_model_and_the_candidate_lane_the_candidates():
    run = recorded("A-1001")
    recorded_models = set(Turn.objects.filter(run=run).values_list("model", flat=True))
    replay = api.replay(runs=[run.id], candidate={"model": "claude-haiku-4-5"})
    api.replay_here(replay.id)
    baseline, candidate = lane_run(replay, "baseline"), lane_run(replay, "candidate")
    assert set(Turn.objects.filter(run=baseline).values_list("model", flat=True)) == recorded_models
    assert {m.split(":")[-1] for m in Turn.objects.filter(run=candidate).values_list("model", flat=True)} == {
        "claude-haiku-4-5"
    }


def test_a_judge_that_asked_a_human_is_answered_as_recorded_in_the_baseline_lane(isolated_registries):
    from durable_agents.api import agent, call, judge, workflow  # noqa: PLC0415
    from project.refunds import workflows as refunds  # noqa: PLC0415

    workflow(
        "refund_ask",
        steps=[
            call("load_order", refunds.load_order),
            agent(
                "resolve",
                instructions=refunds.INSTRUCTIONS,
                tools=[refunds.lookup_order, refunds.issue_refund, refunds.email_customer],
                prompt=refunds.resolve_prompt,
                participant=STRICT,
            ),
            judge(
                "review_email",
                rubric=refunds.RUBRIC,
                subject=refunds.email_under_review,
                on_fail="ask_human",
                participant=STRICT,
            ),
        ],
    )
    run = drive(api.start("refund_ask", CASE["A-1001"].run_input).id)
    assert run.status == RunStatus.WAITING
    api.decide(Wait.objects.get(run=run, status="open").pk, True, by="manager")  # accept the email anyway
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    before = world()

    rep = api.replay_here(api.replay(runs=[run.id], lanes=("baseline",)).id)

    assert world() == before
    lane = rep.cases[0].lanes["baseline"]
    assert lane.diverged is not None or lane.agrees, "the replay failed on the override wait, yet no divergence"
    assert lane.agrees, (
        f"a deterministic model replayed disagrees with itself: the recorded human override is not answered "
        f"({lane.status}: {lane.error})"
    )


def test_a_replay_step_executed_again_after_a_crash_gets_the_same_answers():
    run = recorded("A-1001", participant=FLAKY)
    before = world()
    crashed["armed"] = True
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    with pytest.raises(WorkerKilled):
        api.replay_here(replay.id)
    assert crashed.get("done"), "the crash never happened"
    answered_before = list(
        Event.objects.filter(run_id=lane_run(replay, "baseline").id, kind="replay_answered").values_list(
            "detail", flat=True
        )
    )
    assert answered_before, "no tool call was answered before the crash"
    clock.advance(timedelta(seconds=lease_seconds() * 3))  # the dead worker's lease lapses
    rep = api.replay_here(replay.id)
    assert world() == before
    lane = rep.cases[0].lanes["baseline"]
    assert lane.agrees, (lane.status, lane.error, lane.diverged)
    answered = Event.objects.filter(run_id=lane.run_id, kind="replay_answered")
    assert len({e.detail["recorded"] for e in answered}) == answered.count(), "a recorded call answered twice"


def test_parallel_tool_calls_in_one_response_are_each_answered_once():
    run = recorded("A-1001", participant=PARALLEL)
    recorded_calls = Run.objects.get(pk=run.id)
    before = world()
    rep = api.replay_here(api.replay(runs=[run.id], lanes=("baseline",)).id)
    assert world() == before
    lane = rep.cases[0].lanes["baseline"]
    assert lane.agrees, (lane.status, lane.error, lane.diverged, recorded_calls.id)


def test_a_candidate_passing_arguments_the_tool_refuses_reads_the_error_a_live_call_gets():
    """The amount as a number (35.9) where issue_refund takes a string: live, the tool's signature refuses it and the
    model reads why; in a replay the same (checking arguments runs nothing), never an unrecorded-call divergence."""
    run = recorded("A-1001")
    before = world()
    rep = api.replay_here(api.replay(runs=[run.id], lanes=("candidate",), candidate={"participant": DECIMAL}).id)
    lane = rep.cases[0].lanes["candidate"]
    refused = Turn.objects.filter(run_id=lane.run_id).exclude(tool_results=None).values_list("tool_results", flat=True)
    errors = [r for results in refused for r in results if r.get("is_error")]
    assert errors and "amount" in errors[0]["content"], errors
    assert lane.diverged is None or lane.diverged["tool"] != "issue_refund", lane.diverged
    assert world() == before


def test_operator_actions_on_a_replay_run_apply_nothing():
    run = recorded("A-1002")  # the refund waited for a manager
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    replayed = lane_run(replay, "baseline")
    api.swap_participant(replayed.id, "refund-script")
    api.set_budget(replayed.id, tokens=10**9)
    before = world()
    api.replay_here(replay.id)
    after = Run.objects.get(pk=replayed.id)
    try:
        api.resume(after.id, from_step="resolve")
        drive(after.id)
    except DurableAgentsError:
        pass
    assert world() == before
    assert Run.objects.get(pk=replayed.id).replay_lane == "baseline"


def test_a_recorded_call_that_was_an_error_is_answered_as_an_error():
    run = recorded("A-1001")
    cohort = api.save_cohort("errs", runs=[run.id])
    rec = cohort.recordings.get()
    data = rec.data
    for call in data["tool_calls"]:
        if call["name"] == "lookup_order":
            call["is_error"] = True
            call["result"] = "order service down"
    rec.data = data
    rec.save()
    rep = api.replay_here(api.replay(cohort="errs", lanes=("baseline",)).id)
    lane = rep.cases[0].lanes["baseline"]
    turns = Turn.objects.filter(run_id=lane.run_id, purpose="turn").order_by("index")
    results = [r for t in turns for r in (t.tool_results or [])]
    assert results and results[0].get("is_error") is True
    assert Step.objects.filter(run_id=lane.run_id).exists()


def test_a_model_step_whose_prompt_calls_a_tool_replays_with_the_recorded_answer(isolated_registries):
    """ctx.call_tool in an agent's prompt (a model step, executed in a replay): its answer is in no recording."""
    from durable_agents.api import agent, call, workflow  # noqa: PLC0415
    from project.refunds import workflows as refunds  # noqa: PLC0415

    def prompt(ctx):
        order = ctx.call_tool(refunds.lookup_order, {"order_id": ctx.input["order_id"]})
        return refunds.resolve_prompt(ctx) + f"\n\n(fresh: {order['order_id']})"

    workflow(
        "refund_ctx",
        steps=[
            call("load_order", refunds.load_order),
            agent(
                "resolve",
                instructions=refunds.INSTRUCTIONS,
                tools=[refunds.lookup_order, refunds.issue_refund, refunds.email_customer],
                prompt=prompt,
                participant="refund-script",
            ),
        ],
    )
    run = recorded_run = drive(api.start("refund_ctx", CASE["A-1001"].run_input).id)
    assert run.status == RunStatus.COMPLETED, run.error
    rep = api.replay_here(api.replay(runs=[recorded_run.id], lanes=("baseline",)).id)
    lane = rep.cases[0].lanes["baseline"]
    assert lane.agrees, f"a deterministic model replayed disagrees with itself: {lane.status} {lane.diverged}"


PRICED = "refund-script-priced"


def priced(request: ModelRequest):
    from durable_agents.agents.messages import ModelResponse, Usage  # noqa: PLC0415

    blocks = tuple(script.play(request))
    stop = "tool_use" if any(b.get("type") == "tool_use" for b in blocks) else "end_turn"
    return ModelResponse(content=blocks, stop_reason=stop, model=request.model, usage=Usage(2000, 500))


def test_the_replay_budget_stops_spending_within_one_turn():
    participants.register(PRICED, ScriptedParticipant(priced, name=PRICED))
    runs = [recorded("A-1001", participant=PRICED), recorded("A-1003", participant=PRICED)]
    turn_cost = max(Turn.objects.filter(run__in=runs).values_list("cost_usd", flat=True))
    if not turn_cost:
        pytest.skip("the scripted participant costs nothing")
    budget = turn_cost / 2
    replay = api.replay(runs=[r.id for r in runs], lanes=("baseline",), budget_usd=budget)
    api.replay_here(replay.id)
    spent = sum(
        Run.objects.filter(pk__in=ReplayRun.objects.filter(replay=replay).values("run_id")).values_list(
            "cost_usd", flat=True
        )
    )
    assert spent <= budget + turn_cost, f"spent {spent} of a {budget} budget (one turn costs {turn_cost})"


def test_runs_the_budget_stopped_are_not_counted_as_disagreeing():
    participants.register(PRICED, ScriptedParticipant(priced, name=PRICED))
    runs = [recorded("A-1001", participant=PRICED), recorded("A-1003", participant=PRICED)]
    turn_cost = max(Turn.objects.filter(run__in=runs).values_list("cost_usd", flat=True))
    replay = api.replay(
        runs=[r.id for r in runs], candidate={"instructions": refunds_instructions()}, budget_usd=turn_cost / 2
    )
    rep = api.replay_here(replay.id)
    passed, why = rep.verdict(0.5)
    assert "budget" in why, f"a replay stopped by its budget reads as a verdict on the candidate: {why!r}"


def refunds_instructions() -> str:
    from project.refunds import workflows as refunds  # noqa: PLC0415

    return refunds.INSTRUCTIONS


@pytest.mark.slow
def test_a_replay_run_killed_mid_step_on_a_real_worker_gets_the_same_answers(start_worker):
    from durable_agents.testing import wait_for, wait_for_run  # noqa: PLC0415

    run = recorded("A-1002")  # lookup, refund (approved by a manager), email: three calls, 0.4 s a turn on workers
    before = world()
    workers = [start_worker(beat=True), start_worker()]
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    replayed = lane_run(replay, "baseline")
    wait_for(
        lambda: Event.objects.filter(run_id=replayed.id, kind="replay_answered").exists(),
        timeout=60,
        what="the first answered call",
    )
    holder = Run.objects.get(pk=replayed.id).lease_owner
    victims = [w for w in workers if holder and w.owns(holder)]
    assert victims, f"no worker holds the replay run (lease {holder!r})"
    victims[0].kill()
    start_worker(beat=victims[0] is workers[0])  # a beat runs the sweep that takes the killed holder over
    done = wait_for_run(replayed.id, ("completed", "failed"), timeout=120)
    assert world() == before
    answered = Event.objects.filter(run_id=replayed.id, kind="replay_answered")
    indices = [e.detail["recorded"] for e in answered]
    assert len(set(indices)) == len(indices), f"a recorded call answered twice: {indices}"
    rep = api.replay_report(replay.id)
    lane = rep.cases[0].lanes["baseline"]
    assert done.status == RunStatus.COMPLETED and lane.agrees, (done.status, lane.error, lane.diverged)
