"""Every answer the model API billed is journaled or at least counted in the run's cost and budget, whatever
happened to the model worker's connection: the pool exhausted, the pooled connection dead, the retry failing too,
or the holder taken over while its call was in flight.

Each test asserts a guarantee (DESIGN.md §2, docs/howto/workers.md) of the model worker's runtime (gevent pool, Django's
psycopg pool, release_connection, queue routing). Nothing here waits on timing it does not control except bounded
observation windows (a lease lost or not within N leases), which never make a correct engine fail.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from datetime import timedelta
from decimal import Decimal

import anthropic
import psycopg
import psycopg_pool
import pytest
from django.db import connection
from django.db.models import Sum

import tests.model_worker_flows as flows
from durable_agents import api, clock
from durable_agents.agents.budget import Budget
from durable_agents.agents.claude import AnthropicParticipant
from durable_agents.agents.participants import participants
from durable_agents.engine import transitions
from durable_agents.models import Event, Run, RunStatus, Turn
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.fake_anthropic import FakeAnthropic
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
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            [application_name],
        ).fetchall()
    return sum(1 for (ok,) in ended if ok)


def spend_writes_waiting(admin: psycopg.Connection, application_name: str) -> str:
    """The statement of `application_name` that adds to a run's spend (`cost_usd`) while it waits for a row lock;
    "" if none does."""
    row = admin.execute(
        "SELECT query FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s "
        "AND wait_event_type = 'Lock' "
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


# -- a connection given back while the model thinks may not come back: the answer is lost --------------------


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
        run = api.start(flows.GATED_CONVERSATION, {"mode": "fast", "tag": "P", "order_id": "P-1"})
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


# -- a billed answer whose connection died is journaled on a fresh one, or counted -------------------------------


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
    run = api.start(flows.GATED_CONVERSATION, {"mode": "fast", "tag": "K", "order_id": "K-1"})
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
    run = api.start(flows.GATED_CONVERSATION, {"mode": "fast", "tag": "L", "order_id": "L-1"})
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
    run = api.start(flows.GATED_CONVERSATION, {"mode": "fast", "tag": "Z", "order_id": "Z-1"})
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
