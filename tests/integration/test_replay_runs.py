"""Replay runs as the engine executes them: answered from the recording, applying nothing, by every road.

Recordings are real runs of tests/testapp workflows; replays run on a real worker (the model through the fake
Messages API and the real SDK) or in this process (`api.replay_here`), as CI without workers would.
"""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.test import override_settings

from durable_agents import api, clock, tasks
from durable_agents.engine.replaying import DIVERGED
from durable_agents.engine.sweep import sweep
from durable_agents.errors import InvalidTransitionError, ReplayAppliesNothingError
from durable_agents.metrics import read_figures
from durable_agents.models import Effect, Event, ReplayRun, Run, RunStatus, Step, Wait
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault, Reply
from tests.testapp.models import Execution, LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)

CANDIDATE_MODEL = "claude-haiku-4-5"


def billing_script(request) -> Reply:
    """The fake model's side of the billing conversation (tests/integration/test_agents.py), whatever the model."""
    if request.turn == 0:
        return Reply.tool_use("lookup_order", {"order_id": "A-1"}, id="toolu_lookup")
    if request.turn == 1:
        return Reply.tool_use("charge", {"order_id": "A-1", "amount": "30.00"}, id="toolu_charge")
    return Reply.text("Order A-1 is charged 30.00.")


def side_effects() -> tuple[int, int, int, int]:
    """Rows only a real run writes: effects, waits, the ledger the tools write, the executions step code records."""
    return Effect.objects.count(), Wait.objects.count(), LedgerEntry.objects.count(), Execution.objects.count()


def replay_runs(replay) -> list[Run]:
    ids = ReplayRun.objects.filter(replay=replay).values("run_id")
    return list(Run.objects.filter(pk__in=ids).order_by("replay_lane"))


def test_replay_on_a_worker__baseline_asks_the_recorded_model_and_candidate_its_own_with_the_tools_never_called(
    start_worker, worker_env
):
    with FakeAnthropic(responder=billing_script) as fake:
        worker_env.update(fake.environ(api_key="sk-ant-test-secret-0123456789"))
        start_worker()
        source = wait_for_run(api.start("agent_charge", {"message": "Please charge order A-1."}).id, timeout=60)
        recorded_model = Step.objects.get(run=source, step_id="assistant").frozen_request["model"]
        before = side_effects()

        replay = api.replay(runs=[source.id], candidate={"model": CANDIDATE_MODEL})
        baseline, candidate = replay_runs(replay)
        for run in (baseline, candidate):
            wait_for_run(run.id, timeout=60)

        asked = {
            lane.id: {r.body["model"] for r in fake.requests_for(f"{lane.id}:assistant")}
            for lane in replay_runs(replay)
        }
    assert asked[baseline.id] == {recorded_model} and asked[candidate.id] == {CANDIDATE_MODEL}
    assert side_effects() == before, "a replay run called a tool, applied an effect or opened a wait"
    report = api.replay_report(replay.id)
    assert report.lanes["baseline"].agree == report.lanes["candidate"].agree == 1
    assert {r.concurrency_key for r in (baseline, candidate)} == {f"durable-replay:{replay.id}"}


def test_replay__steps_that_ask_no_model_return_their_recorded_results_and_their_code_never_runs():
    source = drive(api.start("approve_charge", {"order_id": "C-1"}).id)
    api.decide(Wait.objects.get(run=source).pk, True, by="ops")
    source = drive(source.id)
    assert source.status == RunStatus.COMPLETED
    before = side_effects()

    report = api.replay_here(api.replay(runs=[source.id], lanes=("baseline",)).id)

    assert side_effects() == before, "the approval reached someone, the charge was made or step code ran"
    [replayed] = [c.lanes["baseline"] for c in report.cases]
    assert replayed.status == RunStatus.COMPLETED and replayed.agrees
    results = dict(Step.objects.filter(run_id=replayed.run_id).values_list("step_id", "result"))
    assert results == dict(Step.objects.filter(run=source).values_list("step_id", "result"))


