"""The replay lab's guarantees under attack: every road to an effect, a wait or a signal, operator actions on replay
runs, bad and hostile input, imported datasets, and the report's arithmetic (tests/testapp workflows, in process)."""

from __future__ import annotations

import json
import threading
from decimal import Decimal

import pytest
from django.db import connection, connections

from durable_agents import api
from durable_agents.errors import DurableAgentsError, InvalidInputError
from durable_agents.models import Cohort, Effect, Replay, ReplayRun, Run, RunStatus, Wait
from durable_agents.replays import check_candidate, report
from durable_agents.testing import drive
from durable_agents.workflows import registry
from tests.integration.interleavings import until_blocked_on_a_lock
from tests.testapp.models import LedgerEntry

pytestmark = pytest.mark.django_db(transaction=True)


def replay_runs(replay: Replay) -> list[Run]:
    return list(Run.objects.filter(pk__in=ReplayRun.objects.filter(replay=replay).values("run_id")))


def recorded_charge() -> Run:
    run = drive(api.start("charge", {"order_id": "R-1"}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    return run


# ---- 1. nothing applied, by any road ----------------------------------------------------------------------------


def test_replay_of_a_call_step_that_charges_applies_nothing():
    run = recorded_charge()
    ledger, effects = LedgerEntry.objects.count(), Effect.objects.count()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    rep = api.replay_here(replay.id)
    assert rep.lanes["baseline"].agree == 1
    assert (LedgerEntry.objects.count(), Effect.objects.count()) == (ledger, effects)


def test_fork_of_a_replay_run_stays_a_replay_run_or_is_refused_and_never_charges():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    api.replay_here(replay.id)
    [replayed] = replay_runs(replay)
    ledger, effects = LedgerEntry.objects.count(), Effect.objects.count()
    try:
        fork = api.fork(replayed.id, "charge")
    except DurableAgentsError:
        return  # refused: held
    fork = drive(fork.id)
    assert (LedgerEntry.objects.count(), Effect.objects.count()) == (ledger, effects), (
        f"the fork of replay run {replayed.id} is a real run (replay_lane={fork.replay_lane!r}, "
        f"concurrency_key={fork.concurrency_key!r}) and charged the card"
    )


def test_resume_from_a_step_of_a_replay_run_applies_nothing():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    api.replay_here(replay.id)
    [replayed] = replay_runs(replay)
    ledger = LedgerEntry.objects.count()
    try:
        api.resume(replayed.id, from_step="charge")
    except DurableAgentsError:
        return
    after = drive(replayed.id)
    assert after.replay_lane == "baseline"
    assert LedgerEntry.objects.count() == ledger


def test_cancel_with_compensation_of_a_replay_run_applies_nothing():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    [replayed] = replay_runs(replay)
    ledger = LedgerEntry.objects.count()
    api.cancel(replayed.id, compensate=True)
    drive(replayed.id)
    assert LedgerEntry.objects.count() == ledger


def test_replay_of_a_fan_out_starts_no_child_runs():
    run = api.start("fan_all", {"items": [{"item": i} for i in range(2)]})
    drive(run.id)
    for child in Run.objects.filter(parent_id=run.id):
        drive(child.id)
    run = drive(run.id)
    assert run.status == RunStatus.COMPLETED, run.error
    runs_before = Run.objects.count()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    rep = api.replay_here(replay.id)
    assert Run.objects.count() == runs_before + 1, "a replay of a fan-out started real child runs"
    assert rep.lanes["baseline"].agree == 1


def test_a_replay_run_whose_workflow_version_is_gone_ends_cleanly_and_opens_no_wait(isolated_registries, caplog):
    from durable_agents.api import call, workflow  # noqa: PLC0415

    def work(ctx):
        return {"ok": True}

    workflow("vgone", steps=[call("a", work), call("b", work)], version=1)
    run = drive(api.start("vgone", {}).id)
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    [replayed] = replay_runs(replay)
    workflow("vgone", steps=[call("a", work), call("b", work)], version=2)  # on_missing_version="park"
    registry.unregister("vgone", 1)  # a deploy dropped version 1
    waits = Wait.objects.count()
    try:
        after = drive(replayed.id)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"advancing a replay run whose version is gone raised {type(exc).__name__}: {exc}")
    assert Wait.objects.count() == waits
    assert after.status in (RunStatus.FAILED, RunStatus.COMPLETED)
    errors = [r.getMessage()[:200] for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, f"ended {after.status} ({after.error}); logged as an engine error: {errors}"


# ---- 2. concurrency, retention ----------------------------------------------------------------------------------


def test_replay_runs_hold_their_own_concurrency_key_not_the_workflows():
    run = drive(api.start("keyed_inner", {"key": "cust-1"}).id)
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    [replayed] = replay_runs(replay)
    assert replayed.concurrency_key == f"durable-replay:{replay.id}"


def test_a_pruned_replay_run_is_reported_pruned_and_the_verdict_says_why():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], candidate={"instructions": "x"})
    api.replay_here(replay.id)
    baseline = Run.objects.get(pk__in=ReplayRun.objects.filter(replay=replay, lane="baseline").values("run_id"))
    Run.objects.filter(pk=baseline.pk).delete()  # what retention's prune does to a finished run
    rep = report(replay.id)
    passed, why = rep.verdict(0.5)
    assert "pruned" in why or rep.finished, f"a pruned replay run leaves the replay unfinished forever: {why!r}"


