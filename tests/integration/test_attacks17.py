"""Attacks on what iteration 17 landed: one statement for an eager step's commit and the next claim, a run started
in one statement (with its idempotency key), a step waiting for the shared rate limit's capacity.

In-process tests use a recording WAKER; the races are made deterministic by the database itself (a second
connection blocked on the first's row lock, seen in pg_stat_activity) or by a `step_committed` receiver, which
runs right after a commit and before anything else the engine does.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, connections, transaction
from django.db.models import F
from django.test.utils import override_settings

from durable_agents import api
from durable_agents.engine import transitions
from durable_agents.engine.advance import Outcome, advance, advance_slice
from durable_agents.errors import InvalidInputError, ModelUnavailableError
from durable_agents.models import Event, Run, RunStatus, Step, StepStatus
from durable_agents.signals import step_committed
from durable_agents.testing import wait_for
from durable_agents.workflows import call, workflow

ON = {"EAGER_SLICE_MS": 600_000.0, "EAGER_MAX_STEPS": 50}
woken: list[str] = []


def record_wake(run_id: str, countdown: float | None = None, **routed: str) -> None:
    """A WAKER that only records what the engine asked for."""
    woken.append(str(run_id))


def _in_process(**changes: object):
    woken.clear()
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, "WAKER": f"{__name__}.record_wake", **changes})


def _ran(ctx) -> dict[str, Any]:
    ran.append(ctx.step.step_id)
    return {"step": ctx.step.step_id}


ran: list[str] = []


# --- one statement: commit N + claim N+1 ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_duplicate__a_delivery_right_after_the_commit_finds_the_next_step_claimed_and_runs_nothing():
    workflow("dup17", steps=[call(f"s{i}", _ran) for i in range(4)], replace=True)
    run = api.start("dup17")
    duplicates: list[Outcome] = []

    def deliver_again(run_id, **_: object) -> None:
        duplicates.append(advance(run_id))

    ran.clear()
    step_committed.connect(deliver_again, weak=False, dispatch_uid="attacks17-dup")
    try:
        with _in_process(**ON):
            assert advance_slice(run.id) == Outcome.COMPLETED
    finally:
        step_committed.disconnect(dispatch_uid="attacks17-dup")
    assert ran == ["s0", "s1", "s2", "s3"], "every step ran once, in order"
    # After s0..s2 the statement had already claimed the next step: the duplicate met a held lease.
    assert duplicates[:3] == [Outcome.SKIPPED] * 3
    assert Run.objects.get(pk=run.id).status == RunStatus.COMPLETED


def _cancels_with_compensation(ctx) -> dict[str, Any]:
    api.cancel(ctx.run.id, "undo it", compensate=True)
    return {"step": ctx.step.step_id}


def _must_not_run(ctx) -> dict[str, Any]:
    raise AssertionError("a step after a cancel request ran")


@pytest.mark.django_db(transaction=True)
def test_cancel_with_compensation_mid_step__the_statement_claims_nothing_and_the_cancel_is_settled():
    workflow("cancel17", steps=[call("a", _cancels_with_compensation), call("b", _must_not_run)], replace=True)
    run = api.start("cancel17")
    with _in_process(**ON):
        outcome = advance_slice(run.id)
    run.refresh_from_db()
    assert outcome in (Outcome.CANCELLED, Outcome.COMPENSATING)
    assert run.cursor >= 1 and not run.lease_owner and run.cancel_requested_at is None
    assert Step.objects.get(run=run, step_id="a").status == StepStatus.DONE
    assert Step.objects.get(run=run, step_id="b").status == StepStatus.PENDING


# --- the capacity wait ------------------------------------------------------------------------------------------


def _capacity(ctx) -> dict[str, Any]:
    raise ModelUnavailableError("no room", retry_after=30.0, capacity_wait=True)


def _capacity_after_cancel(ctx) -> dict[str, Any]:
    api.cancel(ctx.run.id, "stop waiting")
    raise ModelUnavailableError("no room", retry_after=30.0, capacity_wait=True)


@pytest.mark.django_db(transaction=True)
def test_capacity_wait__gives_the_attempt_back_and_never_below_zero():
    workflow("cap17", steps=[call("a", _capacity)], replace=True)
    run = api.start("cap17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.RETRY
    run.refresh_from_db()
    assert run.attempt == 0 and run.wake_at is not None and not run.lease_owner
    assert Event.objects.filter(run_id=run.id, kind="capacity_wait").count() == 1


@pytest.mark.django_db(transaction=True)
def test_capacity_wait__a_zombie_writes_nothing():
    def taken_over(ctx) -> dict[str, Any]:
        Run.objects.filter(pk=ctx.run.id).update(lease_expires_at=None)
        assert transitions.claim_run(ctx.run.id) is not None  # another worker took the run over
        raise ModelUnavailableError("no room", retry_after=30.0, capacity_wait=True)

    workflow("capzombie17", steps=[call("a", taken_over)], replace=True)
    run = api.start("capzombie17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.LEASE_LOST
    run.refresh_from_db()
    assert run.lease_owner and run.attempt == 2 and run.wake_at is None, "the holder's claim is untouched"
    assert not Event.objects.filter(run_id=run.id, kind="capacity_wait").exists()


@pytest.mark.django_db(transaction=True)
def test_capacity_wait__a_cancel_requested_while_the_step_ran_is_settled_at_once():
    workflow("capcancel17", steps=[call("a", _capacity_after_cancel)], replace=True)
    run = api.start("capcancel17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.CANCELLED
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED, "a step that ended waiting must not hold a cancel for its wait"
    assert run.cancel_requested_at is None and not run.lease_owner


# --- starting a run ---------------------------------------------------------------------------------------------


def _blocked_on_a_lock() -> bool:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0] > 0


def _race_one_key(inside_a_transaction: bool) -> tuple[list[Any], list[BaseException]]:
    """Start A inserts key K and holds its transaction open; start B (same key) blocks on the unique index; A
    commits; B's insert fails on the key: what does B answer?"""
    answers: list[Any] = []
    errors: list[BaseException] = []
    first_inserted, let_first_commit = threading.Event(), threading.Event()

    def first() -> None:
        try:
            with transaction.atomic():
                answers.append(api.start("noop", {"steps": 1}, idempotency_key="K17"))
                first_inserted.set()
                let_first_commit.wait(60)
        finally:
            connection.close()

    def second() -> None:
        try:
            if inside_a_transaction:
                with transaction.atomic():
                    answers.append(api.start("noop", {"steps": 1}, idempotency_key="K17"))
            else:
                answers.append(api.start("noop", {"steps": 1}, idempotency_key="K17"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connection.close()

    a = threading.Thread(target=first)
    a.start()
    assert first_inserted.wait(60)
    b = threading.Thread(target=second)
    b.start()
    wait_for(_blocked_on_a_lock, timeout=60)
    let_first_commit.set()
    a.join(60)
    b.join(60)
    return answers, errors


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inside_a_transaction", [False, True], ids=["autocommit", "in_atomic"])
def test_start__two_racing_starts_with_one_key_get_one_run(inside_a_transaction):
    with _in_process():
        answers, errors = _race_one_key(inside_a_transaction)
    assert errors == [], f"the losing start raised {errors!r}"
    assert len(answers) == 2 and answers[0].id == answers[1].id
    assert Run.objects.filter(idempotency_key="K17").count() == 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "bad",
    [
        {"input": {"steps": 1, "note": "a\x00b"}},
        {"input": {"steps": 1, "\x00": 1}},
        {"input": {"steps": 1, "x": float("nan")}},
        {"input": {"steps": 1, "x": "y" * 5_000_000}},
        {"input": {"steps": 1}, "idempotency_key": "k\x00"},
        {"input": {"steps": 1}, "idempotency_key": "k" * 300},
    ],
    ids=["nul_value", "nul_key", "nan", "oversized", "nul_idempotency_key", "long_idempotency_key"],
)
def test_start__invalid_input_is_a_domain_error_and_writes_nothing(bad):
    with _in_process(), pytest.raises(InvalidInputError):
        api.start("noop", bad["input"], idempotency_key=bad.get("idempotency_key"))
    assert not Run.objects.exists() and not Step.objects.exists() and woken == []


def _flaky_after_cancel(ctx) -> dict[str, Any]:
    api.cancel(ctx.run.id, "stop retrying")
    raise ConnectionError("the service hiccuped")


@pytest.mark.django_db(transaction=True)
def test_retry__a_cancel_requested_while_the_step_ran_is_settled_at_once_not_after_the_backoff():
    workflow("retrycancel17", steps=[call("a", _flaky_after_cancel)], replace=True)
    run = api.start("retrycancel17")
    with _in_process(**ON):
        assert advance(run.id) == Outcome.CANCELLED
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.cancel_requested_at is None and not run.lease_owner


@pytest.mark.django_db(transaction=True)
def test_start__a_long_plan_is_inserted_whole_past_the_statements_parameter_limit():
    steps = 70_000 // len(Step._meta.concrete_fields) + 1  # more parameters than a bound statement may carry
    with _in_process():
        run = api.start("noop", {"steps": steps})
    assert Step.objects.filter(run_id=run.id).count() == steps == Run.objects.get(pk=run.id).step_count


def _plan_grows_under_the_claim(ctx) -> dict[str, Any]:
    Run.objects.filter(pk=ctx.run.id).update(step_count=F("step_count") + 1)  # the token left as it was
    return {"step": ctx.step.step_id}


def _superseded_under_the_claim(ctx) -> dict[str, Any]:
    Step.objects.filter(pk=ctx.step.pk).update(status=StepStatus.SUPERSEDED)
    Step.objects.create(run_id=ctx.run.id, step_id="a2", name="b", kind=ctx.step.kind, position=ctx.step.position)
    return {"step": ctx.step.step_id}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("body", [_plan_grows_under_the_claim, _superseded_under_the_claim], ids=["plan", "step"])
def test_fence__a_plan_or_step_changed_under_a_matching_token_is_not_committed_or_claimed(body):
    workflow("fence17", steps=[call("a", body), call("b", _must_not_run), call("c", _must_not_run)], replace=True)
    run = api.start("fence17")
    token = Run.objects.get(pk=run.id).lease_token
    with _in_process(**ON):
        assert advance_slice(run.id) == Outcome.LEASE_LOST
    row = Run.objects.get(pk=run.id)
    assert row.cursor == 0 and row.lease_token == token + 1, "no checkpoint, no second claim"
    assert not Step.objects.filter(run_id=run.id, status=StepStatus.DONE).exists()
    assert Event.objects.filter(run_id=run.id, kind="zombie_commit_rejected").count() == 1
