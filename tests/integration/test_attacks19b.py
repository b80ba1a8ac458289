"""Attacks on issue 19b: the prune's pace (duty cycle, stop_after), retention declared by workflows, and the
schedules' overlap policy."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings

from durable_agents import api, clock, retention
from durable_agents.conf import SETTINGS
from durable_agents.engine import prune as engine_prune
from durable_agents.engine.schedules import start_due_schedules
from durable_agents.engine.sweep import sweep
from durable_agents.errors import DefinitionError, InvalidInputError
from durable_agents.models import Effect, Run, RunStatus, Schedule
from durable_agents.states import FINISHED_RUN_STATUSES
from durable_agents.testing import drive
from durable_agents.workflows import call, registry, workflow
from tests.integration.test_schedules import slots_between

pytestmark = pytest.mark.django_db(transaction=True)
POLICY = {"default": {"completed": "30d", "failed": "30d", "cancelled": "30d"}}


@pytest.fixture(autouse=True)
def _reset_clock():
    yield
    clock.reset()


def durable(**extra):
    return override_settings(DURABLE_AGENTS={**settings.DURABLE_AGENTS, **extra})


def old_runs(n: int, *, workflow: str = "record", age_days: float = 400) -> list:
    then = clock.now() - timedelta(days=age_days)
    runs = Run.objects.bulk_create(
        Run(
            workflow=workflow,
            workflow_version=1,
            status=RunStatus.COMPLETED,
            input={"n": i},
            input_hash="x",
            created_at=then,
            updated_at=then,
            finished_at=then,
        )
        for i in range(n)
    )
    return sorted(run.id for run in runs)


def exists(ids) -> set:
    return set(Run.objects.filter(id__in=list(ids)).values_list("id", flat=True))


def keep(ids) -> None:
    """Each run gets an effect waiting for an operator: old enough, but the prune must keep it."""
    for run_id in ids:
        Effect.objects.create(
            run_id=run_id, idempotency_key=f"{run_id}:x", tool="ship", args_hash="h", needs_attention="outcome unknown"
        )


def _work(ctx) -> dict:
    return {}


class FakeClock:
    """The prune's clock: each reading is a second of work, each rest moves it on by the rest."""

    def __init__(self, monkeypatch):
        self.now, self.rests = 0.0, []
        monkeypatch.setattr(engine_prune, "time", type("Clock", (), {"monotonic": staticmethod(self.monotonic)}))
        monkeypatch.setattr(engine_prune, "_sleep", self.sleep)

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now

    def sleep(self, seconds: float) -> None:
        self.rests.append(seconds)
        self.now += seconds


# Retention declared by a workflow


def test_workflow_retention__a_workflow_named_default_does_not_lend_its_ages_to_every_workflow():
    """RETENTION's "default" key means every workflow the policy does not name. A workflow that happens to be named
    "default" and declares retention={"completed": "1d"} must not prune every other workflow's runs after a day
    (runs of "record" here, which nothing in the settings or in its definition lets go)."""
    ids = old_runs(2, age_days=2)
    with registry.isolated():
        try:
            workflow("default", steps=[call("work", _work)], retention={"completed": "1d"})
        except DefinitionError as exc:
            assert "default" in str(exc), exc
        with durable(RETENTION=None, RETENTION_DUTY_CYCLE=1):
            assert retention.load_policy().age("record", "completed") is None, "record has no age of its own"
            retention.prune()
    assert exists(ids) == set(ids), "runs of 'record' were pruned by the ages a workflow named 'default' declared"


@pytest.mark.parametrize("age", [timedelta(days=365 * 200), timedelta.max])
def test_workflow_retention__an_age_past_100_years_is_refused_when_defined(age):
    """A timedelta skips parse_duration's bound: `now - age` then overflows in every prune pass (a traceback from
    the beat task, nothing pruned ever again) instead of a DefinitionError when the workflow is defined."""
    with registry.isolated(), pytest.raises(DefinitionError, match="longer than 100 years"):
        workflow("brief", steps=[call("work", _work)], retention={"completed": age})