def test_a_cohort_with_replays_can_be_deleted_or_says_why():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    try:
        Cohort.objects.filter(pk=replay.cohort_id).delete()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"deleting a cohort with replays raises {type(exc).__name__}")


# ---- 4. the candidate ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "candidate",
    [
        {"effort": "bogus"},
        {"thinking": "garbage"},
        {"thinking": {"type": "enabled", "budget_tokens": -5}},
        {"model": 5},
        {"participant": "no-such-participant"},
        {"instructions": {"step": 5}},
        {"tool_descriptions": {"t": 5}},
    ],
)
def test_a_bad_candidate_is_refused_with_a_clear_error(candidate):
    try:
        check_candidate(candidate)
    except DurableAgentsError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"candidate {candidate!r}: raw {type(exc).__name__}: {exc}")
    pytest.fail(f"candidate {candidate!r} accepted")


# ---- 5. bad and hostile input -------------------------------------------------------------------------------------


def _line(**over):
    data = {"workflow": "charge", "version": 1, "input": {"order_id": "X"}, "tool_calls": []}
    data.update(over)
    return json.dumps(data)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"budget_usd": "abc"},
        {"budget_usd": float("nan")},
        {"budget_usd": "1e400"},
        {"concurrency": "many"},
        {"since": "yesterday"},
        {"sample": 0},
        {"stubs": ["issue_refund"]},
        {"runs": "not-a-list"},
        {"runs": [12]},
        {"lanes": ("observed",)},
        {"lanes": "baseline"},
        {"status": 5},
        {"workflow": ["charge"]},
        {"seed": "x", "sample": 1},
    ],
)
def test_bad_replay_arguments_raise_a_clear_error(kwargs):
    recorded_charge()
    args = {"workflow": "charge", "lanes": ("baseline",), **kwargs}
    try:
        api.replay(**args)
    except DurableAgentsError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"api.replay({kwargs!r}) raised raw {type(exc).__name__}: {exc}")
    if kwargs in ({"seed": "x", "sample": 1},):
        return
    pytest.fail(f"api.replay({kwargs!r}) accepted")


@pytest.mark.parametrize(
    "line",
    [
        "[1,2]",
        "{not json",
        _line(workflow="no-such-workflow"),
        _line(version="1"),
        _line(version=10**30),
        _line(tool_calls=[{"name": 5, "result": ""}]),
        _line(schema="other/9"),
        "x" * 2_000_000,
    ],
)
def test_bad_import_lines_raise_a_clear_error(line):
    try:
        api.import_cohort("bad", [line])
    except DurableAgentsError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"import raised raw {type(exc).__name__}: {exc}"[:300])
    pytest.fail("accepted")


