"""The shared rate limiter when the outside world misbehaves: a hostile retry-after, Redis down, Redis lost mid-call.

A 429's retry-after goes into the bucket every worker shares: it is checked and capped where it enters
(`claude.retry_after`), so no value stops every worker for good. A limiter that cannot be reached before a call is a
transient error (the step waits and retries, as for an unavailable model); one lost after the model answered must
not lose the billed answer, or the step would ask the model for the same turn again.
"""

from __future__ import annotations

import math
import socket
import subprocess
import threading
import time

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from durable_agents.agents.claude import LONGEST_RETRY_AFTER_SECONDS, retry_after
from durable_agents.agents.participants import participants
from durable_agents.errors import ModelUnavailableError
from durable_agents.testing.fake_anthropic import Fault
from tests.chaos.services import refused_port
from tests.integration.test_rate_limits import _limits_of, fake, request_for, unique_model  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("nan", None), ("1e400", None), ("-5", None), ("inf", None), ("Wed, 21 Oct 2026 07:28:00 GMT", None)],
)
def test_retry_after__a_value_that_is_not_a_finite_number_of_seconds_is_no_value(value, expected):
    assert retry_after({"retry-after": value}) is expected


def test_retry_after__a_year_is_cut_to_the_longest_hold():
    assert retry_after({"retry-after": str(365 * 86400)}) == LONGEST_RETRY_AFTER_SECONDS
    assert retry_after({"retry-after-ms": "2500"}) == 2.5


@pytest.mark.parametrize("backend_name", ["postgres"])
def test_429__a_years_retry_after_holds_the_other_workers_no_longer_than_the_cap(backend_name, fake):  # noqa: F811
    model = unique_model()
    participant = participants.get("anthropic")
    fake.enqueue(Fault.status(429, "slow down", {"retry-after": str(365 * 86400)}))
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **_limits_of(backend_name, model, 600)}):
        with pytest.raises(ModelUnavailableError):
            participant.respond(request_for(model))
        with pytest.raises(ModelUnavailableError) as other:
            participant.respond(request_for(model))
    assert math.isfinite(other.value.retry_after)
    assert other.value.retry_after <= LONGEST_RETRY_AFTER_SECONDS + 5, other.value.retry_after


def test_redis_down__before_the_call_is_a_transient_error_and_nothing_is_sent(fake):  # noqa: F811
    model = unique_model()
    participant = participants.get("anthropic")
    with (
        refused_port() as down,
        override_settings(
            DURABLE_AGENTS={**settings.DURABLE_AGENTS, **_limits_of(f"redis://127.0.0.1:{down}/0", model, 600)}
        ),
        pytest.raises(ModelUnavailableError, match="shared rate limiter .* could not be reached"),
    ):
        participant.respond(request_for(model))
    assert fake.requests == [], "nothing was sent while the limiter could not say there was room"


def test_redis_lost__during_the_call_the_billed_answer_is_kept(fake):  # noqa: F811
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        model = unique_model()
        participant = participants.get("anthropic")
        answers: list[object] = []
        fake.hold()
        limits = _limits_of(f"redis://127.0.0.1:{port}/0", model, 600)

        def call() -> None:
            with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **limits}):
                try:
                    answers.append(participant.respond(request_for(model)))
                except Exception as exc:  # noqa: BLE001 - the test reports what came out
                    answers.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        assert fake.wait_in_flight(1, timeout=60), "the call never reached the model"
        server.kill()
        server.wait(timeout=30)
        fake.release()
        caller.join(timeout=60)
    finally:
        fake.release()
        if server.poll() is None:
            server.kill()
    assert len(answers) == 1 and getattr(answers[0], "stop_reason", None) == "end_turn", (
        f"the answer was billed and must come back though the limiter was lost: {answers}"
    )
    assert len(fake.requests) == 1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_port(port: int) -> None:
    for _ in range(300):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"redis-server did not listen on {port}")


def test_postgres_limiter__the_step_holds_no_database_connection_while_claude_thinks(fake):  # noqa: F811
    model = unique_model()
    participant = participants.get("anthropic")
    limits = _limits_of("postgres", model, 600)
    seen: list[bool] = []
    fake.hold()

    def call() -> None:
        with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **limits}):
            participant.respond(request_for(model))
        seen.append(True)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert fake.wait_in_flight(1, timeout=60), "the call never reached the model"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            others = cursor.fetchone()[0]
    finally:
        fake.release()
        caller.join(timeout=60)
    assert seen == [True]
    assert others == 0, f"{others} other connection(s) open while the model thought: the reservation's was kept"


# --- The fencing window: a wait for room between the lease's last proof and the request ------------------------


def test_wait__a_worker_taken_over_while_it_waited_for_room_sends_nothing_and_gives_the_tokens_back(
    fake,  # noqa: F811
    monkeypatch,
):
    # Six requests a minute and no burst: the second call waits ten seconds for room (the sleep is skipped here; the
    # wait is the database's arithmetic, not this test's timing). Meanwhile another worker took the run over.
    from durable_agents.agents import rate_limits
    from durable_agents.errors import LeaseLostError
    from tests.integration.test_rate_limits import tats

    monkeypatch.setattr(rate_limits.time, "sleep", lambda seconds: None)
    model = unique_model()
    participant = participants.get("anthropic")
    proofs: list[str] = []

    def taken_over() -> None:
        proofs.append("proved")
        raise LeaseLostError("run taken over; this worker stops before the model call")

    limits = {**_limits_of("postgres", model, 6), "RATE_LIMIT_BURST_SECONDS": 0.0, "RATE_LIMIT_MAX_WAIT_SECONDS": 60.0}
    limits["MODEL_RATE_LIMITS"] = {model: {"requests_per_minute": 6, "output_tokens_per_minute": 6000}}
    settled = {**settings.DURABLE_AGENTS, **limits}
    with override_settings(DURABLE_AGENTS=settled), rate_limits.proving_after_waits(taken_over):
        participant.respond(request_for(model))  # room at once: no second proof
        assert proofs == []
        bucket = rate_limits.bucket_name(model, participant.client.api_key or "")
        before = tats("postgres", bucket)
        with pytest.raises(LeaseLostError):
            participant.respond(request_for(model))
    assert proofs == ["proved"], "the lease was proven again after the wait, right before the request"
    assert len(fake.requests) == 1, "the worker that lost its lease while waiting sent nothing"
    after = tats("postgres", bucket)
    assert after[2] == pytest.approx(before[2], abs=1e-6), "the unsent call's output tokens went back to the bucket"


def test_wait__a_step_proves_its_lease_again_after_a_wait_and_holds_no_connection_during_the_call():
    # journal.ask wires the proof: once before asking, and again after any wait for room.
    from durable_agents.agents import rate_limits
    from durable_agents.agents.journal import ask

    class Ctx:
        proofs = 0

        def ensure_lease(self) -> None:
            Ctx.proofs += 1
            connection.ensure_connection()  # a proof is a statement: it opens the connection

    class Waits:
        remote = True

        def respond(self, request):
            rate_limits._waited()  # as the limiter does after a wait
            return connection.connection is None  # the answer: was the connection closed during the call?

    assert ask(Ctx(), Waits(), request_for(unique_model())) is True
    assert Ctx.proofs == 2