# Bad input to the pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"older_than": 30}, "older_than is a duration"),  # seconds? days? a TypeError deep in eligible()
        ({"older_than": timedelta(days=10**6)}, "longer than 100 years"),  # OverflowError
        ({"older_than": timedelta(days=-1)}, "--older-than"),
        (
            {"stop_after": 3600},
            "stop_after is a duration",
        ),  # AttributeError: 'int' object has no attribute 'total_seconds'
        ({"stop_after": timedelta(0)}, "--stop-after"),  # a pass that stops before its first batch, every time
        ({"stop_after": "0s"}, "--stop-after"),
        ({"stop_after": timedelta(seconds=-5)}, "--stop-after"),
    ],
)
def test_prune__bad_durations_from_python_are_invalid_input(kwargs, message):
    ids = old_runs(1)
    with durable(RETENTION=POLICY, RETENTION_DUTY_CYCLE=1), pytest.raises(InvalidInputError, match=message):
        retention.prune(**kwargs)
    assert exists(ids) == set(ids)


def test_command__stop_after_zero_is_exit_2():
    with pytest.raises(CommandError, match="--stop-after") as raised:
        call_command("durable_prune", "--stop-after", "0s")
    assert raised.value.returncode == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"RETENTION_DUTY_CYCLE": 0}, "RETENTION_DUTY_CYCLE"),  # ZeroDivisionError after the first batch
        ({"RETENTION_DUTY_CYCLE": 0.001}, "RETENTION_DUTY_CYCLE"),  # rests 999 times each batch's time
        ({"RETENTION_DUTY_CYCLE": "fast"}, "RETENTION_DUTY_CYCLE"),  # ValueError
        ({"RETENTION_PAUSE_SECONDS": "abc"}, "RETENTION_PAUSE_SECONDS"),  # ValueError
        ({"RETENTION_PAUSE_SECONDS": 1e9}, "RETENTION_PAUSE_SECONDS"),  # 31 years' rest, holding the prune's lock
    ],
)
def test_prune__a_pace_setting_out_of_range_is_a_clear_error_before_any_batch(monkeypatch, extra, message):
    """Celery workers run no system checks: the settings reach the pass as they are. The pass must refuse them
    before it deletes anything, not crash (or sleep for ever holding the lock) after its first batch."""
    monkeypatch.setattr(engine_prune, "_sleep", lambda seconds: pytest.fail(f"the pass rested {seconds} s"))
    ids = old_runs(1)
    with durable(RETENTION=POLICY, **extra), pytest.raises(InvalidInputError, match=message):
        retention.prune()
    assert exists(ids) == set(ids), "the pass deleted a batch before it found its pace was unusable"


def test_settings__the_least_rest_is_bounded_as_pause_is():
    """--pause takes 0 to 3600 s; the setting it defaults took up to 1e9 s (31 years between two batches)."""
    assert SETTINGS["RETENTION_PAUSE_SECONDS"].problem(1e9) is not None
    assert SETTINGS["RETENTION_PAUSE_SECONDS"].problem(3600) is None


# The pace


def test_prune__a_rest_does_not_carry_the_pass_past_stop_after(monkeypatch):
    """At a duty cycle of 0.01 a batch of 1 s is followed by 99 s of rest: with --stop-after 30s the pass must end
    near its window (the maintenance window is the operator's), not rest 99 s, holding the prune's lock, first."""
    fake = FakeClock(monkeypatch)
    monkeypatch.setattr(engine_prune, "window_start", lambda: uuid.UUID(int=0))  # from the smallest id: a full page
    ids = old_runs(6)
    with durable(RETENTION=POLICY):
        report = retention.prune(batch_size=2, duty_cycle=0.01, stop_after="30s")
    assert report.stopped and report.deleted >= 2 and len(exists(ids)) <= 4, report.as_dict()
    assert fake.now <= 35, f"a pass with a 30 s window ended after {fake.now} s (rests: {fake.rests})"


def test_prune__a_page_of_runs_it_must_keep_is_work_and_is_rested_after(monkeypatch):
    """Reading a page of old runs and checking each against forks, children, reliances and effects is work on the
    database, whether or not any run goes: at a duty cycle the pass rests after it too. Without, a table where
    most old runs must be kept (the children of a parent kept for ever) is scanned flat out."""
    fake = FakeClock(monkeypatch)
    ids = old_runs(6)
    keep(ids[:4])
    with durable(RETENTION=POLICY):
        report = retention.prune(batch_size=2, duty_cycle=0.5)
    assert exists(ids) == set(ids[:4]) and report.deleted == 2, report.as_dict()
    assert len(fake.rests) == 3, f"two pages kept and one batch deleted: three rests, got {fake.rests}"


