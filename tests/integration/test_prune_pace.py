"""The prune's pace (duty cycle, least rest, stop_after): out-of-range settings and durations are clear errors
before any batch, a rest never carries a pass past stop_after, pages of kept runs count as work, and a short window
still reaches every run by going round the id order.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings

from durable_agents import clock, retention
from durable_agents.conf import SETTINGS
from durable_agents.engine import prune as engine_prune
from durable_agents.errors import InvalidInputError
from durable_agents.models import Effect, Run, RunStatus

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