@pytest.mark.parametrize(
    "line",
    [
        _line(turns="abc"),
        _line(turns=[1]),
        _line(steps=5),
        _line(steps=[1]),
        _line(verdicts=[1]),
        _line(usage="x"),
        _line(usage={"cost_usd": "abc"}),
        _line(usage={"input_tokens": "many"}),
        _line(status=5),
        _line(tool_calls=[{"name": "charge", "result": "", "input": 5}]),
        _line(input=[1, 2]),
        _line(name="x" * 10),
    ],
)
def test_an_imported_case_with_wrong_types_is_refused_at_import_or_replays_and_reports(line):
    """Either import refuses it with a clear error, or replay + report work on it without a raw exception."""
    try:
        api.import_cohort("typed", [line])
    except DurableAgentsError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"import raised raw {type(exc).__name__}: {exc}")
    try:
        replay = api.replay(cohort="typed", lanes=("baseline",))
        api.replay_here(replay.id)
        rep = report(replay.id)
        rep.as_json(0.9)
    except DurableAgentsError:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"an imported case was accepted, then replay/report raised raw {type(exc).__name__}: {exc}")


def test_replay_of_runs_naming_a_replay_run_or_an_unfinished_run_is_refused():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    [replayed] = replay_runs(replay)
    with pytest.raises(DurableAgentsError):
        api.replay(runs=[replayed.id], lanes=("baseline",))
    unfinished = api.start("charge", {"order_id": "U"})
    with pytest.raises(DurableAgentsError):
        api.replay(runs=[unfinished.id], lanes=("baseline",))


def test_two_cohorts_saved_under_one_name_at_once_give_a_clear_error():
    run = recorded_charge()
    other = connections.create_connection("default")
    outcome: dict[str, object] = {}

    def save():
        try:
            api.save_cohort("racing", runs=[run.id])
            outcome["ok"] = True
        except Exception as exc:  # noqa: BLE001
            outcome["exc"] = exc
        finally:
            connection.close()

    other.set_autocommit(False)
    with other.cursor() as cur:
        cur.execute("INSERT INTO durable_agents_cohort (name, description, created_at) VALUES ('racing', '', now())")
    thread = threading.Thread(target=save)
    thread.start()
    # The save is queued behind the uncommitted row on the unique index (not merely not started yet) before it commits.
    until_blocked_on_a_lock(thread, "durable_agents_cohort")
    other.commit()
    other.close()
    thread.join(30)
    exc = outcome.get("exc")
    assert exc is None or isinstance(exc, DurableAgentsError), f"raw {type(exc).__name__}: {exc}"


def test_sample_larger_than_the_population_takes_them_all():
    runs = [recorded_charge() for _ in range(2)]
    cohort = api.save_cohort("big-sample", workflow="charge", sample=50, seed=1)
    assert cohort.recordings.count() == len(runs)


# ---- 6. the report ---------------------------------------------------------------------------------------------


def test_wilson_interval_matches_the_textbook():
    from durable_agents.replays import wilson  # noqa: PLC0415

    low, high = wilson(8, 10)
    assert abs(low - 0.4902) < 1e-3 and abs(high - 0.9433) < 1e-3
    assert wilson(0, 0) == (None, None)
    low, high = wilson(10, 10)
    assert high == 1.0 and abs(low - 0.7225) < 1e-3


def test_a_replay_still_running_fails_the_verdict():
    run = recorded_charge()
    replay = api.replay(runs=[run.id], candidate={"instructions": "x"})
    passed, why = report(replay.id).verdict(0.0)
    assert not passed and "not finished" in why


def test_a_replay_with_only_a_baseline_lane_has_no_candidate_verdict():
    run = recorded_charge()
    rep = api.replay_here(api.replay(runs=[run.id], lanes=("baseline",)).id)
    passed, why = rep.verdict(0.0)
    assert not passed and "no candidate" in why


def test_report_of_garbage_replay_id_is_clear():
    for bad in ("nope", 5, None, "00000000-0000-0000-0000-000000000000"):
        try:
            report(bad)
        except DurableAgentsError:
            continue
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"report({bad!r}) raised raw {type(exc).__name__}")