def test_replay__a_step_its_recording_never_completed_ends_that_replay_as_diverged():
    source = drive(api.start("approve_charge", {"order_id": "C-2"}).id)
    api.cancel(source.id, reason="changed my mind")  # cancelled while waiting: no approval, no charge recorded

    report = api.replay_here(api.replay(runs=[source.id], lanes=("baseline",), status="cancelled").id)

    [replayed] = [c.lanes["baseline"] for c in report.cases]
    assert replayed.status == RunStatus.FAILED and not replayed.agrees
    assert "never completed" in replayed.error
    assert Event.objects.filter(run_id=replayed.run_id, kind=DIVERGED).count() == 1
    assert Wait.objects.filter(run_id=replayed.run_id).count() == 0


def test_replay_runs__never_count_in_the_metrics_of_real_runs():
    source = drive(api.start("approve_charge", {"order_id": "C-3"}).id)
    api.cancel(source.id)
    now = Run.objects.get(pk=source.id).updated_at
    real = read_figures(now, now).by_status

    api.replay_here(api.replay(runs=[source.id], lanes=("baseline",), status="cancelled").id)

    assert Run.objects.exclude(replay_lane="").count() == 1
    assert read_figures(now, now).by_status == real


def test_replay_run__cannot_be_forked_into_a_real_run():
    source = drive(api.start("approve_charge", {"order_id": "C-4"}).id)
    api.decide(Wait.objects.get(run=source).pk, True, by="ops")
    source = drive(source.id)
    report = api.replay_here(api.replay(runs=[source.id], lanes=("baseline",)).id)
    replayed = report.cases[0].lanes["baseline"].run_id

    with pytest.raises(InvalidTransitionError, match="replay run"):
        api.fork(replayed, "charge")


def test_replay_run__refuses_a_tool_call_that_reaches_invoke_tool():
    from durable_agents.engine.effects import invoke_tool
    from tests.testapp.workflows import charge

    source = drive(api.start("approve_charge", {"order_id": "C-5"}).id)
    api.cancel(source.id)
    replay = api.replay(runs=[source.id], lanes=("baseline",), status="cancelled")
    [run] = replay_runs(replay)

    ctx = SimpleNamespace(run=run)
    with pytest.raises(ReplayAppliesNothingError):
        invoke_tool(charge, {"order_id": "C-5", "amount": "1.00"}, key="k", run_id=run.id, step_pk=None, ctx=ctx)
    assert LedgerEntry.objects.count() == 0


def test_replay_queue__replay_runs_go_to_a_worker_of_their_own_and_never_to_real_runs_workers(start_worker, worker_env):
    """With REPLAY_QUEUE, every wake-up of a replay run (its start, its admission, each step, a model-bound step) goes
    to that queue: a worker serving only it finishes the replay, and the workers of real runs never see it."""
    routed = {"MODEL_QUEUE": "durable-model", "REPLAY_QUEUE": "durable-replay"}
    with FakeAnthropic(responder=billing_script) as fake:
        worker_env.update(fake.environ(api_key="sk-ant-test-secret-0123456789"))
        real_workers = [
            start_worker(),
            start_worker(env={"DURABLE_TEST_SETTINGS": json.dumps(routed)}, extra_args=["--queues", "durable-model"]),
        ]
        source = wait_for_run(api.start("agent_charge", {"message": "Please charge order A-1."}).id, timeout=60)
        for worker in real_workers:
            worker.stop()
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **routed}):
            replay = api.replay(runs=[source.id], candidate={"model": CANDIDATE_MODEL})
            start_worker(env={"DURABLE_TEST_SETTINGS": json.dumps(routed)}, extra_args=["--queues", "durable-replay"])
            for run in replay_runs(replay):
                wait_for_run(run.id, timeout=60)
    assert api.replay_report(replay.id).lanes["candidate"].agree == 1


woken: list[tuple[str, dict]] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append((run_id, routed))


