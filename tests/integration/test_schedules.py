"""Scheduled runs: each slot started exactly once, across concurrent sweeps, beat restarts and SIGKILLed workers.

The clock is controlled: `clock.advance` shifts the engine's (database) time in this process, and SharedClock
(tests/integration/shared_clock.py) shifts it in the workers too (tests/celery.py reads the shift from Redis before
each task). A slot's run is found by its idempotency key, "schedule:<name>:<slot>": a missed slot has none, a
doubled slot would need two.
"""

from __future__ import annotations

import importlib
import json
import random
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter
from django.apps import apps
from django.contrib.auth.models import Permission
from django.db import connection, connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from durable_agents import api, clock
from durable_agents.engine.heartbeats import SWEEP
from durable_agents.engine.schedules import _a_run_is_live_txn, slot_key, start_due_schedules
from durable_agents.engine.sweep import sweep
from durable_agents.health import Measured
from durable_agents.models import Event, ProcessHeartbeat, Run, Schedule
from durable_agents.testing import drive, wait_for, wait_for_run
from durable_agents.testing.runs import take_lease
from durable_agents.workflows import PlannedStep, call, workflow
from tests.integration.shared_clock import SharedClock

# Slots half a minute and half an hour away from the real time: a test is not timed against a passing slot.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clock_mid_hour")]
ROOT = Path(__file__).resolve().parents[2]


def slots_between(cron: str, after: datetime, until: datetime) -> list[datetime]:
    """Every slot of `cron` (UTC) in (after, until]."""
    it = croniter(cron, after.astimezone(UTC))
    found = []
    while (slot := it.get_next(datetime).astimezone(UTC).replace(fold=0)) <= until:
        found.append(slot)
    return found


def before_first_slot(name: str) -> datetime:
    """Just before the schedule's next slot as the engine placed it (on creation or resume): the `after` of the slots
    it owes. Not clock.now() read a moment after the schedule was made: a slot falling between the two readings
    would be expected but was never owed."""
    return Schedule.objects.get(name=name).next_slot - timedelta(microseconds=1)


def swept_at() -> datetime:
    """The engine's time when the last sweep pass began (as the pass recorded it): the slots it owed end there. Not
    clock.now() read after the pass: a slot falling between the two readings would be expected but not yet owed."""
    return Measured.from_row(ProcessHeartbeat.objects.get(name=SWEEP).load).measured_at