def test_decimal_amount_in_a_recorded_call_matches_its_string():
    from durable_agents.engine.replaying import canonical  # noqa: PLC0415

    assert canonical({"amount": Decimal("35.90"), "b": 1}) == canonical({"b": 1, "amount": "35.90"})


def test_replay_runs_are_left_out_of_the_metrics_of_real_runs():
    from django.utils import timezone  # noqa: PLC0415

    from durable_agents.metrics import read_figures  # noqa: PLC0415

    run = recorded_charge()
    now = timezone.now()
    before = read_figures(now, now - timezone.timedelta(hours=1))
    api.replay_here(api.replay(runs=[run.id], lanes=("baseline",)).id)
    now = timezone.now()
    after = read_figures(now, now - timezone.timedelta(hours=1))
    assert after.by_status == before.by_status, "a replay run counts in durable_runs (real runs' metrics)"
    assert after.latency.keys() == before.latency.keys() and all(
        after.latency[k][0] == before.latency[k][0] for k in before.latency
    ), "a replay run's steps count in the step latency of real runs"


def test_durable_show_and_durable_runs_mark_a_replay_run():
    from io import StringIO  # noqa: PLC0415

    from django.core.management import call_command  # noqa: PLC0415

    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    api.replay_here(replay.id)
    [replayed] = replay_runs(replay)
    shown, listed = StringIO(), StringIO()
    call_command("durable_show", str(replayed.id), stdout=shown)
    call_command("durable_runs", "--replays", stdout=listed)
    assert "replay run" in shown.getvalue().lower() or "lane" in shown.getvalue().lower(), shown.getvalue()[:800]
    line = [ln for ln in listed.getvalue().splitlines() if str(replayed.id)[:8] in ln]
    assert line and "replay" in line[0].lower(), listed.getvalue()[:800]


def test_the_admin_run_page_marks_a_replay_run_and_offers_no_fork(admin_client):
    from django.urls import reverse  # noqa: PLC0415

    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    api.replay_here(replay.id)
    [replayed] = replay_runs(replay)
    page = admin_client.get(reverse("admin:durable_agents_run_change", args=[replayed.id]))
    assert page.status_code == 200
    import re  # noqa: PLC0415

    body = page.content.decode()
    hits = [m.group(0) for m in re.finditer(r".{60}replay.{60}", body, re.I | re.S)]
    assert any("replay run" in h.lower() or "lane" in h.lower() for h in hits), hits[:5]


def test_a_replay_run_sends_no_lifecycle_signal_a_pager_would_take_for_a_real_run():
    """signals.py's documented receiver pages on every failed run; a replay's diverging runs must not page."""
    from durable_agents.signals import run_finished, step_failed  # noqa: PLC0415

    seen: list[dict] = []

    def pager(sender, **kwargs):
        seen.append(kwargs)

    run = recorded_charge()
    run_finished.connect(pager, dispatch_uid="attack-pager")
    step_failed.connect(pager, dispatch_uid="attack-pager-step")
    try:
        replay = api.replay(runs=[run.id], lanes=("baseline",))
        # the recording is edited so the replay diverges at its second step (as a candidate's would)
        rec = replay.cohort.recordings.get()
        data = rec.data
        data["steps"] = data["steps"][:1]
        rec.data = data
        rec.save()
        api.replay_here(replay.id)
    finally:
        run_finished.disconnect(dispatch_uid="attack-pager")
        step_failed.disconnect(dispatch_uid="attack-pager-step")
    [replayed] = replay_runs(replay)
    assert replayed.status == RunStatus.FAILED
    paged = [k for k in seen if str(k.get("run_id")) == str(replayed.id) and "replay_lane" not in k]
    assert not paged, f"a replay run's failure reached run_finished/step_failed receivers unmarked: {paged}"


