"""Agent steps against the fake Messages API through the real SDK: journal, crashes, faults, swaps, usage."""

from __future__ import annotations

import anthropic
import pytest
from django.db.models import Sum

from durable_agents import api
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants, text, tool_use
from durable_agents.engine.advance import advance
from durable_agents.models import Effect, Event, Run, RunStatus, Step, Turn
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, Reply
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


def billing_script(request) -> Reply:
    """The fake model's side of the billing conversation, decided by the turn number."""
    order = "A-1"
    if request.turn == 0:
        return Reply.tool_use("lookup_order", {"order_id": order}, id="toolu_lookup")
    if request.turn == 1:
        return Reply.tool_use("charge", {"order_id": order, "amount": "30.00"}, id="toolu_charge")
    return Reply.text("Order A-1 is charged 30.00.")


@pytest.fixture
def fake():
    with FakeAnthropic(responder=billing_script) as server:
        yield server


@pytest.fixture
def in_process_model(fake):
    """The 'anthropic' participant of this process talks to the fake server through the real SDK."""
    client = anthropic.Anthropic(
        api_key="sk-ant-test-secret-0123456789", base_url=fake.url, max_retries=0, timeout=10.0
    )
    previous = participants._participants.get("anthropic")
    participants.register("anthropic", AnthropicParticipant(client=client))
    yield fake
    if previous is None:
        participants._participants.pop("anthropic", None)
    else:
        participants.register("anthropic", previous)


def conversation(run) -> str:
    return f"{run.id}:assistant"


def test_agent__multi_turn_with_two_tools_completes_on_a_worker(start_worker, fake, worker_env):
    worker_env.update(fake.environ(api_key="sk-ant-test-secret-0123456789"))
    start_worker()
    run = api.start("agent_charge", {"message": "Please charge order A-1."})

    run = wait_for_run(run.id, "completed", timeout=60)

    turns = list(Turn.objects.filter(run=run).order_by("index"))
    assert [t.stop_reason for t in turns] == ["tool_use", "tool_use", "end_turn"]
    assert Step.objects.get(run=run, step_id="assistant").result["text"] == "Order A-1 is charged 30.00."
    assert [fake.count(conversation(run), i) for i in range(3)] == [1, 1, 1]
    assert LedgerEntry.objects.get().idempotency_key == f"{run.id}:assistant:toolu_charge"
    assert turns[1].tool_results[0]["tool_use_id"] == "toolu_charge"
    assert turns[0].model and turns[0].request_id


@pytest.mark.parametrize("kill_point", ["assistant:in_lookup", "assistant:inside_charge"])
def test_agent__sigkill_mid_tool_never_asks_a_journaled_turn_again(start_worker, fake, worker_env, kill_point):
    worker_env.update(fake.environ())
    worker = start_worker()
    point = kill_point.split(":")[1]
    run = api.start("agent_charge", {"message": "Charge A-1", "pause_at": point, "pause_s": 30})
    wait_for(
        lambda: Execution.objects.filter(run_id=run.id, step_id=kill_point).exists(),
        timeout=30,
        what=f"the worker to reach {kill_point}",
    )
    worker.kill()
    start_worker(beat=True)

    run = wait_for_run(run.id, "completed", timeout=60)
    assert [fake.count(conversation(run), i) for i in range(3)] == [1, 1, 1], "a journaled turn was asked again"
    assert LedgerEntry.objects.count() == 1 and Effect.objects.get().status == "applied"
    assert Turn.objects.filter(run=run).count() == 3


def test_agent__sigkill_during_a_model_call_asks_only_that_unjournaled_turn_again(start_worker, fake, worker_env):
    worker_env.update(fake.environ())
    worker = start_worker()

    def slow_last_turn(request):
        if request.turn == 2 and request.attempt == 1:
            return Fault.delay(30)
        return billing_script(request)

    fake.responder = slow_last_turn
    run = api.start("agent_charge", {"message": "Charge A-1"})
    wait_for(lambda: fake.count(conversation(run), 2) == 1, timeout=30, what="the third model request")
    worker.kill()
    start_worker(beat=True)

    run = wait_for_run(run.id, "completed", timeout=60)
    assert [fake.count(conversation(run), i) for i in range(3)] == [1, 1, 2]
    assert Turn.objects.filter(run=run).count() == 3 and LedgerEntry.objects.count() == 1


def test_agent__swap_to_a_scripted_participant_mid_run_continues_from_the_journal(in_process_model):
    participants.register(
        "billing-script",
        api.ScriptedParticipant(lambda request: [text("Charged, says the script.")], name="billing-script"),
    )
    run = api.start("agent_charge", {"message": "Charge A-1"})
    in_process_model.enqueue(Fault.status(529))  # the first turn fails; the run waits to retry

    assert advance(run.id) == "retry"
    in_process_model.responder = lambda request: Fault.status(529)
    api.swap_participant(run.id, "billing-script", actor="ops")
    Run.objects.filter(pk=run.id).update(wake_at=None)
    run = drive(run.id)

    assert run.status == RunStatus.COMPLETED
    turns = list(Turn.objects.filter(run=run).values_list("participant", flat=True))
    assert turns == ["billing-script"]
    assert Event.objects.get(run=run, kind="participant_swapped").actor == "ops"


def test_agent__swap_after_journaled_turns_replays_them(in_process_model):
    run = api.start("agent_charge", {"message": "Charge A-1"})
    in_process_model.responder = lambda request: billing_script(request) if request.turn == 0 else Fault.status(529)
    assert advance(run.id) == "retry"  # turn 0 journaled, turn 1 failed
    participants.register(
        "closer",
        api.ScriptedParticipant(
            lambda request: (
                [tool_use("charge", {"order_id": "A-1", "amount": "30.00"})] if request.turn == 1 else [text("done")]
            ),
            name="closer",
        ),
    )
    api.swap_participant(run.id, "closer")
    Run.objects.filter(pk=run.id).update(wake_at=None)
    run = drive(run.id)

    assert run.status == RunStatus.COMPLETED
    assert list(Turn.objects.filter(run=run).order_by("index").values_list("participant", flat=True)) == [
        "anthropic",
        "closer",
        "closer",
    ]
    assert in_process_model.count(conversation(run), 0) == 1, "the swapped-in participant replays the journal"


def test_agent__usage_is_summed_per_run_across_retries(in_process_model):
    in_process_model.enqueue(Fault.status(500), Reply.tool_use("lookup_order", {"order_id": "A-1"}, id="t1"))
    in_process_model.enqueue(Fault.status(529))
    run = _drive_through_retries(api.start("agent_charge", {"message": "Charge A-1"}))

    assert run.status == RunStatus.COMPLETED
    reported = [r for r in in_process_model.requests if r.path == "/v1/messages"]
    turns = Turn.objects.filter(run=run)
    sums = turns.aggregate(
        i=Sum("input_tokens"), o=Sum("output_tokens"), w=Sum("cache_write_tokens"), r=Sum("cache_read_tokens")
    )
    assert (run.input_tokens, run.output_tokens) == (sums["i"], sums["o"]) and sums["i"] > 0
    assert len(reported) == turns.count() + 2, "two failed attempts, each retried"
    assert run.cost_usd > 0, "claude-sonnet turns have a price"


def _drive_through_retries(run):
    for _ in range(50):
        Run.objects.filter(pk=run.id).update(wake_at=None)
        advance(run.id)
        run = Run.objects.get(pk=run.id)
        if run.is_finished:
            return run
    raise AssertionError("the run did not finish")
