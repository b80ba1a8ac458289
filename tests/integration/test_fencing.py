"""One writer per run, on the database's clock: zombies, skewed clocks, unrecordable outcomes, backoffs, forks
(issue 13, items 7, 8, 9, 10, 13, 16, 20)."""

from __future__ import annotations

import threading
from datetime import timedelta
from unittest import mock

import pytest
from django.db import DataError, connections, transaction
from django.db.models import F
from django.utils import timezone

from durable_agents import api, clock
from durable_agents.agents.loop import run_agent
from durable_agents.agents.participants import FunctionParticipant, participants, tool_use
from durable_agents.engine import transitions
from durable_agents.engine.advance import Outcome, advance
from durable_agents.engine.context import StepContext
from durable_agents.engine.lease import Heartbeat, lease_seconds, renew_leases
from durable_agents.errors import LeaseLostError, RetryableError
from durable_agents.models import Effect, EffectStatus, Event, Run, RunStatus, Step, StepStatus, Turn
from durable_agents.testing import drive
from durable_agents.testing.receiver import IdempotentReceiver
from durable_agents.testing.runs import take_lease
from durable_agents.workflows import registry
from tests.testapp.models import Execution, LedgerEntry
from tests.testapp.trust import FRAGILE, HOOKS, LONG_STEP, LONG_TOOL

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _clean():
    HOOKS.clear()
    FRAGILE["refuse"] = False
    yield
    HOOKS.clear()
    FRAGILE["refuse"] = False
    clock.reset()


def _take_over(run_id) -> None:
    """Another worker takes the run over: the holder's lease expired, the sweep re-woke it, a claim won."""
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(minutes=1))
    assert take_lease(run_id) is not None


# --- Item 7: a zombie never calls an external tool after losing its lease ---------------------------------


def test_effects__a_zombie_never_calls_an_external_tool_after_losing_its_lease():
    with IdempotentReceiver() as carrier:
        run = api.start("ship_then_hold", {"order_id": "F-1", "url": carrier.url})
        HOOKS["before_ship"] = lambda ctx: _take_over(ctx.run_id)  # paused here; meanwhile the run moved on
        assert advance(run.id) is Outcome.LEASE_LOST
        assert carrier.requests == [], "a zombie called the carrier after its lease was taken over"
    assert not Effect.objects.filter(run=run, attempts__gt=0).exists()
    assert Event.objects.filter(run=run, kind="zombie_commit_rejected").count() == 1
    assert not Step.objects.filter(run=run, status=StepStatus.FAILED).exists(), "a lost lease is never a failure"


# --- Item 8: no exception path leaves a lease held -------------------------------------------------------


def test_advance__an_outcome_the_database_refuses_fails_the_step_and_releases_the_lease():
    run = api.start("record", {"steps": 2})
    refused = DataError("unsupported Unicode escape sequence")
    with mock.patch.object(transitions, "checkpoint", side_effect=refused):
        assert advance(run.id) is Outcome.FAILED
    run = Run.objects.get(pk=run.id)
    assert run.status == RunStatus.FAILED and run.lease_expires_at is None and run.lease_owner == "", (
        "the lease stayed held: the step would re-run on every expiry"
    )
    assert "could not be recorded" in run.error["message"] and "DataError" in run.error["message"]
    assert "in _commit" in run.error["traceback"], "the refused write's traceback is kept to find the bug by"
    assert Execution.objects.filter(run_id=run.id).count() == 1


def test_advance__an_error_message_postgres_cannot_store_is_still_recorded():
    run = api.start("record", {"steps": 1})
    with mock.patch.object(transitions, "checkpoint", side_effect=ValueError("bad \x00 byte \ud800")):
        assert advance(run.id) is Outcome.FAILED
    error = Run.objects.get(pk=run.id).error
    assert "bad \\u0000 byte" in error["message"] and "bad \\u0000 byte \\ud800" in error["traceback"], error


# --- Item 9: leases, wake-ups and deadlines on the database's clock ---------------------------------------


def test_lease__a_worker_whose_clock_runs_ahead_does_not_take_a_live_lease():
    run = api.start("record", {"steps": 1})
    holder = take_lease(run.id)
    ahead = timezone.now() + timedelta(seconds=20)
    with mock.patch("django.utils.timezone.now", return_value=ahead):
        assert advance(run.id) is Outcome.SKIPPED, "a clock 20 s ahead took over a live lease"
    assert Run.objects.get(pk=run.id).lease_token == holder.token


