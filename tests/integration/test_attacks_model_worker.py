"""Attacks on the model worker (bacfaa3): gevent pool, Django's psycopg pool, release_connection, queue routing.

Each test asserts a guarantee (DESIGN.md §2, README "Workers") under the new runtime. A failing test is a hole;
see the attack14 report for the file/line of each. Nothing here waits on timing it does not control except
bounded observation windows (a lease lost or not within N leases), which never make a correct engine fail.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from datetime import timedelta
from decimal import Decimal

import anthropic
import psycopg
import psycopg_pool
import pytest
import redis
from django.db import connection
from django.db.models import Sum

import tests.attack14_flows as flows
from durable_agents import api, clock
from durable_agents.agents.budget import Budget
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants
from durable_agents.engine import transitions
from durable_agents.models import Event, Run, RunStatus, Step, Turn
from durable_agents.testing import drive, wait_for, wait_for_run
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
        extra_args=["--queues", MODEL_QUEUE, "--include", "tests.attack14_flows"],
    )


def default_worker(start_worker, fake, *, beat: bool = True):
    """The Procfile's `worker`: prefork, the default queue only, with beat (the sweep)."""
    return start_worker(
        beat=beat,
        pool="prefork",
        concurrency=2,
        env={**fake.environ(), "DURABLE_TEST_SETTINGS": json.dumps(ROUTED)},
        extra_args=["--include", "tests.attack14_flows"],
    )


def admin_connection(*, autocommit: bool = False) -> psycopg.Connection:
    """A connection of the test's own to the test database, apart from Django's: it locks rows and ends backends."""
    db = connection.settings_dict
    return psycopg.connect(
        dbname=db["NAME"],
        user=db["USER"] or None,
        password=db["PASSWORD"] or None,
        host=db["HOST"] or None,
        port=db["PORT"] or None,
        autocommit=autocommit,
    )


def end_backends(application_name: str, admin: psycopg.Connection | None = None) -> int:
    """End every server process of one client (its `application_name`; the lease renewer's ends in ":lease-renewer"
    and is spared), as a restart or a failover would. With a timeout, pg_terminate_backend "waits until the process
    is actually terminated" (PostgreSQL 14+ docs, Server Signaling Functions): none is left half-alive."""
    with contextlib.nullcontext(admin) if admin is not None else admin_connection(autocommit=True) as db:
        ended = db.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE application_name = %s",
            [application_name],
        ).fetchall()
    return sum(1 for (ok,) in ended if ok)


def spend_writes_waiting(admin: psycopg.Connection, application_name: str) -> str:
    """The statement of `application_name` that adds to a run's spend (`cost_usd`) while it waits for a row lock;
    "" if none does."""
    row = admin.execute(
        "SELECT query FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock' "
        "AND query LIKE '%%cost_usd%%'",
        [application_name],
    ).fetchone()
    return row[0] if row else ""


def billed(fake: FakeAnthropic) -> dict[str, int]:
    """What the fake API billed, summed over every answer it served."""
    served = {"input_tokens": "input_tokens", "output_tokens": "output_tokens"}
    served |= {"cache_write_tokens": "cache_creation_input_tokens", "cache_read_tokens": "cache_read_input_tokens"}
    return {field: sum(int(u.get(name) or 0) for u in fake.billed) for field, name in served.items()}


def counted(run: Run) -> dict[str, int]:
    run.refresh_from_db()
    return {
        field: getattr(run, field)
        for field in ("input_tokens", "output_tokens", "cache_write_tokens", "cache_read_tokens")
    }


def requests_of(fake: FakeAnthropic, tag: str, turn: int) -> int:
    return sum(
        1
        for r in fake.requests
        if r.path == "/v1/messages" and r.turn == turn and f" {tag}:" in f" {flows.first_user_text(r)}"
    )


# -- 1. the pool starves the lease renewer ---------------------------------------------------------------


