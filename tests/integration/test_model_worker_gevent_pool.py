"""The model worker's gevent pool and connections: a tool holding the pooled connection costs no other
conversation its lease, a plain step never runs on the model worker, a SIGSTOPped worker thawed after a takeover
repeats nothing journaled, and ask() inside a transaction keeps its writes and locks.

Each test asserts a guarantee (DESIGN.md §2, docs/howto/workers.md) of the model worker's runtime (gevent pool, Django's
psycopg pool, release_connection, queue routing). Nothing here waits on timing it does not control except bounded
observation windows (a lease lost or not within N leases), which never make a correct engine fail.
"""

from __future__ import annotations

import json
import time

import anthropic
import pytest
import redis
from django.db import connection

import tests.model_worker_flows as flows
from durable_agents import api
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.models import Event, Run, RunStatus, Step, Turn
from durable_agents.testing import wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic, Fault
from tests.integration.conftest import MODEL_QUEUE, ROUTED

pytestmark = pytest.mark.django_db(transaction=True)

# A live worker keeps its lease only if it gets the CPU within a lease: on a busy machine a 2-s lease can lapse
# for want of CPU alone. The renewer test runs its workers on a lease long enough for that, yet far shorter than
# the pool timeout (60 s) a starved renewer would wait.
PATIENT_LEASE = 10.0


@pytest.fixture
def fake():
    with FakeAnthropic(responder=flows.answer) as server:
        yield server


@pytest.fixture
def gate(broker_url):
    r = redis.Redis.from_url(broker_url)
    r.delete(flows.GATE, flows.AT_GATE)
    yield r
    r.set(flows.GATE, "1")  # let any worker still at the gate go before teardown kills it


def model_worker(start_worker, fake, *, db_pool: int, concurrency: int = 10, pool: str = "gevent", **env: str):
    return start_worker(
        pool=pool,
        concurrency=concurrency,
        env={
            **fake.environ(),
            "DJANGO_DB_POOL": str(db_pool),
            "DURABLE_TEST_SETTINGS": json.dumps(ROUTED),
            **env,
        },
        extra_args=["--queues", MODEL_QUEUE, "--include", "tests.model_worker_flows"],
    )


def default_worker(start_worker, fake, *, beat: bool = True):
    """The Procfile's `worker`: prefork, the default queue only, with beat (the sweep)."""
    return start_worker(
        beat=beat,
        pool="prefork",
        concurrency=2,
        env={**fake.environ(), "DURABLE_TEST_SETTINGS": json.dumps(ROUTED)},
        extra_args=["--include", "tests.model_worker_flows"],
    )


def billed(fake: FakeAnthropic) -> dict[str, int]:
    """What the fake API billed, summed over every answer it served."""
    served = {"input_tokens": "input_tokens", "output_tokens": "output_tokens"}
    served |= {"cache_write_tokens": "cache_creation_input_tokens", "cache_read_tokens": "cache_read_input_tokens"}
    return {field: sum(int(u.get(name) or 0) for u in fake.billed) for field, name in served.items()}


def requests_of(fake: FakeAnthropic, tag: str, turn: int) -> int:
    return sum(
        1
        for r in fake.requests
        if r.path == "/v1/messages" and r.turn == turn and f" {tag}:" in f" {flows.first_user_text(r)}"
    )


# -- the pool starves the lease renewer --------------------------------------------------------------------