def started(name: str) -> dict[str, int]:
    """Runs of the schedule by idempotency key; a doubled slot would show a count of 2 (it cannot: unique key)."""
    keys = Run.objects.filter(idempotency_key__startswith=f"schedule:{name}:").values_list("idempotency_key", flat=True)
    counts: dict[str, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts


def scheduled_events(name: str) -> int:
    return Event.objects.filter(kind="scheduled", detail__schedule=name).count()


def assert_exactly(name: str, slots: list[datetime]) -> None:
    expected = {slot_key(name, slot) for slot in slots}
    runs = started(name)
    missed = sorted(expected - set(runs))
    extra = sorted(set(runs) - expected)
    assert not missed and not extra, f"slots missed: {missed}; slots not owed but started: {extra}"
    assert scheduled_events(name) == len(expected), "each slot's run records one 'scheduled' event: a doubled start"


# In-process sweeps, the clock moved by hand


def test_schedule__each_slot_starts_once_as_the_clock_moves():
    # Runs stay pending here (no worker): allow overlap, so every slot is owed a run.
    made = clock.now()
    api.schedule("every-5", "record", cron="*/5 * * * *", overlap="allow")
    begin = before_first_slot("every-5")
    assert begin >= made, "the first slot owed comes after the schedule was made"
    for _ in range(40):
        clock.advance(timedelta(minutes=2))
        sweep()
        sweep()  # a second pass at the same time starts nothing
    assert_exactly("every-5", slots_between("*/5 * * * *", begin, swept_at()))
    schedule = Schedule.objects.get(name="every-5")
    assert schedule.next_slot > swept_at() and schedule.last_run is not None
    assert schedule.last_run.idempotency_key == slot_key("every-5", schedule.last_slot)


def test_schedule__concurrent_sweeps_start_each_slot_once():
    api.schedule("racing", "record", cron="* * * * *", missed="catch_up", catch_up_limit=100, overlap="allow")
    begin = before_first_slot("racing")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []
    sweep_times: list[datetime] = []  # the times the sweeps used: the slots owed end at the latest

    def sweeper() -> None:
        try:
            for _ in range(5):
                barrier.wait(timeout=60)
                now = clock.now()
                sweep_times.append(now)
                start_due_schedules(now)
                barrier.wait(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    def mover() -> None:
        for _ in range(5):
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
            clock.advance(timedelta(minutes=7))

    threads = [threading.Thread(target=sweeper) for _ in range(3)] + [threading.Thread(target=mover)]
    clock.advance(timedelta(minutes=7))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, f"a sweep failed: {errors[0]!r}"
    assert_exactly("racing", slots_between("* * * * *", begin, max(sweep_times)))


def test_schedule__after_a_gap_skip_starts_the_latest_slot_and_catch_up_each_within_its_limit():
    api.schedule("skipper", "record", cron="0 * * * *", missed="skip")
    # Runs stay pending here (no worker): allow overlap, so catching up starts each owed slot
    # (see test_schedules_overlap.py).
    api.schedule("catcher", "record", cron="0 * * * *", missed="catch_up", catch_up_limit=10, overlap="allow")
    api.schedule("bounded", "record", cron="0 * * * *", missed="catch_up", catch_up_limit=3, overlap="allow")
    begin = before_first_slot("catcher")
    clock.advance(timedelta(hours=5, minutes=30))  # beat was down: five or six hourly slots passed
    report = sweep()
    owed = slots_between("0 * * * *", begin, swept_at())
    assert len(owed) in (5, 6)
    assert report.scheduled == 1 + len(owed) + 3
    assert_exactly("skipper", owed[-1:])
    assert_exactly("catcher", owed)
    assert_exactly("bounded", owed[-3:])
    skipped = Event.objects.get(kind="scheduled", detail__schedule="skipper").detail
    assert skipped["skipped_slots"] == len(owed) - 1, "the skipped slots are said on the run that was started"
    following = slots_between("0 * * * *", swept_at(), swept_at() + timedelta(hours=1))[0]
    for name in ("skipper", "catcher", "bounded"):
        assert Schedule.objects.get(name=name).next_slot == following, "each jumps to the first slot still ahead"


def test_schedule__a_month_of_missed_minutes_costs_the_limit_not_the_gap():
    api.schedule("minutely", "record", cron="* * * * *", missed="catch_up", catch_up_limit=5, overlap="allow")
    begin = clock.now()
    clock.advance(timedelta(days=30))
    assert sweep().scheduled == 5
    assert_exactly("minutely", slots_between("* * * * *", swept_at() - timedelta(minutes=5), swept_at()))
    oldest = Event.objects.filter(kind="scheduled", detail__schedule="minutely").order_by("id").first().detail
    assert oldest["skipped_slots"] == 1000, "the skipped count stops at 1000 (at least that many were skipped)"
    assert Schedule.objects.get(name="minutely").next_slot > swept_at() > begin


def test_schedule__paused_starts_nothing_and_resume_owes_no_paused_slot():
    api.schedule("pausable", "record", cron="*/10 * * * *", missed="catch_up", overlap="allow")
    api.pause_schedule("pausable")
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 0 and not started("pausable")
    resumed_at = clock.now()
    api.resume_schedule("pausable")
    begin = before_first_slot("pausable")
    assert begin >= resumed_at, "resume owes no slot from before it"
    clock.advance(timedelta(minutes=30))
    sweep()
    assert_exactly("pausable", slots_between("*/10 * * * *", begin, swept_at()))


def test_schedule__redefining_at_start_up_keeps_its_place_and_its_pause():
    api.schedule("nightly", "record", cron="0 3 * * *", input={"steps": 1})
    first = Schedule.objects.get(name="nightly")
    api.pause_schedule("nightly")
    clock.advance(timedelta(days=2))
    again = api.schedule("nightly", "record", cron="0 3 * * *", input={"steps": 1})
    assert again.paused, "an operator's pause survives the app's next start-up"
    assert again.next_slot == first.next_slot and Schedule.objects.count() == 1
    moved = api.schedule("nightly", "record", cron="0 4 * * *", input={"steps": 2})
    assert moved.next_slot > clock.now() and moved.next_slot.hour == 4 and moved.input == {"steps": 2}


def test_schedule__a_time_zone_places_its_slots():
    schedule = api.schedule("paris", "record", cron="0 9 * * *", timezone="Europe/Paris")
    local = schedule.next_slot.astimezone(ZoneInfo("Europe/Paris"))
    assert (local.hour, local.minute) == (9, 0)


def test_schedule__a_slot_that_cannot_start_stays_owed_and_says_why():
    api.schedule("fragile", "record", cron="0 * * * *")
    Schedule.objects.filter(name="fragile").update(workflow="removed_in_a_deploy")
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 0
    schedule = Schedule.objects.get(name="fragile")
    assert "unknown workflow 'removed_in_a_deploy'" in schedule.last_error and schedule.next_slot <= clock.now()
    Schedule.objects.filter(name="fragile").update(workflow="record")  # the deploy is rolled back
    assert sweep().scheduled == 1 and Schedule.objects.get(name="fragile").last_error == ""


def test_schedule__a_slot_whose_arguments_postgres_refuses_stops_no_other_schedule(isolated_registries):
    # A NaN is no JSON Postgres stores (a DataError): that schedule's fault, said on its row, not every sweep's.
    workflow(
        "nan_args",
        steps=[call("s", lambda ctx: None)],
        plan=lambda inp: [PlannedStep("s", "s", {"ratio": float("nan")})],
    )
    api.schedule("bad", "nan_args", cron="0 * * * *")
    api.schedule("good", "record", cron="0 * * * *")
    Schedule.objects.filter(name="bad").update(next_slot=F("next_slot") - timedelta(minutes=1))  # swept first
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 1, "the good schedule started its slot"
    assert len(started("good")) == 1 and started("bad") == {}
    bad = Schedule.objects.get(name="bad")
    assert bad.last_error and bad.next_slot <= clock.now(), "the bad slot stays owed and says why"


def test_schedule__a_slot_that_cannot_start_warns_once_not_at_every_sweep(caplog):
    api.schedule("fragile", "record", cron="0 * * * *")
    Schedule.objects.filter(name="fragile").update(workflow="removed_in_a_deploy")
    clock.advance(timedelta(hours=1))
    with caplog.at_level("WARNING", logger="durable_agents.engine"):
        for _ in range(5):
            sweep()
            clock.advance(timedelta(seconds=30))
    warnings = [r for r in caplog.records if "schedule fragile could not start" in r.getMessage()]
    assert len(warnings) == 1, f"the same failure warned {len(warnings)} times; the admin shows it meanwhile"
    Schedule.objects.filter(name="fragile").update(workflow="other_removed")
    with caplog.at_level("WARNING", logger="durable_agents.engine"):
        sweep()
    assert "other_removed" in caplog.records[-1].getMessage(), "a different failure is a new warning"


# Overlap: a slot due while the last run is still live


def sweep_hours(hours: int) -> int:
    """Move the clock an hour at a time (one hourly slot each) and sweep; how many runs the sweeps started."""
    count = 0
    for _ in range(hours):
        clock.advance(timedelta(hours=1))
        count += sweep().scheduled
    return count


def hold_live(run: Run, how: str) -> None:
    if how == "running":
        assert take_lease(run.id) is not None, "a fresh run is claimable"
    elif how == "waiting":
        Run.objects.filter(pk=run.pk).update(status="waiting")  # stands in for a run parked on an approval


@pytest.mark.parametrize("live", ["pending", "running", "waiting"])
def test_schedule__overlap_skip_passes_over_slots_while_the_last_run_is_live(live):
    api.schedule("tight", "record", cron="0 * * * *")  # overlap="skip", the default
    begin = clock.now()
    assert sweep_hours(1) == 1
    first = Schedule.objects.get(name="tight").last_run
    hold_live(first, live)
    # The sweep re-wakes a pending run whose message it presumes lost ("swept"); the schedule adds nothing.
    own_events = Event.objects.filter(run=first).exclude(kind="swept")
    events = own_events.count()
    assert sweep_hours(3) == 0, f"a slot started while the last run was {live}: the default must not overlap it"
    schedule = Schedule.objects.get(name="tight")
    assert schedule.overlap_skipped == 3, "each slot passed over is counted"
    assert schedule.next_slot > swept_at(), "the passed-over slots are not owed later"
    assert schedule.last_run_id == first.id and own_events.count() == events, "nothing is recorded on the live run"
    Run.objects.filter(pk=first.pk).update(status="pending")  # let it be driven to its end from any live state
    assert drive(first.id).status == "completed"
    assert sweep().scheduled == 0, "a slot passed over is not started once the run ends"
    assert sweep_hours(1) == 1, "the next slot after the run finished starts"
    owed = slots_between("0 * * * *", begin, swept_at())
    assert_exactly("tight", [owed[0], owed[-1]])
    assert Schedule.objects.get(name="tight").overlap_skipped == 3


def test_schedule__overlap_allow_starts_while_the_last_run_is_live():
    api.schedule("loose", "record", cron="0 * * * *", overlap="allow")
    begin = clock.now()
    assert sweep_hours(3) == 3
    assert Run.objects.filter(idempotency_key__startswith="schedule:loose:", status="pending").count() == 3
    assert_exactly("loose", slots_between("0 * * * *", begin, swept_at()))
    assert Schedule.objects.get(name="loose").overlap_skipped == 0


def test_schedule__overlap_skip_under_catch_up_starts_none_of_the_owed_slots_while_live():
    api.schedule("catcher", "record", cron="0 * * * *", missed="catch_up", catch_up_limit=10)
    begin = clock.now()
    assert sweep_hours(1) == 1
    first = Schedule.objects.get(name="catcher").last_run
    passed = swept_at()
    clock.advance(timedelta(hours=5, minutes=30))  # beat was down: five or six slots owed, all overlapping the run
    assert sweep().scheduled == 0
    owed = slots_between("0 * * * *", passed, swept_at())
    assert len(owed) in (5, 6)
    schedule = Schedule.objects.get(name="catcher")
    assert schedule.overlap_skipped == len(owed) and schedule.next_slot > swept_at()
    drive(first.id)
    assert sweep_hours(1) == 1
    assert_exactly("catcher", [slots_between("0 * * * *", begin, passed)[0], schedule.next_slot])


def test_schedule__overlap_skip_counts_a_pruned_last_run_as_finished():
    api.schedule("pruned", "record", cron="0 * * * *")
    assert sweep_hours(1) == 1
    last_run = Schedule.objects.get(name="pruned").last_run_id
    Run.objects.filter(pk=last_run).delete()
    # Retention deletes runs by SQL, not the ORM's SET_NULL: the schedule keeps the bare id (db_constraint=False).
    Schedule.objects.filter(name="pruned").update(last_run_id=last_run)
    assert sweep_hours(1) == 1, "a last run with no row left cannot overlap anything"
    assert Schedule.objects.get(name="pruned").overlap_skipped == 0


def test_schedule__its_runs_carry_its_name_and_other_runs_none():
    api.schedule("named", "record", cron="0 * * * *")
    assert sweep_hours(1) == 1
    assert Schedule.objects.get(name="named").last_run.schedule == "named"
    assert api.start("record", {}).schedule == "", "a run no schedule started names none"


def test_schedule__the_overlap_question_is_answered_by_the_live_runs_index():
    """At a million runs a scan of the run table per due slot would be seconds: the question must fit the partial
    index (its condition implied by the query's), whatever the table's size makes the planner prefer here."""
    schedule = api.schedule("indexed", "record", cron="0 * * * *")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        with CaptureQueriesContext(connection) as queries:
            _a_run_is_live_txn(schedule)
        [query] = queries.captured_queries
        cursor.execute(f"EXPLAIN {query['sql']}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "durable_run_schedule_live" in plan, plan


def test_migration__names_the_schedule_of_every_slot_run_before_it():
    """Migration 0018 added Run.schedule: runs started before it for a slot are named from their slot key, live or
    finished (a finished one can be resumed or rerun: live again); other keys are left as they were."""
    migration = importlib.import_module("durable_agents.migrations.0018_run_schedule")
    slot = datetime(2026, 12, 1, 3, tzinfo=UTC)
    live = api.start("record", {"n": 1}, idempotency_key=slot_key("night:shift", slot))
    done = api.start("record", {"n": 2}, idempotency_key=slot_key("night:shift", slot + timedelta(days=1)))
    drive(done.id)
    other = api.start("record", {"n": 3}, idempotency_key="schedule:looks-like-one")
    with connection.schema_editor() as editor:  # the migration names the runs of the database it migrates
        migration.name_scheduled_runs(apps, editor)
    named = dict(Run.objects.filter(pk__in=[live.id, done.id, other.id]).values_list("id", "schedule"))
    assert named == {live.id: "night:shift", done.id: "night:shift", other.id: ""}


def test_migration__the_new_column_has_a_database_default_for_the_previous_versions_inserts():
    """During a rolling deploy the previous version's processes insert runs without naming `schedule`: without a
    database default (Django drops the one AddField uses) each of their starts fails until they restart."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT column_default FROM information_schema.columns WHERE table_name = %s AND column_name = 'schedule'",
            [Run._meta.db_table],
        )
        [(default,)] = cursor.fetchall()
    assert default is not None and default.startswith("''"), default


def test_schedule__redefining_the_overlap_policy_updates_it_without_retiming():
    first = api.schedule("nightly", "record", cron="0 3 * * *")
    assert first.overlap == "skip" and first.overlap_skipped == 0
    api.pause_schedule("nightly")
    clock.advance(timedelta(days=2))
    again = api.schedule("nightly", "record", cron="0 3 * * *", overlap="allow")
    stored = Schedule.objects.get(name="nightly")
    assert again.overlap == stored.overlap == "allow"
    assert stored.next_slot == first.next_slot and stored.paused, "a new overlap policy neither retimes nor resumes"


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"cron": "61 * * * *"}, api.InvalidInputError, "invalid cron expression '61 * * * *'"),
        ({"cron": "* * * * * *"}, api.InvalidInputError, "five fields"),
        ({"cron": "0 0 31 2 *"}, api.InvalidInputError, "never fires"),
        ({"cron": "@sometimes"}, api.InvalidInputError, "invalid cron expression"),
        ({"cron": "0 * * * *", "workflow": "nope"}, api.UnknownWorkflowError, "unknown workflow 'nope'"),
        ({"cron": "0 * * * *", "timezone": "Mars/Olympus"}, api.InvalidInputError, "unknown time zone"),
        ({"cron": "0 * * * *", "missed": "sometimes"}, api.InvalidInputError, "missed must be one of skip, catch_up"),
        ({"cron": "0 * * * *", "overlap": "sometimes"}, api.InvalidInputError, "overlap must be one of skip, allow"),
        ({"cron": "0 * * * *", "overlap": None}, api.InvalidInputError, "overlap must be a string"),
        ({"cron": "0 * * * *", "catch_up_limit": 0}, api.InvalidInputError, "catch_up_limit"),
        ({"cron": "0 * * * *", "name": "x" * 201}, api.InvalidInputError, "at most 200 fit"),
        ({"cron": "0 * * * *", "name": "a\x00b"}, api.InvalidInputError, "\\u0000"),
        ({"cron": "0 * * * *", "name": "  "}, api.InvalidInputError, "schedule name is empty"),
        ({"cron": "0 * * * *", "input": {"x": float("nan")}}, api.InvalidInputError, "NaN"),
    ],
)
def test_schedule__hostile_definitions_are_clear_errors_and_write_nothing(kwargs, error, says):
    arguments = {"name": "hostile", "workflow": "record", **kwargs}
    with pytest.raises(error) as raised:
        api.schedule(arguments.pop("name"), arguments.pop("workflow"), **arguments)
    assert says in str(raised.value)
    assert not Schedule.objects.exists()


def test_schedule__unknown_names_are_clear_errors():
    for operation in (api.pause_schedule, api.resume_schedule, api.unschedule):
        with pytest.raises(api.ScheduleNotFoundError, match="no schedule is named 'ghost'"):
            operation("ghost")


# Real workers and their embedded beat, SIGKILLed and restarted


def test_schedule__survives_beat_restarts_and_sigkilled_workers_without_a_missed_or_doubled_slot(start_worker):
    shared = SharedClock()
    shared.to_half_past()
    # A SIGKILL can leave the last run live while slots pass: allow overlap, so each slot is owed a run.
    api.schedule("hourly", "record", cron="0 * * * *", missed="catch_up", catch_up_limit=24, overlap="allow")
    begin = clock.now()
    worker = start_worker(beat=True, env=shared.env)
    rng = random.Random(19)
    for round_ in range(9):
        shared.advance(timedelta(hours=1))
        owed = slots_between("0 * * * *", begin, clock.now())
        if round_ % 3 == 0:
            # SIGKILL at a random instant of a sweep (beat sweeps every half second), with slots passing while down.
            time.sleep(rng.uniform(0, 0.6))
            worker.kill()
            shared.advance(timedelta(hours=2))
            owed = slots_between("0 * * * *", begin, clock.now())
            worker = start_worker(beat=True, env=shared.env)
        elif round_ % 3 == 1:
            worker.stop()  # a graceful restart of beat and worker (a deploy)
            worker = start_worker(beat=True, env=shared.env)
        wait_for(lambda owed=owed: len(started("hourly")) >= len(owed), timeout=90, what=f"{len(owed)} slots started")
        assert_exactly("hourly", owed)
    for key in started("hourly"):
        wait_for_run(Run.objects.get(idempotency_key=key).id, timeout=120)
    time.sleep(1.5)  # more sweeps pass at the same time: nothing more is owed
    assert_exactly("hourly", slots_between("0 * * * *", begin, clock.now()))


def test_schedule__two_beats_sweeping_at_once_start_each_slot_once(start_worker):
    shared = SharedClock()
    shared.to_half_past()
    api.schedule("twice-swept", "record", cron="*/20 * * * *", missed="catch_up", overlap="allow")
    begin = clock.now()
    # Two embedded beats: a misconfigured deploy, or the old beat still up while the new one starts.
    start_worker(beat=True, env=shared.env)
    start_worker(beat=True, env=shared.env)
    for _ in range(6):
        shared.advance(timedelta(minutes=50))
        owed = slots_between("*/20 * * * *", begin, clock.now())
        wait_for(lambda owed=owed: len(started("twice-swept")) >= len(owed), timeout=90, what="the owed slots")
    time.sleep(1.5)  # both beats sweep again at the same time: nothing more is owed
    assert_exactly("twice-swept", slots_between("*/20 * * * *", begin, clock.now()))


class _Rollback(Exception):
    pass


def test_schedule__a_worker_sigkilled_inside_the_sweeps_transaction_starts_the_slot_once(start_worker):
    shared = SharedClock()
    shared.to_half_past()
    api.schedule("killed", "record", cron="0 * * * *")
    shared.advance(timedelta(hours=1))
    slot = Schedule.objects.get(name="killed").next_slot
    assert slot <= clock.now()
    key = slot_key("killed", slot)
    holding, release = threading.Event(), threading.Event()
    blocking: list[int] = []

    def blocker() -> None:
        # An uncommitted run under the slot's key: the sweep's insert of that key waits on it, mid-transaction.
        try:
            with transaction.atomic():
                api.start("record", {"blocker": True}, idempotency_key=key)
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    blocking.append(cursor.fetchone()[0])
                holding.set()
                release.wait(timeout=120)
                raise _Rollback
        except _Rollback:
            pass
        finally:
            connections.close_all()

    thread = threading.Thread(target=blocker)
    thread.start()
    try:
        assert holding.wait(timeout=30)
        worker = start_worker(beat=True, env=shared.env)

        def sweep_waiting() -> int | None:
            # The backend waiting on the blocker's transaction (the start's statement text may name its table past
            # the part pg_stat_activity keeps).
            with connection.cursor() as cursor:
                cursor.execute("SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", blocking)
                row = cursor.fetchone()
            return row[0] if row else None

        backend = wait_for(sweep_waiting, timeout=60, what="the sweep to insert the slot's run and wait on the key")
        worker.kill()  # between starting the slot's run and advancing the schedule
    finally:
        release.set()
        thread.join(timeout=60)

    def backend_gone() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [backend])
            return cursor.fetchone() is None

    wait_for(backend_gone, timeout=60, what="Postgres to roll back the killed worker's transaction")
    assert not started("killed"), "the killed sweep's transaction left a run behind"
    assert Schedule.objects.get(name="killed").next_slot == slot, "the slot must still be owed"

    start_worker(beat=True, env=shared.env)
    wait_for(lambda: started("killed"), timeout=60, what="the restarted beat to start the owed slot")
    wait_for_run(Run.objects.get(idempotency_key=key).id, timeout=120)
    time.sleep(1.5)  # more sweeps: the slot is not started again
    assert_exactly("killed", [slot])
    assert Schedule.objects.get(name="killed").next_slot > clock.now()


# The command line


def test_durable_schedules__lists_pauses_and_resumes(manage):
    assert "no schedules" in manage("durable_schedules").stdout
    api.schedule("nightly", "record", cron="0 3 * * *", timezone="Europe/Paris")
    listed = manage("durable_schedules").stdout
    assert "nightly  record  0 3 * * * (Europe/Paris, skip)  next 20" in listed and "no run yet" in listed
    assert "no run yet  overlap skip" in listed and "skipped while" not in listed
    paused = manage("durable_schedules", "pause", "nightly")
    assert paused.returncode == 0 and "schedule nightly: paused" in paused.stdout
    assert Schedule.objects.get(name="nightly").paused
    [row] = json.loads(manage("durable_schedules", "--json").stdout)
    assert row["paused"] is True and row["cron"] == "0 3 * * *"
    assert row["overlap"] == "skip" and row["overlap_skipped"] == 0
    Schedule.objects.filter(name="nightly").update(overlap_skipped=3)
    assert "overlap skip (3 skipped while the last run was live)" in manage("durable_schedules").stdout
    resumed = manage("durable_schedules", "resume", "nightly")
    assert resumed.returncode == 0 and "active, next slot" in resumed.stdout
    assert not Schedule.objects.get(name="nightly").paused


def test_durable_schedules__trigger_starts_a_run_now_and_leaves_the_slots_as_they_were(manage):
    api.schedule("nightly", "record", cron="0 3 * * *", input={"steps": 1})
    slot = Schedule.objects.get(name="nightly").next_slot
    triggered = manage("durable_schedules", "trigger", "nightly", "--as", "ops")
    assert triggered.returncode == 0, triggered.stderr
    run = Run.objects.get(schedule="nightly")
    assert triggered.stdout.strip() == f"schedule nightly started run {run.pk} (record)"
    assert Event.objects.get(run=run, kind="scheduled").actor == "ops", "who triggered it is in the run's history"
    again = json.loads(manage("durable_schedules", "trigger", "nightly", "--json").stdout)
    second = Run.objects.filter(schedule="nightly").exclude(pk=run.pk).get()
    assert again == {"schedule": "nightly", "run": str(second.pk), "workflow": "record"}, "each trigger starts one"
    assert Schedule.objects.get(name="nightly").next_slot == slot, "the slots keep their times"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pause", "ghost"], "no schedule is named 'ghost'; `durable_schedules` lists them"),
        (["resume", "ghost"], "no schedule is named 'ghost'"),
        (["trigger", "ghost"], "no schedule is named 'ghost'; `durable_schedules` lists them"),
        (["trigger"], "trigger needs a schedule's name: durable_schedules trigger NAME"),
        (["pause"], "pause needs a schedule's name"),
        (["pause", "a" * 300], "the schedule name is 300 characters long"),
    ],
)
def test_durable_schedules__user_mistakes_exit_2_with_one_line_on_stderr(manage, args, message):
    result = manage("durable_schedules", *args)
    assert result.returncode == 2, f"{args}: exit {result.returncode}, stderr {result.stderr}"
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# The admin


def test_admin__lists_schedules_and_pauses_and_resumes_them(admin_client):
    api.schedule("nightly", "record", cron="0 3 * * *")
    api.schedule("hourly", "record", cron="0 * * * *")
    clock.advance(timedelta(hours=1))
    sweep()
    page = admin_client.get("/admin/durable_agents/schedule/").content.decode()
    assert "nightly" in page and "<code>0 3 * * *</code>" in page
    assert "skip · skipped: 0" in page, "the overlap policy and its count of skipped slots are listed"
    last_run = Schedule.objects.get(name="hourly").last_run_id
    assert f"/admin/durable_agents/run/{last_run}/change/" in page, "the last run links to its page"
    pks = [Schedule.objects.get(name="nightly").pk]
    response = admin_client.post(
        "/admin/durable_agents/schedule/", {"action": "pause_selected", "_selected_action": pks}, follow=True
    )
    assert "1 schedule paused" in response.content.decode() and Schedule.objects.get(name="nightly").paused
    admin_client.post("/admin/durable_agents/schedule/", {"action": "resume_selected", "_selected_action": pks})
    assert not Schedule.objects.get(name="nightly").paused


def test_admin__a_viewer_without_the_permission_cannot_pause(client, django_user_model):
    viewer = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_schedule"))
    client.force_login(viewer)
    schedule = api.schedule("nightly", "record", cron="0 3 * * *")
    page = client.get("/admin/durable_agents/schedule/").content.decode()
    assert "nightly" in page and "pause_selected" not in page
    client.post("/admin/durable_agents/schedule/", {"action": "pause_selected", "_selected_action": [schedule.pk]})
    assert not Schedule.objects.get(name="nightly").paused