def test_lease__expiry_renewal_and_wake_up_are_written_in_the_databases_time():
    run = api.start("record", {"steps": 1})
    before = clock.now()
    with mock.patch("django.utils.timezone.now", return_value=timezone.now() + timedelta(hours=3)):
        claim = take_lease(run.id)
    after = clock.now()
    expires = Run.objects.get(pk=run.id).lease_expires_at
    lease = timedelta(seconds=lease_seconds())
    assert before + lease - timedelta(seconds=1) <= expires <= after + lease + timedelta(seconds=1), (
        f"the lease expiry {expires} was computed from a worker's clock, not the database's ({before})"
    )
    assert claim.claimed_at is not None and abs((claim.claimed_at - before).total_seconds()) < 5


# --- Item 10: a zombie never re-asks a compaction ----------------------------------------------------------


def test_compaction__a_zombie_proves_its_lease_before_asking_for_a_summary():
    asked = {"compactions": 0}

    def summarize(request):
        asked["compactions"] += 1
        if asked["compactions"] == 1:
            raise RetryableError("the first summary request timed out")
        return "summary"

    def script(request):
        done = len(request.tool_results) and int(request.turn)
        return [tool_use("tick", {"n": done + 1})]

    participants.register("ticker-zombie", FunctionParticipant(script, name="ticker-zombie", summarize=summarize))
    run = api.start("agent_ticks", {"ticks": 500})
    api.swap_participant(run.id, "ticker-zombie")
    for _ in range(200):
        if asked["compactions"]:
            break
        advance(run.id)
        Run.objects.filter(pk=run.id).update(wake_at=None)
    assert asked["compactions"] == 1, "the ticker should have reached its first compaction"

    zombie = take_lease(run.id)
    _take_over(run.id)  # the zombie paused; another worker took the run over
    step = Step.objects.select_related("run").get(run=run, step_id="ticker")
    spec = registry.get("agent_ticks").definition("ticker").options["agent"]
    with pytest.raises(LeaseLostError):
        run_agent(StepContext(step.run, step, zombie.attempt, Heartbeat(zombie)), spec)
    assert asked["compactions"] == 1, "a zombie asked for the largest prompt there is again"


# --- Item 13: a fork at a failed effect step is fenced against the fork ------------------------------------


def test_fork__at_a_failed_effect_step_applies_it_under_the_forks_lease():
    FRAGILE["refuse"] = True
    source = drive(api.start("fragile", {"order_id": "F-13"}).id)
    assert source.status == RunStatus.FAILED
    FRAGILE["refuse"] = False
    fork = drive(api.fork(source.id, "charge", actor="ops").id)
    assert fork.status == RunStatus.COMPLETED, f"the fork failed: {fork.error}"
    assert list(LedgerEntry.objects.filter(order_id="F-13").values_list("amount", flat=True)) == [15]
    assert not Event.objects.filter(run=fork, kind="failed").exists()


def test_advance__a_lost_lease_raised_by_a_step_is_never_recorded_as_its_failure():
    run = api.start("ship_then_hold", {"order_id": "F-14", "url": "http://127.0.0.1:9"})

    def lost(ctx):
        raise LeaseLostError("taken over")

    HOOKS["before_ship"] = lost
    assert advance(run.id) is Outcome.LEASE_LOST
    assert (
        Run.objects.get(pk=run.id).status == RunStatus.RUNNING
        and not Step.objects.filter(run=run, status=StepStatus.FAILED).exists()
    )


# --- Item 16: retry-after is bounded, and resume clears a backoff ------------------------------------------


@pytest.mark.parametrize("retry_after", ["1e400", "nan", "-5", "21600"])
def test_retry__a_services_retry_after_is_bounded(retry_after):
    run = api.start("throttled", {"retry_after": retry_after})
    assert advance(run.id) is Outcome.RETRY
    run = Run.objects.get(pk=run.id)
    cap = timedelta(seconds=600)
    assert run.lease_expires_at is None, "the retry must release the lease"
    assert run.wake_at <= clock.now() + cap, f"retry-after {retry_after} parked the run until {run.wake_at}"


