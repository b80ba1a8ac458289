"""Parallel tool calls (issue 18, item 2): the tool_use blocks of one response run concurrently, bounded by
TOOL_CONCURRENCY, each effect keyed by its tool_use_id, results in block order; after a SIGKILL only the
calls not applied run again. The workflow and its tools: tests/testapp/parallel.py.
"""

from __future__ import annotations

import json

import pytest

from durable_agents import api
from durable_agents.models import Effect, Run, RunStatus, Turn, Wait, WaitStatus
from durable_agents.testing import drive, wait_for, wait_for_run
from tests.testapp.models import Execution, ReceiverCall
from tests.testapp.parallel import RECEIVER

pytestmark = pytest.mark.django_db(transaction=True)


def fan(*tools: str, **options: object) -> dict[str, object]:
    return {"calls": [{"tool": name, "slot": slot} for slot, name in enumerate(tools)], **options}


def key(run: Run, slot: int) -> str:
    return f"{run.id}:work:toolu_{slot}"


def results(run: Run) -> list[dict]:
    return Turn.objects.get(run=run, index=0).tool_results


def answers(run: Run) -> list[dict]:
    return [json.loads(r["content"]) for r in results(run)]


def records(run: Run) -> list[str]:
    """The calls' start and finish records, in the order they were committed."""
    rows = Execution.objects.filter(run_id=run.id, step_id__startswith="fan:").order_by("id")
    return [s.removeprefix("fan:") for s in rows.values_list("step_id", flat=True)]


def position(run: Run, record: str) -> int:
    return records(run).index(record)


def applications(run: Run, slot: int) -> int:
    """How many times the receiver applied the call's effect (it dedupes the same key sent again)."""
    return ReceiverCall.objects.filter(receiver=RECEIVER, idempotency_key=key(run, slot), deduped=False).count()


def assert_each_applied_once_in_order(run: Run, slots: int) -> None:
    assert [r["tool_use_id"] for r in results(run)] == [f"toolu_{i}" for i in range(slots)], "results out of order"
    assert [a["slot"] for a in answers(run)] == list(range(slots))
    effects = dict(Effect.objects.filter(run=run, tool__startswith="fan").values_list("idempotency_key", "status"))
    assert effects == {key(run, i): "applied" for i in range(slots)}, "each call is an effect keyed by its tool_use_id"
    assert [applications(run, i) for i in range(slots)] == [1] * slots, "an effect landed twice (or never)"


@pytest.fixture
def tool_concurrency(settings):
    def set_to(n: int) -> None:
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "TOOL_CONCURRENCY": n}

    return set_to