def test_replay_runs_waiting_for_a_worker_are_not_the_backlog_of_real_runs():
    from datetime import timedelta  # noqa: PLC0415

    from durable_agents import clock  # noqa: PLC0415
    from durable_agents.engine.admission import admit  # noqa: PLC0415
    from durable_agents.health import read_backlog, system_health  # noqa: PLC0415

    run = recorded_charge()
    replay = api.replay(runs=[run.id], lanes=("baseline",))
    admit(f"durable-replay:{replay.id}")
    clock.advance(timedelta(minutes=30))
    backlog = read_backlog(clock.now(), ask_broker=True)
    health = system_health(ask_broker=False)
    assert backlog.oldest_runnable_seconds is None, (
        f"a replay run is the oldest run waiting for a worker ({backlog.oldest_runnable_seconds:.0f}s): "
        f"health says {health.problems}"
    )
    assert health.by_status["pending"] + health.by_status.get("running", 0) == 0, (
        f"a replay run waiting counts as real work: {health.by_status}, problems {health.problems}"
    )


def test_signal_and_timer_steps_are_answered_from_the_recording_and_open_no_wait():
    from datetime import timedelta  # noqa: PLC0415

    from durable_agents import clock  # noqa: PLC0415

    signalled = drive(api.start("big_handoff", {}).id)
    assert signalled.status == RunStatus.WAITING
    api.send_signal(signalled.id, "go", {"ok": 1}, by="ops")
    signalled = drive(signalled.id)
    timed = drive(api.start("timer_flow", {}).id)
    clock.advance(timedelta(hours=2))
    from durable_agents.engine.sweep import sweep  # noqa: PLC0415

    sweep()
    timed = drive(timed.id)
    assert (signalled.status, timed.status) == (RunStatus.COMPLETED, RunStatus.COMPLETED), (
        signalled.error,
        timed.error,
    )
    waits = Wait.objects.count()
    rep = api.replay_here(api.replay(runs=[signalled.id, timed.id], lanes=("baseline",)).id)
    assert Wait.objects.count() == waits
    assert rep.lanes["baseline"].agree == 2, [
        (c.lanes["baseline"].status, c.lanes["baseline"].error) for c in rep.cases
    ]


def test_a_planned_double_charge_and_an_approved_charge_replay_charging_nothing():
    from django.core import mail  # noqa: PLC0415

    planned = drive(api.start("double_planned", {}).id)
    assert planned.status == RunStatus.COMPLETED, planned.error
    approved = drive(api.start("approve_charge", {"order_id": "AP-1"}).id)
    api.decide(Wait.objects.get(run=approved, status="open").pk, True, by="ops")
    approved = drive(approved.id)
    assert approved.status == RunStatus.COMPLETED, approved.error
    ledger, effects, waits, mails = (
        LedgerEntry.objects.count(),
        Effect.objects.count(),
        Wait.objects.count(),
        len(mail.outbox),
    )
    rep = api.replay_here(api.replay(runs=[planned.id, approved.id], lanes=("baseline",)).id)
    assert (LedgerEntry.objects.count(), Effect.objects.count(), Wait.objects.count(), len(mail.outbox)) == (
        ledger,
        effects,
        waits,
        mails,
    )
    assert rep.lanes["baseline"].agree == 2, [
        (c.lanes["baseline"].status, c.lanes["baseline"].error) for c in rep.cases
    ]


def test_a_candidate_planner_that_plans_another_amount_is_not_counted_as_agreeing():
    from durable_agents.agents.participants import (  # noqa: PLC0415
        FunctionParticipant,
        participants,
        tool_use,  # noqa: PLC0415
    )

    participants.register(
        "greedy-planner",
        FunctionParticipant(
            lambda request: [
                tool_use(
                    "submit_plan", {"steps": [{"tool": "charge", "args": {"order_id": "DB-1", "amount": "500.00"}}] * 2}
                )
            ],
            name="greedy-planner",
        ),
    )
    try:
        planned = drive(api.start("double_planned", {}).id)
        rep = api.replay_here(
            api.replay(runs=[planned.id], lanes=("candidate",), candidate={"participant": "greedy-planner"}).id
        )
    finally:
        participants.unregister("greedy-planner")
    lane = rep.cases[0].lanes["candidate"]
    assert not lane.agrees, (
        "the candidate planned two charges of 500.00 where the recording charged 5.00 twice; the replay answered "
        f"them with the recorded results and the report counts it agreeing ({lane.status}, calls {lane.calls})"
    )


