"""Run transitions and the step protocol, driven in-process on Postgres (no worker needed)."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext, override_settings

from durable_agents import api, clock
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.sweep import sweep
from durable_agents.errors import InvalidInputError, ModelUnavailableError
from durable_agents.models import Event, Run, RunStatus, Step
from durable_agents.testing import drive
from durable_agents.testing.runs import take_lease as claim_run
from durable_agents.workflows import PlannedStep, call, workflow
from tests.testapp.models import Execution

pytestmark = pytest.mark.django_db


def test_start__writes_the_run_and_its_plan():
    run = api.start("noop", {"steps": 3})
    assert run.status == RunStatus.PENDING and run.step_count == 3
    assert list(Step.objects.filter(run=run).values_list("step_id", "position", "status")) == [
        ("tick-1", 0, "pending"),
        ("tick-2", 1, "pending"),
        ("tick-3", 2, "pending"),
    ]


def test_start__same_key_returns_the_first_run():
    first = api.start("noop", {"steps": 2}, idempotency_key="order-42")
    again = api.start("noop", {"steps": 2}, idempotency_key="order-42")
    assert again.id == first.id and Run.objects.count() == 1


def test_start__same_key_with_other_input_is_an_error():
    api.start("noop", {"steps": 2}, idempotency_key="order-42")
    with pytest.raises(api.IdempotencyKeyReusedError, match="different input; use a new key"):
        api.start("noop", {"steps": 3}, idempotency_key="order-42")
    assert Run.objects.count() == 1


@override_settings(DURABLE_AGENTS={"INPUT_MAX_BYTES": 100})
def test_start__oversized_input_is_refused_and_nothing_is_written():
    with pytest.raises(api.InputTooLargeError, match="over the 100-byte limit"):
        api.start("noop", {"steps": 1, "pad": "x" * 200})
    assert not Run.objects.exists()


@pytest.mark.parametrize(
    ("workflow", "run_input", "error"),
    [
        ("nope", {}, api.UnknownWorkflowError),
        ("noop", {"steps": "three"}, api.InvalidInputError),
        ("noop", {"steps": object()}, api.InvalidInputError),
    ],
)
def test_start__bad_input_is_a_domain_error(workflow, run_input, error):
    with pytest.raises(error):
        api.start(workflow, run_input)
    assert not Run.objects.exists()


@pytest.mark.django_db(transaction=True)  # autocommit: inside a caller's transaction the insert has a savepoint
def test_start__is_one_statement_keyed_or_not_and_a_one_step_run_two_more():
    with CaptureQueriesContext(connection) as started:
        run = api.start("noop", {"steps": 1})
    with CaptureQueriesContext(connection) as keyed:
        api.start("noop", {"steps": 1}, idempotency_key="order-7")
    with CaptureQueriesContext(connection) as again:
        assert api.start("noop", {"steps": 1}, idempotency_key="order-7").idempotency_key == "order-7"
    with CaptureQueriesContext(connection) as executed:
        assert advance(run.id) is Outcome.COMPLETED
    # The run and its plan in one statement (in this test's transaction: no savepoint), its key settled by it.
    assert [len(q.captured_queries) for q in (started, keyed, again, executed)] == [1, 1, 1, 2]
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and Step.objects.get(run=run).status == "done"
    assert run.created_at is not None


def test_start__the_returned_run_is_as_stored():
    run = api.start("noop", {"steps": 2}, idempotency_key="order-8")
    stored = Run.objects.get(pk=run.id)
    fields = [f.attname for f in Run._meta.concrete_fields]
    assert {f: getattr(run, f) for f in fields} == {f: getattr(stored, f) for f in fields}
    assert Step.objects.filter(run=run).count() == 2


def test_advance__runs_one_step_per_call_and_completes():
    run = api.start("noop", {"steps": 2})
    assert advance(run.id) is Outcome.COMMITTED
    assert Run.objects.get(pk=run.id).cursor == 1
    assert advance(run.id) is Outcome.COMPLETED
    run.refresh_from_db()
    assert run.status == RunStatus.COMPLETED and run.output == {"step": "tick-2"} and run.finished_at


def test_advance__zero_step_plan_completes():
    run = api.start("noop", {"steps": 0})
    assert drive(run.id).status == RunStatus.COMPLETED


def test_claim__a_held_lease_cannot_be_claimed_twice():
    run = api.start("noop", {"steps": 1})
    first = claim_run(run.id)
    assert first is not None and first.token == 1
    assert claim_run(run.id) is None, "a second claim while the lease is held must match 0 rows"
    assert advance(run.id) is Outcome.SKIPPED


def test_advance__a_run_missing_from_this_database_is_reported_not_silently_skipped(caplog):
    """A worker on another database than the process that started the run (a test's worker on the dev
    database, a wrong DATABASE_URL) says so in its log instead of skipping the message in silence."""
    missing = uuid.uuid4()
    with caplog.at_level(logging.WARNING, logger="durable_agents.engine"):
        assert advance(missing) is Outcome.NOT_FOUND
    assert f"run {missing} is not in this worker's database" in caplog.text
    assert connection.settings_dict["NAME"] in caplog.text, "the warning names the database the worker looked in"


def test_claim__expired_lease_is_taken_over_and_the_zombie_commit_is_rejected():
    run = api.start("record", {"steps": 1})
    zombie = claim_run(run.id)
    Run.objects.filter(pk=run.id).update(
        lease_expires_at=Run.objects.get(pk=run.id).lease_expires_at - timedelta(minutes=5)
    )
    assert advance(run.id) is Outcome.COMPLETED
    assert Event.objects.get(run=run, kind="lease_takeover").detail["previous_owner"] == zombie.owner

    from durable_agents.engine import transitions
    from durable_agents.engine.payloads import StoredResult

    step = Step.objects.get(run=run)
    late = transitions.checkpoint(zombie, step, StoredResult(inline={"late": True}), final=True)
    assert late is transitions.Committed.LOST, "a zombie's checkpoint must match 0 rows"
    assert Step.objects.get(run=run).result == {"step": "s001"}, "the zombie overwrote a committed checkpoint"


@override_settings(DURABLE_AGENTS={"MAX_CLAIMS_PER_STEP": 3})
def test_claim__a_step_that_keeps_killing_its_worker_fails_as_a_crash_loop():
    run = api.start("noop", {"steps": 1})
    for _ in range(5):  # claims whose workers "died": the lease is simply left to expire
        if claim_run(run.id) is None:
            break
        Run.objects.filter(pk=run.id).update(lease_expires_at=None)
    run = drive(run.id)
    assert run.status == RunStatus.FAILED and run.error["type"] == "StepCrashLoop"


def test_advance__loads_a_constant_number_of_rows_whatever_the_history():
    run = api.start("noop", {"steps": 60})
    for _ in range(50):
        advance(run.id)
    with CaptureQueriesContext(connection) as late:
        advance(run.id)
    short = api.start("noop", {"steps": 60})
    with CaptureQueriesContext(connection) as early:
        advance(short.id)
    assert len(late.captured_queries) == len(early.captured_queries) == 2, (
        "a step should cost one claim+load and one commit statement, at position 50 as at 0"
    )
    reads = [
        q["sql"].strip() for q in late.captured_queries if q["sql"].strip().startswith(("SELECT", "UPDATE", "WITH"))
    ]
    assert reads and all("WHERE" in sql for sql in reads), f"an unbounded read in the step loop: {reads}"


@override_settings(DURABLE_AGENTS={"RESULT_INLINE_MAX_BYTES": 1000})
def test_results__large_results_live_out_of_row_with_a_hash():
    run = drive(api.start("big", {"size": 5000}).id)
    big = Step.objects.get(run=run, step_id="big")
    assert big.result is None and big.result_ref == f"payload:{big.result_hash}" and len(big.result_hash) == 64
    assert Step.objects.get(run=run, step_id="reads_big").result == {"length": 5000}


def test_failure__non_json_result_is_a_permanent_error():
    from durable_agents.workflows import call, registry, workflow

    workflow("returns_set", steps=[call("bad", lambda ctx: {1, 2})], replace=True)
    try:
        run = drive(api.start("returns_set").id)
    finally:
        registry.unregister("returns_set")
    assert run.status == RunStatus.FAILED and run.error["type"] == "PermanentError"
    assert "not JSON-serialisable" in run.error["message"]


def test_cancel__finished_run_is_an_error():
    run = drive(api.start("noop", {"steps": 1}).id)
    with pytest.raises(api.InvalidTransitionError, match="already completed; there is nothing to cancel"):
        api.cancel(run.id)


def test_cancel__unknown_and_malformed_ids_are_not_found():
    with pytest.raises(api.RunNotFoundError):
        api.cancel("00000000-0000-0000-0000-000000000000")
    with pytest.raises(api.RunNotFoundError, match="no run has id 'not-a-uuid'"):
        api.cancel("not-a-uuid")


def test_cancel__a_cancelled_run_is_never_claimed():
    run = api.start("record", {"steps": 2})
    api.cancel(run.id, "duplicate order", actor="ops")
    assert advance(run.id) is Outcome.SKIPPED
    assert not Execution.objects.filter(run_id=run.id).exists()
    assert Event.objects.get(run=run, kind="cancelled").actor == "ops"


def test_cancel__requested_while_a_worker_holds_the_lease_settles_at_the_boundary():
    run = api.start("record", {"steps": 3})
    claim = claim_run(run.id)
    api.cancel(run.id, "stop")
    assert Run.objects.get(pk=run.id).status == RunStatus.RUNNING
    Run.objects.filter(pk=run.id, lease_token=claim.token).update(lease_owner="", lease_expires_at=None)
    assert advance(run.id) is Outcome.CANCELLED
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED


def test_cancel__a_run_whose_holder_let_its_lease_lapse_stops_at_once_and_the_late_commit_is_refused():
    run = api.start("record", {"steps": 3})
    zombie = claim_run(run.id)
    Run.objects.filter(pk=run.id).update(lease_expires_at=F("lease_expires_at") - timedelta(minutes=5))

    assert api.cancel(run.id, "stop").status == RunStatus.CANCELLED, "no live holder: nothing to wait for"

    from durable_agents.engine import transitions
    from durable_agents.engine.payloads import StoredResult

    step = Step.objects.filter(run=run).order_by("position").first()
    late = transitions.checkpoint(zombie, step, StoredResult(inline={"late": True}), final=False)
    assert late is transitions.Committed.LOST, "the paused holder's commit after the cancel must match 0 rows"
    assert Run.objects.get(pk=run.id).status == RunStatus.CANCELLED


def test_resume__completed_run_needs_a_step():
    run = drive(api.start("noop", {"steps": 1}).id)
    with pytest.raises(api.InvalidTransitionError, match="pass --from-step"):
        api.resume(run.id)


def test_resume__from_step_supersedes_later_checkpoints_and_keeps_history():
    run = drive(api.start("record", {"steps": 4}).id)
    api.resume(run.id, from_step="s003", actor="ops")
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED
    steps = list(Step.objects.filter(run=run).order_by("position", "id").values_list("step_id", "status"))
    assert steps == [
        ("s001", "done"),
        ("s002", "done"),
        ("s003", "superseded"),
        ("s003", "done"),
        ("s004", "superseded"),
        ("s004", "done"),
    ]
    event = Event.objects.get(run=run, kind="rerun_from_step")
    assert event.detail["superseded"] == ["s003", "s004"] and event.actor == "ops"
    with pytest.raises(api.StepNotFoundError):
        api.resume(run.id, from_step="s999")


def test_sweep__wakes_runs_with_expired_leases_only():
    idle = api.start("noop", {"steps": 1})
    Run.objects.filter(pk=idle.id).update(updated_at=idle.updated_at - timedelta(minutes=1))
    held = api.start("noop", {"steps": 1})
    claim_run(held.id)
    Run.objects.filter(pk=held.id).update(updated_at=held.updated_at - timedelta(minutes=1))
    fresh = api.start("noop", {"steps": 1})

    report = sweep()

    assert report.woken == 1
    assert Event.objects.filter(kind="swept").values_list("run_id", flat=True).get() == idle.id
    assert sweep().woken == 0, "a run is not re-woken again within IDLE_RESWEEP_SECONDS"
    assert fresh.id != idle.id


def test_start__a_plan_whose_arguments_postgres_refuses_is_a_clear_error_and_stores_nothing(isolated_registries):
    # The input is fine; the workflow's plan turns it into a NaN argument, which jsonb refuses (a raw DataError
    # from the insert before): a clear error naming the workflow, the step and the spot, and no run is stored.
    workflow(
        "nan_plan",
        steps=[call("s", lambda ctx: None)],
        plan=lambda inp: [PlannedStep("s", "s", {"ratio": inp["a"] / inp["b"] if inp["b"] else float("nan")})],
    )
    before = Run.objects.count()
    with pytest.raises(InvalidInputError, match=r"workflow 'nan_plan' planned step 's' .*args\[.ratio.\] is NaN"):
        api.start("nan_plan", {"a": 1, "b": 0})
    with pytest.raises(InvalidInputError, match="planned step 's' with arguments that cannot be stored"):
        workflow(
            "object_plan",
            steps=[call("s", lambda ctx: None)],
            plan=lambda inp: [PlannedStep("s", "s", {"x": object()})],
        )
        api.start("object_plan", {})
    assert Run.objects.count() == before


# --- Delays: a wait longer than MAX_COUNTDOWN_SECONDS parks the run for the sweep, with no broker countdown ---------

countdowns: list[tuple[str, float | None]] = []


def record_countdown(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    countdowns.append((str(run_id), countdown))


def _waits_for_capacity(ctx):
    if ctx.attempt == 1:
        raise ModelUnavailableError("the shared rate limit has no room", retry_after=5.0, capacity_wait=True)
    return {"ok": True}


def test_wake__a_delay_up_to_max_countdown_rides_a_countdown_and_a_longer_one_is_left_to_the_sweep(
    isolated_registries, django_capture_on_commit_callbacks
):
    # A broker countdown is held by the worker that receives it until it is due (on RabbitMQ without native delayed
    # delivery, in the worker's only prefetch slot): only a short one is sent. A longer delay, a retry's backoff or
    # the rate limiter's wait for capacity, parks the run (wake_at) and sends nothing.
    workflow("waits_for_capacity", steps=[call("ask", _waits_for_capacity)])
    recording = {**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_countdown"}  # MAX_COUNTDOWN_SECONDS: default
    short = api.start("flaky", {"failures": 1})  # backoff 0.05-0.5 s (tests/settings.py)
    long = api.start("flaky_long_backoff", {"failures": 1})  # 14-28 s
    capacity = api.start("waits_for_capacity", {})  # 5 s
    countdowns.clear()
    with override_settings(DURABLE_AGENTS=recording), django_capture_on_commit_callbacks(execute=True):
        assert [advance(run.id) for run in (short, long, capacity)] == [Outcome.RETRY] * 3

    assert [(run_id, delay is not None and 0 < delay <= 0.5) for run_id, delay in countdowns] == [(str(short.id), True)]
    for run in (long, capacity):
        run.refresh_from_db()
        assert run.wake_at is not None and run.wake_at > clock.now(), "a longer delay parks the run until it is due"


def test_sweep__wakes_a_parked_retry_when_due_though_it_woke_the_run_moments_before():
    # The sweep re-wakes a run at most once per IDLE_RESWEEP_SECONDS (a lost message's guard). A run the sweep woke
    # that failed again and was parked anew is owed a wake-up at its new wake time, not one idle period later.
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "IDLE_RESWEEP_SECONDS": 600}):
        run = api.start("flaky_long_backoff", {"failures": 2})
        assert advance(run.id) is Outcome.RETRY
        assert sweep().woken == 0, "the retry is not due yet"
        clock.advance(timedelta(seconds=30))
        assert sweep().woken == 1, "the first retry is due"
        assert advance(run.id) is Outcome.RETRY

        clock.advance(timedelta(seconds=30))

        assert sweep().woken == 1, "the second retry is due: the sweep woke the run 30 s ago, for the first"
        assert advance(run.id) is Outcome.COMMITTED
        assert drive(run.id).status == RunStatus.COMPLETED


def test_sweep__catches_up_on_every_run_parked_while_it_was_down():
    with override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "SWEEP_BATCH": 2}):
        runs = [api.start("flaky_long_backoff", {"failures": 1}) for _ in range(5)]
        assert [advance(run.id) for run in runs] == [Outcome.RETRY] * 5

        clock.advance(timedelta(hours=1))  # no sweep for an hour: every wake time passed

        assert [sweep().woken for _ in range(4)] == [2, 2, 1, 0], "a pass wakes SWEEP_BATCH, the next ones the rest"
        assert {drive(run.id).status for run in runs} == {RunStatus.COMPLETED}