@pytest.mark.slow
def test_pool__a_tool_holding_the_pooled_connection_does_not_cost_other_conversations_their_lease(
    fake, routed, gate, start_worker
):
    """Conversation B waits on the model (holding no connection, as designed). Conversation A's agent calls an
    I/O-bound tool on the same model worker (the README allows it: "keep them I/O-bound (database, HTTP)"). A's
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

    b = api.start(flows.ATTACK_CONVERSATION, {"mode": "fast", "tag": "B", "order_id": "B-1"})
    assert fake.wait_in_flight(1, timeout=60), "B's first model call never arrived"
    a = api.start(flows.ATTACK_CONVERSATION, {"mode": "slow", "tag": "A", "order_id": "A-1"})
    wait_for(lambda: int(gate.get(flows.AT_GATE) or 0) >= 1, timeout=60, what="A's tool to start waiting")

    # A second model worker (the README: "more model_worker processes raise the figure").
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


# -- 2. a connection given back while the model thinks may not come back: the answer is lost ---------------


def test_pool__an_answer_received_while_the_pool_is_exhausted_is_journaled_or_at_least_counted(fake, monkeypatch):
    """`ask` gives the connection back before the model call (journal.py `ask` → connections.release_connection), so
    journaling the answer needs a pooled connection again. When the pool is exhausted, psycopg_pool raises
    PoolTimeout (an OperationalError) in `journal_turn`: the answer, already billed, is neither journaled nor
    counted (journal.py counts unjournaled usage only for LeaseLostError / IntegrityError), the step is retried
    and the model is asked the same turn again. DESIGN §3: a repeated request's "usage is counted"; the only
    repeat allowed is a worker paused between its lease proof and the send.

    Simulated in-process: the first reconnection after the model's answer fails as psycopg_pool does."""
    client = anthropic.Anthropic(api_key="sk-ant-test-0123456789", base_url=fake.url, max_retries=0, timeout=5.0)
    previous = participants._participants.get("anthropic")
    participant = AnthropicParticipant(client=client)
    participants.register("anthropic", participant)
    real_respond = participant.respond
    real_new_connection = connection.get_new_connection
    state = {"armed": False, "fired": 0}

    def exhausted_pool(conn_params):
        if state["armed"]:
            state["armed"] = False
            state["fired"] += 1
            raise psycopg_pool.PoolTimeout("couldn't get a connection after 60.00 sec")
        return real_new_connection(conn_params)

    def respond(request):
        response = real_respond(request)
        if state["fired"] == 0:
            state["armed"] = True  # the pool is empty when the answer comes back
        return response

    monkeypatch.setattr(connection, "get_new_connection", exhausted_pool)
    monkeypatch.setattr(participant, "respond", respond)
    try:
        run = api.start(flows.ATTACK_CONVERSATION, {"mode": "fast", "tag": "P", "order_id": "P-1"})
        run = drive(run.id)
    finally:
        if previous is None:
            participants._participants.pop("anthropic", None)
        else:
            participants.register("anthropic", previous)

    assert state["fired"] == 1, "the simulated PoolTimeout did not hit the journal"
    assert run.status == RunStatus.COMPLETED, run.error
    answered = requests_of(fake, "P", 0)
    journaled = Turn.objects.filter(run_id=run.id).count()
    billed_output = answered  # every answered request was billed
    run.refresh_from_db()
    turn_output = Turn.objects.get(run_id=run.id).output_tokens
    assert run.output_tokens == billed_output * turn_output, (
        f"the model answered turn 0 {answered} times ({journaled} journaled), but the run counts "
        f"{run.output_tokens} output tokens, not {billed_output * turn_output}: the answer lost to PoolTimeout was "
        "billed and never counted (budgets miss it)"
    )
    assert answered == 1, f"turn 0 was asked {answered} times: an answered turn was asked again"


# -- 3. routing is advisory: a stale model-queue message runs a plain step on the gevent worker --------------