def test_a_candidate_whose_agent_answers_otherwise_shows_another_output(isolated_registries):
    """A classifier agent (no tools): the candidate answers 'fraud' for 'ok'. Agreement is about what a run did (its
    status and effectful calls); its output is compared apart, exactly, and shown per lane."""
    from durable_agents.agents.participants import FunctionParticipant, participants  # noqa: PLC0415
    from durable_agents.api import agent, workflow  # noqa: PLC0415

    participants.register("says-ok", FunctionParticipant(lambda request: "ok", name="says-ok"))
    participants.register("says-fraud", FunctionParticipant(lambda request: "fraud", name="says-fraud"))
    workflow(
        "classify",
        steps=[
            agent("verdict", instructions="Say ok or fraud.", prompt=lambda ctx: "A payment.", participant="says-ok")
        ],
    )
    run = drive(api.start("classify", {}).id)
    assert run.status == RunStatus.COMPLETED, run.error
    rep = api.replay_here(api.replay(runs=[run.id], candidate={"participant": "says-fraud"}).id)
    lane = rep.cases[0].lanes["candidate"]
    candidate_run = Run.objects.get(pk=lane.run_id)
    assert candidate_run.output != run.output, (candidate_run.output, run.output)
    assert not lane.same_output and rep.lanes["candidate"].same_output == 0
    assert rep.cases[0].lanes["baseline"].same_output and rep.lanes["baseline"].same_output == 1


def test_a_cohort_replays_after_its_source_runs_were_pruned():
    run = recorded_charge()
    api.save_cohort("kept", runs=[run.id])
    Run.objects.filter(pk=run.id).delete()  # retention pruned the source
    rep = api.replay_here(api.replay(cohort="kept", lanes=("baseline",)).id)
    assert rep.lanes["baseline"].agree == 1


@pytest.mark.parametrize(
    "candidate",
    [{"instructions": {"no_such_step": "Be brief."}}, {"tool_descriptions": {"no_such_tool": "Charges a card."}}],
)
def test_a_candidate_that_names_no_step_or_tool_of_the_workflow_is_refused(candidate):
    """A typo in the step or tool name makes the candidate the baseline: it would pass CI changing nothing."""
    run = recorded_charge()
    with pytest.raises(DurableAgentsError):
        api.replay(runs=[run.id], candidate=candidate)


def test_a_concurrency_of_zero_is_refused_not_taken_for_the_default():
    run = recorded_charge()
    with pytest.raises(DurableAgentsError):
        replay = api.replay(runs=[run.id], lanes=("baseline",), concurrency=0)
        pytest.fail(f"concurrency=0 became {replay_runs(replay)[0].concurrency_limit}")


def test_a_cancelled_recording_is_replayed_only_when_asked_for_by_status():
    """A cancelled run stopped where someone stopped it: its baseline would read as the model's noise."""
    run = api.start("charge", {"order_id": "C-1"})
    api.cancel(run.id)
    run = drive(run.id)
    assert run.status == RunStatus.CANCELLED
    with pytest.raises(InvalidInputError, match="cancelled one only with status cancelled"):
        api.replay(runs=[run.id], lanes=("baseline",))
    replay = api.replay(runs=[run.id], lanes=("baseline",), status="cancelled")
    assert api.replay_here(replay.id).cases[0].lanes["baseline"].status == RunStatus.FAILED


def test_a_replay_of_a_compensating_workflow_runs_no_saga_and_reports_its_divergence():
    run = drive(api.start("charge_then_break", {"order_id": "CB-1"}).id)
    assert run.status == RunStatus.FAILED  # charged, broke, the saga refunded
    ledger, effects = LedgerEntry.objects.count(), Effect.objects.count()
    rep = api.replay_here(api.replay(runs=[run.id], lanes=("baseline",)).id)
    assert (LedgerEntry.objects.count(), Effect.objects.count()) == (ledger, effects)
    lane = rep.cases[0].lanes["baseline"]
    assert lane.agrees, (lane.status, lane.error, lane.diverged)