def test_parallel_tools__five_calls_of_one_response_overlap_and_answer_in_block_order(tool_concurrency):
    """Each call waits until all five have started: every one meeting the others proves they ran at once."""
    tool_concurrency(5)
    run = drive(api.start("parallel_tools", fan(*["fan_call"] * 5, meet=5, meet_s=60)).id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert [a["met"] for a in answers(run)] == [True] * 5, "a call finished before all five had started"
    last_start = max(position(run, f"{i}:start") for i in range(5))
    assert last_start < min(position(run, f"{i}:finish") for i in range(5))
    assert_each_applied_once_in_order(run, 5)


def test_parallel_tools__on_the_gevent_model_worker_the_calls_overlap_too(start_worker):
    """Under gevent the pool's threads are greenlets, each with a connection from Django's psycopg pool."""
    start_worker(pool="gevent", concurrency=20, env={"DJANGO_DB_POOL": "8"})
    run = api.start("parallel_tools", fan(*["fan_call"] * 4, meet=4, meet_s=60))

    run = wait_for_run(run.id, "completed", timeout=90)
    assert [a["met"] for a in answers(run)] == [True] * 4, "the greenlets did not overlap"
    assert_each_applied_once_in_order(run, 4)


def test_parallel_tools__concurrency_1_runs_the_calls_one_after_the_other(tool_concurrency):
    tool_concurrency(1)
    run = drive(api.start("parallel_tools", fan(*["fan_call"] * 5, meet=5, meet_s=0.3)).id)

    assert run.status == RunStatus.COMPLETED, run.error
    assert [a["met"] for a in answers(run)] == [False] * 5, "the five calls cannot meet when they run one at a time"
    assert records(run) == [f"{i}:{what}" for i in range(5) for what in ("start", "finish")]
    assert_each_applied_once_in_order(run, 5)


def test_parallel_tools__a_tool_that_is_not_parallel_safe_runs_alone(tool_concurrency):
    """fan_alone (parallel_safe=False) waits for the calls before it; the calls after it wait for it."""
    tool_concurrency(4)
    run = drive(
        api.start("parallel_tools", fan("fan_call", "fan_call", "fan_alone", "fan_call", "fan_call", meet=2)).id
    )

    assert run.status == RunStatus.COMPLETED, run.error
    assert answers(run)[0]["met"] and answers(run)[1]["met"], "the calls before the lone one ran together"
    assert position(run, "2:start") > max(position(run, "0:finish"), position(run, "1:finish"))
    assert position(run, "2:finish") < min(position(run, "3:start"), position(run, "4:start"))
    assert_each_applied_once_in_order(run, 5)


def test_parallel_tools__a_failing_call_is_its_own_error_result_the_others_succeed(tool_concurrency):
    tool_concurrency(5)
    run = drive(api.start("parallel_tools", fan(*["fan_call"] * 5, meet=5, meet_s=60, fail=[2])).id)

    assert run.status == RunStatus.COMPLETED, run.error
    outcome = results(run)
    assert [r["tool_use_id"] for r in outcome] == [f"toolu_{i}" for i in range(5)]
    assert outcome[2].get("is_error") and "slot 2 is out of order" in outcome[2]["content"]
    assert not any(r.get("is_error") for i, r in enumerate(outcome) if i != 2)
    assert all(json.loads(outcome[i]["content"])["met"] for i in (0, 1, 3, 4)), "the failure stopped the others"
    assert Effect.objects.get(idempotency_key=key(run, 2)).status == "failed"
    assert [applications(run, i) for i in range(5)] == [1, 1, 0, 1, 1]


def test_parallel_tools__approvals_are_decided_before_any_call_of_the_response_runs(tool_concurrency):
    """Two gated calls among four: the run parks on each in turn and nothing runs until both are decided;
    then the approved one and the ungated ones run, the rejected one is an error result."""
    tool_concurrency(4)
    run = drive(api.start("parallel_tools", fan("fan_call", "fan_gated", "fan_call", "fan_gated")).id)

    assert run.status == RunStatus.WAITING
    first = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    assert first.effect_key == key(run, 1)
    assert records(run) == [] and not Effect.objects.filter(run=run, tool__startswith="fan").exists(), "a call ran"
    api.decide(first.pk, True, by="manager-1")

    run = drive(run.id)
    assert run.status == RunStatus.WAITING
    second = Wait.objects.get(run=run, status=WaitStatus.OPEN)
    assert second.effect_key == key(run, 3)
    assert records(run) == [], "a call ran while another of its response awaited a human"
    api.decide(second.pk, False, by="manager-1", comment="not this one")

    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    outcome = results(run)
    assert [r["tool_use_id"] for r in outcome] == [f"toolu_{i}" for i in range(4)]
    assert outcome[3].get("is_error") and "rejected" in outcome[3]["content"]
    assert [applications(run, i) for i in range(4)] == [1, 1, 1, 0]


@pytest.mark.parametrize("pool", ["solo", "gevent"])
def test_parallel_tools__sigkill_mid_calls_applies_each_effect_once(start_worker, pool):
    """Six calls, four at a time (the default): when the worker dies, call 0 is applied, 1 and 2 landed at the
    receiver without a recorded outcome, 3 and 4 were started but never landed, 5 never started. The next
    worker reuses 0, calls 1 and 2 again under their keys (deduped), and runs 3, 4 and 5 once."""
    env = {"DJANGO_DB_POOL": "8"} if pool == "gevent" else {}
    worker = start_worker(pool=pool, concurrency=20 if pool == "gevent" else 1, env=env)
    pauses = {"fan1_after_land": 120, "fan2_after_land": 120, "fan3_before_land": 120, "fan4_before_land": 120}
    run = api.start("parallel_tools", fan(*["fan_call"] * 6, pauses=pauses))
    marks = [f"work:{point}" for point in pauses]

    wait_for(
        lambda: (
            Effect.objects.filter(idempotency_key=key(run, 0), status="applied").exists()
            and Execution.objects.filter(run_id=run.id, step_id__in=marks).count() == len(marks)
        ),
        timeout=90,
        what="call 0 applied and calls 1-4 in flight",
    )
    assert not Effect.objects.filter(idempotency_key=key(run, 5)).exists(), "a fifth call started beside four"
    expires = Run.objects.get(pk=run.id).lease_expires_at
    wait_for(
        lambda: Run.objects.get(pk=run.id).lease_expires_at > expires,
        timeout=30,
        what="the lease to be renewed while the calls run",
    )
    worker.kill()
    if pool == "gevent":
        # Celery's beat cannot run in a gevent worker: a solo worker on a queue of its own only schedules the sweep.
        start_worker(beat=True, extra_args=["--queues", "beat-only"])
    start_worker(pool=pool, concurrency=20 if pool == "gevent" else 1, env=env, beat=pool != "gevent")

    run = wait_for_run(run.id, "completed", timeout=120)
    assert_each_applied_once_in_order(run, 6)
    sent = [ReceiverCall.objects.filter(receiver=RECEIVER, idempotency_key=key(run, i)).count() for i in range(6)]
    assert sent == [1, 2, 2, 1, 1, 1], "an applied call was called again, or an unapplied one not called"
    assert Execution.objects.filter(run_id=run.id, step_id="fan:0:start").count() == 1
