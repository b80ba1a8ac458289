"""Conversations at scale on the model worker: gevent (or threads) on its own queue, a small connection pool.

200 conversations (bench/scale_agent.py: a tool call, then an answer) through the real SDK against the fake
Messages API, on one `--pool gevent` worker (the Procfile's; `--pool threads` too) that consumes only the model
queue and holds at most 8 Postgres connections. The fake holds the model's answers until all 200 are waiting at
once: a worker that kept a connection (or a process) per conversation could not get there. Nothing here measures
time; bench/agent_scale.py does, at 1,000.
"""

from __future__ import annotations

import json
import time

import pytest
import redis
from django.conf import settings
from django.db import connection

import tests.model_worker_flows as flows
from bench.scale_agent import WORKFLOW, answer, applied
from durable_agents import api
from durable_agents.models import Effect, EffectStatus, Run, RunStatus, Turn
from durable_agents.testing import wait_for
from durable_agents.testing.fake_anthropic import FakeAnthropic
from tests.integration.conftest import MODEL_QUEUE, ROUTED

pytestmark = pytest.mark.django_db(transaction=True)

CONVERSATIONS = 200
POOL = 8
MODEL_WORKER = "model_worker"


@pytest.fixture
def fake():
    with FakeAnthropic(responder=answer) as server:
        yield server


@pytest.fixture
def start_model_worker(start_worker, fake, broker_url):
    redis.Redis.from_url(broker_url).delete("bench_scale:applied")

    def start(pool="gevent"):
        return start_worker(
            pool=pool,
            concurrency=CONVERSATIONS + 20,
            env={
                **fake.environ(),
                "DJANGO_DB_POOL": str(POOL),
                "DJANGO_DB_APPLICATION_NAME": MODEL_WORKER,
                "DURABLE_TEST_SETTINGS": json.dumps(ROUTED),
            },
            extra_args=["--queues", MODEL_QUEUE, "--include", "bench.scale_agent"],
        )

    return start


def start_sweeper(start_worker, fake):
    """A worker on the default queue only, with beat: the sweep, and any step that is not model-bound."""
    return start_worker(
        beat=True,
        env={**fake.environ(), "DURABLE_TEST_SETTINGS": json.dumps(ROUTED)},
        extra_args=["--include", "bench.scale_agent"],
    )


def worker_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
            [MODEL_WORKER],
        )
        return cursor.fetchone()[0]


def start_conversations(n: int) -> list[str]:
    return [str(api.start(WORKFLOW, {"order_id": f"A-{i}"}).id) for i in range(n)]


def wait_all_completed(ids: list[str], timeout: float) -> None:
    wait_for(
        lambda: Run.objects.filter(pk__in=ids, status__in=("completed", "failed", "cancelled")).count() == len(ids),
        timeout=timeout,
        interval=0.2,
        what=f"{len(ids)} conversations to finish",
    )
    failed = list(Run.objects.filter(pk__in=ids).exclude(status=RunStatus.COMPLETED).values_list("id", "error"))
    assert not failed, f"{len(failed)} conversations did not complete, e.g. {failed[:3]}"


@pytest.mark.parametrize("pool", ["gevent", "threads"])
def test_scale__200_conversations_wait_on_the_model_at_once_with_8_connections(pool, fake, routed, start_model_worker):
    start_model_worker(pool)
    fake.hold()  # every answer waits until all 200 conversations are asking at once
    ids = start_conversations(CONVERSATIONS)

    reached = fake.wait_in_flight(CONVERSATIONS, timeout=180)
    peak_connections = worker_connections()
    fake.release()
    assert reached, (
        f"only {fake.in_flight} of {CONVERSATIONS} conversations waited on the model at once: steps hold their "
        f"database connection (pool of {POOL}) or a worker slot while the model thinks"
    )
    assert peak_connections <= POOL, f"the model worker held {peak_connections} connections (pool {POOL})"

    wait_all_completed(ids, timeout=180)
    requests = fake.requests
    conversations = {r.conversation for r in requests}
    assert len(conversations) == CONVERSATIONS and len(requests) == 2 * CONVERSATIONS, (
        f"{len(requests)} model requests for {CONVERSATIONS} conversations of 2 calls: a call was asked twice"
    )
    assert Turn.objects.filter(run_id__in=ids).count() == 2 * CONVERSATIONS
    assert sorted(set(applied().values())) == [1] and len(applied()) == CONVERSATIONS, "each effect applied once"


def test_scale__model_bound_steps_are_sent_to_the_model_queue_and_others_to_the_default(
    fake, routed, broker_url, start_worker, start_model_worker
):
    """An agent step's wake-up goes to the model queue, a plain step's to the default queue; a model worker
    started later takes the conversations waiting there."""
    broker = redis.Redis.from_url(broker_url)
    ids = start_conversations(20)
    plain = api.start("record", {})
    assert broker.llen(MODEL_QUEUE) == 20, "each conversation's wake-up waits on the model queue"
    assert broker.llen("celery") == 1, "a step that does not wait on the model stays on the default queue"
    start_model_worker()
    wait_all_completed(ids, timeout=120)
    assert Run.objects.get(pk=plain.id).status == RunStatus.PENDING, "the model worker took a plain step"


@pytest.mark.slow
def test_scale__sigkill_with_200_conversations_in_flight_loses_nothing_and_repeats_nothing(
    fake, routed, start_worker, start_model_worker
):
    """SIGKILL the model worker while 200 conversations wait on their second model call. After the takeover
    every run completes, no journaled turn is asked again, and no effect is applied twice."""
    start_sweeper(start_worker, fake)
    model_worker = start_model_worker()
    fake.hold(when=lambda request: request.turn >= 1)  # first turns answered (journaled, effect applied)
    ids = start_conversations(CONVERSATIONS)
    first_turns = Turn.objects.filter(run_id__in=ids)
    wait_for(lambda: first_turns.count() == CONVERSATIONS, timeout=180, what="every first turn journaled")
    # Every first call has been answered (its turn is journaled): what is in flight now are second calls.
    assert fake.wait_in_flight(CONVERSATIONS, timeout=180), f"only {fake.in_flight} second calls in flight"

    model_worker.kill()
    killed_at = time.monotonic()
    fake.release()  # the held answers go to a dead process: never read, never journaled
    start_model_worker()
    wait_all_completed(ids, timeout=300)
    print(
        f"\nSIGKILL with {CONVERSATIONS} conversations in flight: all completed {time.monotonic() - killed_at:.1f} s "
        f"after the kill (lease {settings.DURABLE_AGENTS['LEASE_SECONDS']} s)"
    )

    late = flows.asked_after_journaled(fake.requests, ids)
    assert not late, f"journaled turns asked again: {late}"
    effects = Effect.objects.filter(run_id__in=ids, tool="look_up_order")
    assert effects.count() == CONVERSATIONS and not effects.exclude(status=EffectStatus.APPLIED).exists()
    counts = applied()
    assert len(counts) == CONVERSATIONS and set(counts.values()) == {1}, (
        f"effects applied more than once: {[k for k, n in counts.items() if n > 1][:3]}"
    )