@pytest.mark.slow
def test_pool__a_tool_holding_the_pooled_connection_does_not_cost_other_conversations_their_lease(
    fake, routed, gate, start_worker
):
    """Conversation B waits on the model (holding no connection, as designed). Conversation A's agent calls an
    I/O-bound tool on the same model worker (workers.md allows it: "keep them I/O-bound (database, HTTP)"). A's
    step still holds the pooled connection its journal took (CONN_MAX_AGE 0 only gives it back at task end or at
    the next `ask`), so while the tool waits the pool is empty — and the process's lease renewer needs a pooled
    connection too (lease.py `_Renewer._renew` → `renew_leases` → `connection.cursor()`): it waits up to the pool's
    60 s timeout. B's lease expires although its worker is alive and healthy; a second model worker takes B over
    and asks B's turn 0 again; the first worker's answer is then refused at journaling (unjournaled, billed twice).

    With DJANGO_DB_POOL=16 the same happens once 16 tools wait on slow HTTP at once among 1,000 conversations.
    """
    patient = {"DURABLE_LEASE_SECONDS": str(PATIENT_LEASE)}
    default_worker(start_worker, fake)
    model_worker(start_worker, fake, db_pool=1, **patient)
    fake.hold(when=lambda r: flows.first_user_text(r).startswith("fast") and r.turn == 0)

    b = api.start(flows.GATED_CONVERSATION, {"mode": "fast", "tag": "B", "order_id": "B-1"})
    assert fake.wait_in_flight(1, timeout=60), "B's first model call never arrived"
    a = api.start(flows.GATED_CONVERSATION, {"mode": "slow", "tag": "A", "order_id": "A-1"})
    wait_for(lambda: int(gate.get(flows.AT_GATE) or 0) >= 1, timeout=60, what="A's tool to start waiting")

    # A second model worker (docs/howto/workers.md: "more model_worker processes raise the figure").
    model_worker(start_worker, fake, db_pool=4, **patient)

    # Observe B for three leases while A's tool waits: a live worker's heartbeat must keep B's lease.
    takeover = Event.objects.filter(run_id=b.id, kind="lease_takeover")
    deadline = time.monotonic() + 3 * PATIENT_LEASE + 5
    while time.monotonic() < deadline and not takeover.exists():
        time.sleep(0.2)

    gate.set(flows.GATE, "1")
    fake.release()
    wait_for_run(a.id, "completed", timeout=120)
    wait_for_run(b.id, "completed", timeout=120)

    lost = list(takeover.values_list("detail", flat=True))
    asked = requests_of(fake, "B", 0)
    unjournaled = Event.objects.filter(run_id=b.id, kind="unjournaled_usage").count()
    assert not lost and asked == 1, (
        f"B lost its lease while its model worker was alive ({lost}); B's turn 0 was asked {asked} times "
        f"({unjournaled} answer(s) refused at journaling): the lease renewer waited for a pooled connection "
        "held by another conversation's tool"
    )


# -- routing is advisory: a stale model-queue message runs a plain step on the gevent worker -------------------


@pytest.mark.slow
def test_routing__a_plain_step_never_runs_on_the_gevent_model_worker(fake, routed, start_worker):
    """workers.md: every step other than agent/judge/planner/approval "stays on the default queue and its prefork
    workers, where CPU-bound code belongs"; "make CPU-heavy work a step of its own, which runs on prefork" (a
    CPU-bound greenlet stops every other greenlet, the lease renewer included).

    But the queue is chosen when the wake-up is sent (wake.py `queue_for`), and `advance` runs whatever step is at
    the cursor when the message arrives. A 429 with retry-after parks an agent step's retry as a countdown on the
    model queue (advance.py `_retry` → wake_on_commit(countdown)); an operator resumes the run ("resume clears
    the backoff"); the agent step completes and its next step, a plain `call`, is woken on the default queue.
    The stale countdown message then reaches the model worker, which claims the run and runs the `call` step on
    gevent. Here no default worker runs yet, so the run can only complete if the model worker ran it. (The 3-6 s
    backoff goes out as a countdown only under a MAX_COUNTDOWN_SECONDS above it; longer ones send no message.)"""
    countdowns = json.dumps({**ROUTED, "MAX_COUNTDOWN_SECONDS": 10})
    model_worker(start_worker, fake, db_pool=2, DURABLE_TEST_SETTINGS=countdowns)
    fake.fail_next(1, Fault.status(429, headers={"retry-after": "3"}))
    run = api.start(flows.AGENT_THEN_CRUNCH, {"tag": "R"})
    wait_for(lambda: Event.objects.filter(run_id=run.id, kind="step_retry").exists(), timeout=60, what="the 429 retry")
    api.resume(run.id, actor="ops")  # "durable_resume wakes a run at once, clearing any backoff"
    wait_for(
        lambda: Step.objects.filter(run_id=run.id, step_id="ask", status="done").exists(),
        timeout=60,
        what="the agent step to complete",
    )
    # The countdown message (3-6 s after the 429) is due within 6 s; give it ample time.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Run.objects.get(pk=run.id).status != RunStatus.COMPLETED:
        time.sleep(0.2)
    default_worker(start_worker, fake)  # the Procfile's prefork worker, for the plain step
    wait_for_run(run.id, "completed", timeout=60)

    ran_on = Step.objects.get(run_id=run.id, step_id="crunch").result
    assert ran_on["pool"] != "gevent", (
        f"the plain `call` step ran on the gevent model worker ({ran_on}): a stale model-queue message claimed "
        "the run after its next step changed kind"
    )