@pytest.mark.slow
def test_routing__a_plain_step_never_runs_on_the_gevent_model_worker(fake, routed, start_worker):
    """The README: every step other than agent/judge/planner/approval "stays on the default queue and its prefork
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
    run = api.start(flows.ATTACK_AGENT_THEN_CRUNCH, {"tag": "R"})
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


# -- 4. zombies under gevent (expected to hold) ------------------------------------------------------------


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
    for conversation in {r.conversation for r in fake.requests}:
        assert fake.count(conversation, turn=0) == 1, f"{conversation}: a journaled turn was asked again"
    assert Turn.objects.filter(run_id__in=ids).count() == 2 * n, "a zombie journaled an answer"
    counts = applied()
    assert len(counts) == n and set(counts.values()) == {1}, counts


# -- 5. release_connection keeps a transaction (expected to hold) ------------------------------------------


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
    run = api.start(flows.ATTACK_CONVERSATION, {"mode": "fast", "tag": "T", "order_id": "T-1"})
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


# -- 6. a billed answer whose connection died is journaled on a fresh one, or counted --------------------------


def journal_env(application_name: str) -> dict[str, str]:
    """A model worker whose connections the test can find (and end) by name, on a lease long enough that neither a
    busy machine nor the row lock the test may hold (which the lease renewer skips) costs it the lease."""
    return {"DJANGO_DB_APPLICATION_NAME": application_name, "DURABLE_LEASE_SECONDS": str(PATIENT_LEASE)}


def asks_for(tag: str, turn: int = 0):
    return lambda r: r.turn == turn and f" {tag}:" in f" {flows.first_user_text(r)}"


def test_journal__an_answer_whose_pooled_connection_died_is_journaled_on_a_fresh_one_and_not_asked_again(
    fake, routed, start_worker
):
    """The step gives its pooled connection back while the model thinks, and the server ends it meanwhile (a
    restart, a failover, an idle timeout: here pg_terminate_backend). psycopg_pool hands idle connections out
    untested ("the application might be served a connection in broken state": psycopg 3 docs, Connection pools >
    Connection quality), so the journal's write meets a dead connection. The answer was billed: it must be written
    once more on a fresh connection, not given up and asked again (48 extra asks for 120 turns in a fault test)."""
    name = f"journal-{uuid.uuid4().hex[:8]}"
    default_worker(start_worker, fake)
    model_worker(start_worker, fake, db_pool=2, **journal_env(name))
    ended: list[int] = []
    first_ask = asks_for("K")

    def answer(request):
        if first_ask(request) and not ended:
            ended.append(end_backends(name))  # before the answer leaves: the worker meets dead connections only
        return flows.answer(request)

    fake.responder = answer
    run = api.start(flows.ATTACK_CONVERSATION, {"mode": "fast", "tag": "K", "order_id": "K-1"})
    wait_for_run(run.id, "completed", timeout=120)

    assert ended and ended[0] >= 1, f"no connection of the model worker was ended ({ended}): nothing was tested"
    asked = requests_of(fake, "K", 0)
    unjournaled = list(Event.objects.filter(run_id=run.id, kind="unjournaled_usage").values_list("detail", flat=True))
    assert asked == 1 and not unjournaled, (
        f"turn 0 was asked {asked} times ({unjournaled} not journaled): the journal gave a billed answer up on a dead "
        "pooled connection instead of writing it again on a fresh one"
    )
    assert counted(run) == billed(fake), "the run's counters must equal what the API billed"


def test_journal__an_answer_its_retry_could_not_journal_either_is_counted_in_the_runs_cost_and_budget(
    fake, routed, start_worker
):
    """The answer's pooled connection is dead, and so is the fresh one its retry takes (the test holds the run's row
    lock, so the retry waits where the test sees it, and ends it). The answer is lost — asked again on the step's
    retry, as it must be — but it was billed: its usage is recorded as unjournaled, on a connection of its own, and
    the run's cost and its budget include it."""
    name = f"journal-{uuid.uuid4().hex[:8]}"
    default_worker(start_worker, fake)
    model_worker(start_worker, fake, db_pool=2, **journal_env(name))
    fake.hold(when=asks_for("L"))
    run = api.start(flows.ATTACK_CONVERSATION, {"mode": "fast", "tag": "L", "order_id": "L-1"})
    assert fake.wait_in_flight(1, timeout=60), "the first model call never arrived"

    retries_ended = 0
    with admin_connection() as lock, admin_connection(autocommit=True) as admin:
        lock.execute("SELECT 1 FROM durable_agents_run WHERE id = %s FOR UPDATE", [run.id])
        assert end_backends(name, admin) >= 1, "the model worker held no pooled connection to end"
        fake.release()  # the first write meets a dead connection
        while True:
            waiting = wait_for(
                lambda: spend_writes_waiting(admin, name),
                timeout=60,
                what="a write of the billed answer to wait for the run's row lock",
            )
            if "lease_token" not in waiting:
                break  # not a journal write (fenced by the lease token): the count of the unjournaled usage
            assert retries_ended == 0, (
                "the journal wrote the answer a third time: once, then once on a fresh connection"
            )
            end_backends(name, admin)
            retries_ended += 1
        lock.commit()
    wait_for_run(run.id, "completed", timeout=120)

    assert retries_ended == 1, "a write that failed on a dead connection must be tried once more on a fresh one"
    events = list(Event.objects.filter(run_id=run.id, kind="unjournaled_usage"))
    assert len(events) == 1 and events[0].detail["reason"].startswith("the database did not take the journal"), [
        e.detail for e in events
    ]
    assert counted(run) == billed(fake), (
        "the run's counters must equal what the API billed: the answer lost with its connections was billed"
    )
    turns = Turn.objects.filter(run_id=run.id)
    assert turns.count() == 1 and requests_of(fake, "L", 0) == 2, "the lost answer is asked again, once"
    journaled_cost = turns.aggregate(total=Sum("cost_usd"))["total"]
    assert run.cost_usd == journaled_cost + Decimal(events[0].detail["cost_usd"]) > journaled_cost
    assert Budget.of(run).spend().tokens == sum(billed(fake).values()), "the budget reads every billed token"