def test_prune__a_short_window_does_not_starve_the_runs_behind_kept_ones(monkeypatch):
    """Windows of one page each. Passes that all began at the smallest id stopped in the same three pages of runs
    that must be kept and never reached the runs behind them; a windowed pass begins where `window_start` says
    (anywhere in the id order: here, where the test puts it) and goes round."""
    FakeClock(monkeypatch)
    ids = sorted(old_runs(8))
    keep(ids[:6])  # three pages of runs that must be kept, then one page that may go
    starts = iter([ids[1], ids[3], ids[5]])
    monkeypatch.setattr(engine_prune, "window_start", lambda: next(starts))
    with durable(RETENTION=POLICY):
        for _ in range(3):
            retention.prune(batch_size=2, duty_cycle=1, stop_after="3s")
    assert exists(ids) == set(ids[:6]), (
        "three windows passed and the prunable runs behind the kept ones are still there"
    )


def test_prune__a_pass_begun_inside_the_id_order_goes_round_to_where_it_began():
    ids = sorted(old_runs(7))
    with durable(RETENTION=POLICY):
        which = retention.eligible(retention.load_policy(), clock.now())
        report = engine_prune.prune(which, batch_size=2, start_at=ids[3])
    assert exists(ids) == set() and report.deleted == 7, report.as_dict()
    assert engine_prune.window_start() != engine_prune.window_start(), "each windowed pass begins somewhere else"


# Schedules: overlap="skip" under catch_up


def live_runs(name: str):
    return Run.objects.filter(idempotency_key__startswith=f"schedule:{name}:").exclude(status__in=FINISHED_RUN_STATUSES)


def test_schedule__overlap_skip_under_catch_up_never_starts_two_runs_at_once():
    """overlap="skip" (the default) promises a slot is not started while the schedule's run is live. Catching up
    five missed slots in one sweep started five runs at once, each overlapping the others: under "skip" the oldest
    owed slot starts and the rest, which would overlap it, are passed over and counted."""
    api.schedule("catcher", "record", cron="0 * * * *", missed="catch_up", catch_up_limit=10)
    begin = clock.now()
    clock.advance(timedelta(hours=5, minutes=30))
    owed = slots_between("0 * * * *", begin, clock.now())
    assert len(owed) in (5, 6)
    assert sweep().scheduled == 1, "catching up under overlap='skip' started runs that overlap each other"
    assert live_runs("catcher").count() == 1
    schedule = Schedule.objects.get(name="catcher")
    assert schedule.overlap_skipped == len(owed) - 1, "the owed slots passed over are counted"
    assert schedule.last_slot == owed[0] and schedule.last_run.idempotency_key.endswith(
        owed[0].strftime("%Y-%m-%dT%H:%M:%SZ")
    ), "the oldest owed slot is the one started, and the schedule's last run is its run"
    assert schedule.next_slot > clock.now(), "the passed-over slots are not owed later"
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
    passed = clock.now()
    clock.advance(timedelta(hours=5, minutes=30))
    assert sweep().scheduled == 0
    owed = slots_between("0 * * * *", passed, clock.now())
    assert Schedule.objects.get(name="tight").overlap_skipped == len(owed), "slots passed over went uncounted"


# --workflow and --older-than


def test_prune__an_empty_workflow_is_refused_not_read_as_every_workflow():
    """`durable_prune --older-than 1d --workflow "$WF"` with WF unset deleted every workflow's runs older than a day."""
    ids = old_runs(2, age_days=2)
    with durable(RETENTION=None), pytest.raises(InvalidInputError, match="--workflow is empty"):
        retention.prune(workflow="", older_than="1d", duty_cycle=1)
    with pytest.raises(CommandError, match="--workflow is empty") as raised:
        call_command("durable_prune", "--older-than", "1d", "--workflow", "")
    assert raised.value.returncode == 2
    assert exists(ids) == set(ids)


def test_schedule__concurrent_sweeps_and_a_finishing_run_neither_double_nor_lose_a_slot_under_skip():
    """Three sweeps at once, catching up seven minutely slots a round, while another thread drives the live run to
    its end: under overlap="skip" at most one run of the schedule is live after any round, and every slot is
    either started once or counted as passed over (started + overlap_skipped = slots due)."""
    api.schedule("racing", "record", cron="* * * * *", missed="catch_up", catch_up_limit=100)
    begin = clock.now()
    barrier = threading.Barrier(5)
    errors: list[BaseException] = []
    live_after_round: list[int] = []

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
            start_due_schedules(clock.now())
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
    due = slots_between("* * * * *", begin, clock.now() - timedelta(minutes=7))
    started = Run.objects.filter(idempotency_key__startswith="schedule:racing:").count()
    skipped = Schedule.objects.get(name="racing").overlap_skipped
    assert started + skipped == len(due), f"{started} started + {skipped} passed over, but {len(due)} slots were due"