# -- zombies under gevent (expected to hold) -----------------------------------------------------------------


@pytest.mark.slow
def test_zombie__a_sigstopped_gevent_worker_thawed_after_takeover_repeats_nothing_journaled(
    fake, routed, start_worker, broker_url
):
    """SIGSTOP the gevent model worker while 20 conversations wait on their second model call (their first is
    journaled and its effect applied), let every lease expire and a second model worker take them over, then
    SIGCONT the first: the thawed greenlets get their answers, and none of them is journaled or acted on."""
    import signal

    from bench.scale_agent import WORKFLOW, applied
    from bench.scale_agent import answer as scale_answer

    redis.Redis.from_url(broker_url).delete("bench_scale:applied")
    fake.responder = scale_answer
    default_worker(start_worker, fake)
    env = {**fake.environ(), "DJANGO_DB_POOL": "4", "DURABLE_TEST_SETTINGS": json.dumps(ROUTED)}
    args = ["--queues", MODEL_QUEUE, "--include", "bench.scale_agent"]
    first = start_worker(pool="gevent", concurrency=40, env=env, extra_args=args)
    fake.hold(when=lambda r: r.turn >= 1)
    n = 20
    ids = [str(api.start(WORKFLOW, {"order_id": f"Z-{i}"}).id) for i in range(n)]
    assert fake.wait_in_flight(n, timeout=120), f"only {fake.in_flight} second calls in flight"

    first.signal(signal.SIGSTOP)
    start_worker(pool="gevent", concurrency=40, env=env, extra_args=args)
    wait_for(
        lambda: Event.objects.filter(run_id__in=ids, kind="lease_takeover").values("run_id").distinct().count() == n,
        timeout=120,
        what="every conversation taken over",
    )
    assert fake.wait_in_flight(2 * n, timeout=120), "the second worker's calls did not arrive"
    first.signal(signal.SIGCONT)
    fake.release()
    wait_for(
        lambda: Run.objects.filter(pk__in=ids, status=RunStatus.COMPLETED).count() == n,
        timeout=180,
        what="every conversation completed",
    )
    late = flows.asked_after_journaled(fake.requests, ids)
    assert not late, f"journaled turns asked again: {late}"
    assert Turn.objects.filter(run_id__in=ids).count() == 2 * n, "a zombie journaled an answer"
    counts = applied()
    assert len(counts) == n and set(counts.values()) == {1}, counts


# -- release_connection keeps a transaction (expected to hold) -----------------------------------------------


def test_release__ask_inside_a_transaction_keeps_its_writes_and_locks(fake):
    """A step that asks the model inside its own transaction (a select_for_update held across the call) keeps
    the connection: its lock and writes survive the model call and commit together."""
    from durable_agents.agents.journal import ask
    from durable_agents.agents.messages import ModelRequest

    class Ctx:
        def ensure_lease(self):
            pass

    client = anthropic.Anthropic(api_key="sk-ant-test-0123456789", base_url=fake.url, max_retries=0, timeout=5.0)
    participant = AnthropicParticipant(client=client)
    request = ModelRequest(model="m", max_tokens=5, system="", tools=[], messages=[{"role": "user", "content": "x"}])
    run = api.start(flows.GATED_CONVERSATION, {"mode": "fast", "tag": "T", "order_id": "T-1"})
    from django.db import transaction

    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.id)
        Run.objects.filter(pk=locked.pk).update(error={"type": "marker", "message": "before the call"})
        backend_pid = connection.connection.info.backend_pid
        ask(Ctx(), participant, request)
        assert connection.connection.info.backend_pid == backend_pid, "the transaction's connection was released"
        on_commit_ran = []
        transaction.on_commit(lambda: on_commit_ran.append(True))
    assert on_commit_ran == [True]
    assert Run.objects.get(pk=run.id).error == {"type": "marker", "message": "before the call"}