def test_sweep__re_wakes_a_lost_replay_run_on_the_replay_queue():
    source = drive(api.start("approve_charge", {"order_id": "C-6"}).id)
    api.cancel(source.id)
    routed = {"MODEL_QUEUE": "durable-model", "REPLAY_QUEUE": "durable-replay", "WAKER": f"{__name__}.record_wake"}
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **routed}):
        [run] = replay_runs(api.replay(runs=[source.id], lanes=("baseline",), status="cancelled"))
        real = api.start("noop", {"steps": 1})
        woken.clear()
        clock.advance(timedelta(minutes=5))  # both messages lost: no progress for longer than IDLE_RESWEEP_SECONDS
        try:
            sweep()
        finally:
            clock.reset()
    assert sorted(woken) == sorted([(str(run.id), {"queue": "durable-replay"}), (str(real.id), {})]), woken


def test_api_runs__lists_replay_runs_only_when_asked():
    source = drive(api.start("approve_charge", {"order_id": "C-7"}).id)
    api.cancel(source.id)
    [replayed] = replay_runs(api.replay(runs=[source.id], lanes=("baseline",), status="cancelled"))

    assert list(api.runs(workflow="approve_charge")) == [Run.objects.get(pk=source.id)]
    assert set(api.runs(workflow="approve_charge", replays=True)) == {Run.objects.get(pk=source.id), replayed}
    assert replayed.replay_lane == "baseline"


def test_replay_sigkill__a_worker_killed_mid_replay_leaves_each_recorded_call_answered_once_and_nothing_applied(
    start_worker, worker_env
):
    """A replay run's worker is SIGKILLed while the model thinks on its last turn; another worker takes the run over.
    The two tool calls before it were answered from the recording once each (one `replay_answered` event per call,
    never a recorded call twice), only the unjournaled turn is asked again, and nothing reached the ledger."""
    with FakeAnthropic(responder=billing_script) as fake:
        worker_env.update(fake.environ())
        worker = start_worker()
        source = wait_for_run(api.start("agent_charge", {"message": "Charge A-1"}).id, timeout=60)
        before = side_effects()

        def slow_last_turn(request):
            if request.turn == 2 and request.attempt == 1:
                return Fault.delay(30)
            return billing_script(request)

        fake.responder = slow_last_turn
        [replayed] = replay_runs(api.replay(runs=[source.id], lanes=("baseline",)))
        conversation = f"{replayed.id}:assistant"
        wait_for(lambda: fake.count(conversation, 2) == 1, timeout=30, what="the replay's third model request")
        worker.kill()
        start_worker(beat=True)
        wait_for_run(replayed.id, "completed", timeout=60)
        asked = [fake.count(conversation, i) for i in range(3)]

    assert asked == [1, 1, 2], "only the turn the killed worker never journaled is asked again"
    answered = Event.objects.filter(run_id=replayed.id, kind="replay_answered").values_list("detail", flat=True)
    assert sorted(d["recorded"] for d in answered) == [0, 1], "each recorded call answered once"
    assert side_effects() == before


def test_replay_queue__a_replay_queue_that_is_also_the_model_queue_runs_replay_steps_delivered_there():
    """REPLAY_QUEUE and MODEL_QUEUE may name one queue (one gevent worker for the model's steps and the replays):
    every wake-up of a replay run goes there, whatever its step, so the worker serving it must run the step — not
    leave the message unclaimed (a plain step is no model step) while the sweep sends it back there for ever."""
    source = drive(api.start("approve_charge", {"order_id": "C-8"}).id)
    api.cancel(source.id)
    shared = "durable-model-and-replay"
    routed = {"MODEL_QUEUE": shared, "REPLAY_QUEUE": shared, "WAKER": f"{__name__}.record_wake"}
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **routed}):
        [run] = replay_runs(api.replay(runs=[source.id], lanes=("baseline",), status="cancelled"))
        woken.clear()
        done = tasks._advance_or_pass_on(str(run.id), shared)
    assert done not in ("skipped", "passed on"), f"the replay run's message on {shared!r} was {done} ({woken})"
    assert Step.objects.filter(run=run, status="done").exists(), "no step of the replay run ran"