@pytest.mark.parametrize("connection_ended", [False, True], ids=["connection-alive", "connection-ended"])
def test_zombie__a_holder_taken_over_while_its_model_call_was_in_flight_records_the_billed_usage(
    fake, routed, start_worker, connection_ended
):
    """Another worker takes the run over while the holder waits on the model (here: this test claims it, on an
    engine clock moved past the lease). The holder's answer arrives; it may not journal the turn, but it was billed:
    its usage is recorded as unjournaled usage — also when its pooled connection died meanwhile, the way a thawed
    zombie's may have."""
    name = f"journal-{uuid.uuid4().hex[:8]}"
    default_worker(start_worker, fake)
    model_worker(start_worker, fake, db_pool=2, **journal_env(name))
    fake.hold(when=asks_for("Z"))
    run = api.start(flows.ATTACK_CONVERSATION, {"mode": "fast", "tag": "Z", "order_id": "Z-1"})
    assert fake.wait_in_flight(1, timeout=60), "the model call never arrived"

    clock.advance(timedelta(hours=1))  # past any lease the holder's heartbeat renewed
    assert transitions.claim_run(run.id) is not None, "the test could not take the run over"
    if connection_ended:
        assert end_backends(name) >= 1, "the model worker held no pooled connection to end"
    fake.release()
    event = wait_for(
        lambda: Event.objects.filter(run_id=run.id, kind="unjournaled_usage").first(),
        timeout=60,
        what="the zombie's billed answer to be recorded as unjournaled usage",
    )

    assert event.detail["reason"] == "lease lost", event.detail
    assert not Turn.objects.filter(run_id=run.id).exists(), "a zombie journaled its answer"
    assert counted(run) == billed(fake) and event.detail["tokens"] == sum(billed(fake).values())