def test_resume__wakes_a_run_now_clearing_a_long_backoff():
    run = api.start("throttled", {"retry_after": "21600"})
    assert advance(run.id) is Outcome.RETRY
    assert advance(run.id) is Outcome.SKIPPED  # not due yet
    api.resume(run.id, actor="ops")
    assert Run.objects.get(pk=run.id).wake_at is None
    assert advance(run.id) is Outcome.COMPLETED, "resume recorded a wake-up the advance then skipped"


# --- Item 20: suspects, confirmed and closed ---------------------------------------------------------------


def test_agent__a_zombie_never_writes_a_turns_tool_results():
    run = api.start("peeker", {})
    HOOKS["in_peek"] = lambda ctx: _take_over(ctx.run_id)
    assert advance(run.id) is Outcome.LEASE_LOST
    turn = Turn.objects.get(run=run, index=0)
    assert turn.tool_results is None, "a zombie wrote the tool results the live worker will journal"


def test_agent__a_judge_redo_gets_new_tool_use_ids_from_a_scripted_participant():
    run = drive(api.start("redo_charge", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    charges = sorted(LedgerEntry.objects.filter(order_id="J-1").values_list("amount", flat=True))
    assert charges == [10, 20], f"the redo's charge collided with the first one's key: {charges}"
    ids = [b["id"] for t in Turn.objects.filter(run=run) for b in t.content if b.get("type") == "tool_use"]
    writer_ids = [i for i in ids if i.startswith("toolu_")]
    assert len(set(writer_ids)) == len(writer_ids), writer_ids


def test_effects__keys_longer_than_their_column_are_shortened_deterministically():
    run = drive(api.start("long_keys", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    effect = Effect.objects.get(run=run)
    assert effect.status == EffectStatus.APPLIED and len(effect.idempotency_key) <= 255
    full = f"{run.id}:{LONG_STEP}:{LONG_TOOL}:1"
    assert len(full) > 300 and effect.idempotency_key.startswith(full[:180])


def test_lease__one_locked_row_does_not_delay_the_other_renewals():
    blocked, free = api.start("noop", {"steps": 1}), api.start("noop", {"steps": 1})
    claims = [take_lease(blocked.id), take_lease(free.id)]
    locked, release = threading.Event(), threading.Event()

    def hold_row_lock():
        try:
            with transaction.atomic():
                Run.objects.select_for_update().get(pk=blocked.id)
                locked.set()
                release.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold_row_lock)
    holder.start()
    try:
        assert locked.wait(10)
        result: dict[str, object] = {}
        renewer = threading.Thread(target=lambda: result.update(done=renew_leases(claims)))
        renewer.start()
        renewer.join(10)
        assert not renewer.is_alive(), "a renewal waited on another transaction's row lock"
        renewed, lost = result["done"]  # type: ignore[misc]
        assert claims[1] in renewed and claims[0] not in renewed and claims[0] not in lost
    finally:
        release.set()
        holder.join()
    renewed, lost = renew_leases(claims)
    assert renewed == set(claims) and not lost


def test_lease__a_taken_over_lease_is_reported_lost_by_the_batched_renewal():
    run = api.start("noop", {"steps": 1})
    claim = take_lease(run.id)
    Run.objects.filter(pk=run.id).update(lease_token=F("lease_token") + 1)
    renewed, lost = renew_leases([claim])
    assert lost == {claim} and not renewed


def test_agent__a_worker_paused_while_its_prompt_is_counted_proves_its_lease_before_asking(settings):
    """COUNT_TOKENS: a step's first request is counted by the API (messages.count_tokens, a round trip of its own)
    for the budget check. A worker paused in that round trip, its run taken over meanwhile, must stop at the lease's
    proof before the model is asked: the proof comes after everything but the call (DESIGN §2.3: only a pause
    between the proof and the send may repeat a request)."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "COUNT_TOKENS": True}
    asked = {"turns": 0}

    def script(request):
        asked["turns"] += 1
        return "done"

    def count_tokens(request):
        _take_over(run.id)  # the worker paused in the count; another worker took the run over
        return 100

    counted = FunctionParticipant(script, name="counted-zombie")
    counted.count_tokens = count_tokens
    participants.register("counted-zombie", counted)
    run = api.start("agent_ticks", {"ticks": 1})
    api.swap_participant(run.id, "counted-zombie")
    assert advance(run.id) is Outcome.LEASE_LOST
    assert asked["turns"] == 0, "a worker whose run was taken over while its prompt was counted asked the model"
