"""A schedule's overlap="skip" sees every live run the schedule started (`Run.schedule`), not only the last:
under catch-up, after switching policy, across resumes, reruns, forks, redefinitions, concurrency-key queues and
racing sweeps; slots missed while a run was live are all counted. Migration 0018 names the runs a schedule started
before it from their slot keys, so those are seen too.
"""

from __future__ import annotations

import importlib
import threading
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.db import connections

from durable_agents import api, clock
from durable_agents.engine.schedules import slot_key, start_due_schedules
from durable_agents.engine.sweep import sweep
from durable_agents.models import Run, Schedule
from durable_agents.states import FINISHED_RUN_STATUSES
from durable_agents.testing import drive
from tests.integration.test_schedules import before_first_slot, slots_between, sweep_hours, swept_at

# Slots half a minute and half an hour away from the real time: a test is not timed against a passing slot.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clock_mid_hour")]
migration = importlib.import_module("durable_agents.migrations.0018_run_schedule")
# What a RunPython function is handed (its schema editor): the migration names runs in the database it migrates.
MIGRATING = SimpleNamespace(connection=connections["default"])
SLOT = datetime(2026, 12, 1, 3, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


def before_0018(run: Run) -> None:
    """The run as it was before migration 0018: the column did not exist, so it names no schedule."""
    Run.objects.filter(pk=run.pk).update(schedule="")


def failed_slot_run(name: str) -> Run:
    """A schedule of `broken` (its second step raises) whose first slot's run has failed."""
    api.schedule(name, "broken", cron="0 * * * *")
    assert sweep_hours(1) == 1
    run = Schedule.objects.get(name=name).last_run
    assert drive(run.id).status == "failed"
    return run


# Migration 0018


def test_migration__a_run_that_failed_before_it_and_is_resumed_after_is_seen():
    """The migration names only the runs live when it runs: "finished runs keep '' — the policy never asks about
    them". But a failed (or cancelled) run comes back to life by `resume`, and a completed one by a rerun from a
    step. A nightly run that failed the day before the deploy, resumed by an operator the day after, is live
    and unnamed: overlap="skip" starts the next slot beside it, while the same run failed after the deploy would
    have been seen. Finished runs that can come back must be named too (or the check must fall back to the key)."""
    run = failed_slot_run("nightly")
    before_0018(run)
    migration.name_scheduled_runs(apps, MIGRATING)
    assert api.resume(run.id).status == "pending"
    assert sweep_hours(1) == 0, "overlap='skip' started a slot beside a resumed run of the schedule"
    assert Schedule.objects.get(name="nightly").overlap_skipped == 1


def test_migration__a_schedule_name_with_a_newline_is_parsed():
    """api.schedule accepts any text a column stores (check_text refuses only NUL and lone surrogates), so a name
    may hold a newline. The migration's `.+` stops at it: the live run of "night\\nshift" is left unnamed and the
    sweep, which asks only Run.schedule, starts the next slot beside it."""
    name = "night\nshift"
    api.schedule(name, "record", cron="0 * * * *")
    assert sweep_hours(1) == 1
    run = Schedule.objects.get(name=name).last_run
    before_0018(run)
    migration.name_scheduled_runs(apps, MIGRATING)
    assert Run.objects.get(pk=run.pk).schedule == name, "the migration did not name the run of a multi-line name"
    assert sweep_hours(1) == 0


def test_migration__a_look_alike_key_too_long_for_the_column_does_not_abort_it():
    """Idempotency keys are the users' (255 characters): "schedule:<220 x>:<a slot>" is a valid key no
    schedule made (Schedule.name holds 200). Live at migration time it matches the slot pattern and its 220-char
    "name" goes into Run.schedule (varchar 200): on Postgres the UPDATE raises DataError and `migrate` fails,
    and keeps failing until that run ends. A name longer than any schedule's is not a schedule's: skip it."""
    key = f"schedule:{'x' * 220}:2026-12-01T03:00:00Z"
    assert len(key) <= 255
    run = api.start("record", {}, idempotency_key=key)
    migration.name_scheduled_runs(apps, MIGRATING)
    assert Run.objects.get(pk=run.pk).schedule == ""


def test_migration__names_unicode_and_colon_names_at_the_longest_and_leaves_user_keys_alone():
    """Held: the greedy name stops at the last ':<slot>'; 200 characters of anything fit the column."""
    cases = {
        "a:b:c": None,
        "nächtlich 夜間 🌙": None,
        ("é:" * 100)[:200]: None,
        "ends-like-a-slot:2026-12-01T03:00:00Z": None,
    }
    for name in cases:
        cases[name] = api.start("record", {"n": name}, idempotency_key=slot_key(name, SLOT)).id
    near_misses = [
        api.start("record", {"k": key}, idempotency_key=key).id
        for key in (
            "schedule:x:2026-12-01T03:00:00",  # no Z
            "schedule::2026-12-01T03:00:00Z",  # no name
            "schedule:x:2026-12-01 03:00:00Z",
            "Schedule:x:2026-12-01T03:00:00Z",
            "schedule:x:2026-12-01T03:00:00.123Z",
        )
    ]
    migration.name_scheduled_runs(apps, MIGRATING)
    named = dict(Run.objects.values_list("id", "schedule"))
    assert {name: named[run_id] for name, run_id in cases.items()} == {name: name for name in cases}
    assert {named[run_id] for run_id in near_misses} == {""}


# Runs of a schedule that come back, or are copied


def test_schedule__a_resumed_failed_run_is_live_again_and_seen():
    """Held: a failed slot run resumed keeps its schedule's name and is live: the next slot is passed over."""
    run = failed_slot_run("resumed")
    assert api.resume(run.id).status == "pending"
    assert sweep_hours(1) == 0
    assert Schedule.objects.get(name="resumed").overlap_skipped == 1


def test_schedule__a_completed_run_rerun_from_a_step_is_seen():
    """Held: `resume(from_step=...)` of a completed slot run makes it live again, under its schedule's name."""
    api.schedule("rerun", "record", cron="0 * * * *")
    assert sweep_hours(1) == 1
    run = Schedule.objects.get(name="rerun").last_run
    assert drive(run.id).status == "completed"
    assert api.resume(run.id, from_step="s001").status == "pending"
    assert sweep_hours(1) == 0
    assert Schedule.objects.get(name="rerun").overlap_skipped == 1


def test_schedule__a_fork_of_a_failed_slot_run_with_its_input_is_seen():
    """A judgment call, argued here as a hole. A slot run that failed is done again one of two ways: `resume`
    (the run keeps Run.schedule: the next slot is passed over, test above) or `fork` at the failed step with the
    same input — the way every refusal of a compensated run points to ("start the work again as a new run with
    `manage.py durable_fork`"), the same work sharing the source's effect scope and concurrency key. The fork
    names no schedule, so the sweep starts the next slot beside it: two runs of the nightly job at once under
    overlap='skip', depending only on which of the two sanctioned retries the operator chose."""
    run = failed_slot_run("forked")
    fork = api.fork(run.id, "broken")
    assert fork.status == "pending"
    assert sweep_hours(1) == 0, "overlap='skip' started a slot beside a fork (same work, same input) of its run"


# Names reused, children, queues


def test_schedule__a_schedule_defined_again_under_its_name_sees_the_live_runs_of_the_one_deleted():
    """Held (and meant: names are the identity `api.schedule` is idempotent on): unschedule + schedule with the
    same name is the same job; its predecessor's live run still keeps the next slot from starting."""
    api.schedule("again", "record", cron="0 * * * *")
    assert sweep_hours(1) == 1
    api.unschedule("again")
    api.schedule("again", "record", cron="30 * * * *")
    assert sweep_hours(1) == 0
    assert Schedule.objects.get(name="again").overlap_skipped == 1


def test_schedule__a_run_of_another_schedule_or_none_does_not_block():
    """Held: only the schedule's own runs count, not a run started by hand with the same workflow and input, nor
    a run of a schedule whose name is a prefix of this one's."""
    api.schedule("rep", "record", cron="0 * * * *")
    api.schedule("report", "record", cron="0 * * * *")
    api.start("record", {})
    assert sweep_hours(1) == 2
    drive(Schedule.objects.get(name="report").last_run_id)
    assert sweep_hours(1) == 1, "'report' was blocked by the live run of 'rep'"
    assert Schedule.objects.get(name="report").overlap_skipped == 0
    assert Schedule.objects.get(name="rep").overlap_skipped == 1


def test_schedule__a_run_queued_on_its_concurrency_key_counts_as_live():
    """Held: a slot run queued behind its concurrency key (pending, not admitted) is live for the overlap policy."""
    holder = api.start("record", {}, concurrency_key="acct-1")
    api.schedule("queued", "record", cron="0 * * * *")
    Schedule.objects.filter(name="queued").update(input={"steps": 1})
    assert sweep_hours(1) == 1
    run = Schedule.objects.get(name="queued").last_run
    Run.objects.filter(pk=run.pk).update(concurrency_key="acct-1", concurrency_limit=1, admitted_at=None)
    assert sweep_hours(1) == 0
    drive(holder.id)
    assert Schedule.objects.get(name="queued").overlap_skipped == 1


def test_schedule__the_longest_name_fits_its_runs_key_and_column():
    """Held: a 200-character name (Schedule.name's maximum) makes a 230-character key and fits Run.schedule."""
    name = "n" * 199 + "夜"
    api.schedule(name, "record", cron="0 * * * *")
    assert sweep_hours(1) == 1
    schedule = Schedule.objects.get(name=name)
    assert schedule.last_error == "" and schedule.last_run.schedule == name
    assert sweep_hours(1) == 0


def test_schedule__two_sweeps_racing_see_a_live_run_that_is_not_the_last():
    """Held: two sweeps at once (own connections) on a schedule whose live run is an older one (started under
    overlap='allow', a later run since ended): neither starts the slot, and it is counted once."""
    api.schedule("race", "record", cron="0 * * * *", overlap="allow")
    assert sweep_hours(2) == 2
    older, last = Run.objects.filter(schedule="race").order_by("idempotency_key")
    drive(last.id)
    api.schedule("race", "record", cron="0 * * * *", overlap="skip")
    clock.advance(timedelta(hours=1))
    barrier, started, errors = threading.Barrier(2), [], []

    def sweeper() -> None:
        try:
            barrier.wait(timeout=30)
            started.append(start_due_schedules(clock.now()))
        except BaseException as exc:  # noqa: BLE001 - reported in the test's thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=sweeper) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and started == [0, 0], (errors, started)
    assert Run.objects.get(pk=older.pk).status == "pending"
    assert Schedule.objects.get(name="race").overlap_skipped == 1


# Schedules: overlap="skip" under catch_up


def live_runs(name: str):
    return Run.objects.filter(idempotency_key__startswith=f"schedule:{name}:").exclude(status__in=FINISHED_RUN_STATUSES)


def test_schedule__overlap_skip_under_catch_up_never_starts_two_runs_at_once():
    """overlap="skip" (the default) promises a slot is not started while the schedule's run is live. Catching up
    five missed slots in one sweep started five runs at once, each overlapping the others: under "skip" the oldest
    owed slot starts and the rest, which would overlap it, are passed over and counted."""
    api.schedule("catcher", "record", cron="0 * * * *", missed="catch_up", catch_up_limit=10)
    begin = before_first_slot("catcher")
    clock.advance(timedelta(hours=5, minutes=30))
    assert sweep().scheduled == 1, "catching up under overlap='skip' started runs that overlap each other"
    owed = slots_between("0 * * * *", begin, swept_at())
    assert len(owed) in (5, 6)
    assert live_runs("catcher").count() == 1
    schedule = Schedule.objects.get(name="catcher")
    assert schedule.overlap_skipped == len(owed) - 1, "the owed slots passed over are counted"
    assert schedule.last_slot == owed[0] and schedule.last_run.idempotency_key.endswith(
        owed[0].strftime("%Y-%m-%dT%H:%M:%SZ")
    ), "the oldest owed slot is the one started, and the schedule's last run is its run"
    assert schedule.next_slot > swept_at(), "the passed-over slots are not owed later"
    drive(schedule.last_run_id)
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 1, "the next slot after the run ended starts"


def test_schedule__switching_to_overlap_skip_sees_every_live_run_not_only_the_last():
    api.schedule("switcher", "record", cron="0 * * * *", overlap="allow")
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 1
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 1
    first, last = sorted(live_runs("switcher"), key=lambda run: run.idempotency_key)
    drive(last.id)  # the last run ends; the first is still pending
    api.schedule("switcher", "record", cron="0 * * * *", overlap="skip")
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 0, "a slot started beside a live run of the schedule under overlap='skip'"


def test_schedule__slots_missed_while_the_last_run_was_live_are_all_counted():
    """Beat down five hours while the last run was live: under missed="skip" only the latest slot is "due", and the
    four before it vanished from every count (no run to carry a `scheduled` event). Each was due while the run
    was live: overlap_skipped counts them all, or the admin shows one slot passed over where five were."""
    api.schedule("tight", "record", cron="0 * * * *")
    clock.advance(timedelta(hours=1))
    assert sweep().scheduled == 1
    passed = swept_at()
    clock.advance(timedelta(hours=5, minutes=30))
    assert sweep().scheduled == 0
    owed = slots_between("0 * * * *", passed, swept_at())
    assert Schedule.objects.get(name="tight").overlap_skipped == len(owed), "slots passed over went uncounted"


def test_schedule__concurrent_sweeps_and_a_finishing_run_neither_double_nor_lose_a_slot_under_skip():
    """Three sweeps at once, catching up seven minutely slots a round, while another thread drives the live run to
    its end: under overlap="skip" at most one run of the schedule is live after any round, and every slot is
    either started once or counted as passed over (started + overlap_skipped = slots due)."""
    api.schedule("racing", "record", cron="* * * * *", missed="catch_up", catch_up_limit=100)
    begin = before_first_slot("racing")
    barrier = threading.Barrier(5)
    errors: list[BaseException] = []
    live_after_round: list[int] = []
    sweep_times: list[datetime] = []  # the times the sweeps used: the slots due end at the latest

    def guarded(body):
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
                errors.append(exc)
                barrier.abort()
            finally:
                connections.close_all()

        return run

    def sweeper() -> None:
        for _ in range(6):
            barrier.wait(timeout=60)
            now = clock.now()
            sweep_times.append(now)
            start_due_schedules(now)
            barrier.wait(timeout=60)

    def finisher() -> None:
        for _ in range(6):
            barrier.wait(timeout=60)
            for run_id in live_runs("racing").values_list("id", flat=True):
                drive(run_id)
            barrier.wait(timeout=60)

    def mover() -> None:
        for _ in range(6):
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
            live_after_round.append(live_runs("racing").count())
            clock.advance(timedelta(minutes=7))

    threads = [threading.Thread(target=guarded(sweeper)) for _ in range(3)]
    threads += [threading.Thread(target=guarded(finisher)), threading.Thread(target=guarded(mover))]
    clock.advance(timedelta(minutes=7))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, f"a thread failed: {errors[0]!r}"
    assert max(live_after_round) <= 1, f"two runs of the schedule were live at once: {live_after_round}"
    due = slots_between("* * * * *", begin, max(sweep_times))
    started = Run.objects.filter(idempotency_key__startswith="schedule:racing:").count()
    skipped = Schedule.objects.get(name="racing").overlap_skipped
    assert started + skipped == len(due), f"{started} started + {skipped} passed over, but {len(due)} slots were due"
